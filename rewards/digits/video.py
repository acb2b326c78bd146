"""The digits-video training reward ``digits_video``: learned nets score identity, colour, motion and consistency.

Two small nets, trained by ``scripts/pretrain_digits_video.py`` on the reward part of sklearn's digits only
(``rewards.digits.video_data.video_split``) and shipped in ``assets/digits_video/``:

- ``reward_frames``: the digits reward classifier's architecture (:class:`~rewards.digits.classifiers.DigitsClassifier`,
  ``cnn``) trained on single 16×16 frames of clips (a digit anywhere on the canvas) → ``p(digit | frame)``,
  ``p(colour | frame)``;
- ``reward_motion``: :class:`MotionNet`, a 3-D conv net over the clip's ink (brightest channel) → ``p(direction | clip)``
  over left, right, up, down and still.

For a clip ``x`` with frames ``x_f`` and prompt ``(d, c, m)``:

- identity ``I = mean_f p(d | x_f)``, colour ``C = mean_f p(c | x_f)``, direction ``M = p(m | x)``;
- consistency ``K = mean_f BC(p(· | x_f), p(· | x_{f+1}))``, the Bhattacharyya coefficient ``Σ_k √(p_k q_k)`` of
  consecutive frames' digit distributions (1 when every frame reads as the same digit with the same certainty);
- ``digits_video = (I + C + M + K) / 4`` in [0, 1] (``combine="mean"``, the default) or ``I · C · M · K``
  (``combine="product"``, the probability that all four hold if they were independent), with the four factors as
  extra outputs ``digits_video_identity`` etc. On the first base the product was about 0.01 with a spread of 0.02
  within a group and Flow-GRPO moved nothing in 40 steps; on the shipped (second) base it keeps gold identity where
  the mean lets Flow-GRPO trade it away, but moves gold little (``benchmarks/RESULTS.md``). The mean gives every
  property its own signal; its identity factor can be fooled (the frame CNN reads digits in frames the gold judge
  does not), which Flow-GRPO finds and DiffusionNFT on the same reward does not.

The gold judge (``rewards.digits.video_judge``) measures the same four properties another way and shares no weights
or data with this reward.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from rewards.base import Reward, register_reward
from rewards.digits.classifiers import DigitsClassifier
from rewards.digits.io import JsonSafetensorsMixin
from rewards.digits.video_data import DIRECTION_NAMES, FRAMES, VIDEO_ASSET_DIR, check_clips, parse_prompts

PROPERTIES = ("identity", "colour", "direction", "consistency")
COMBINES = ("mean", "product")


class MotionNet(JsonSafetensorsMixin, nn.Module):
    """Direction of a clip: 3-D convolutions over its ink ``[B, 1, F, 16, 16]``, pooled → 5 logits (left, right, up,
    down, still).

    Args:
        width: channels of the first convolution (the others have twice as many).
    """

    def __init__(self, width: int = 16):
        super().__init__()
        self.width = width
        self.trunk = nn.Sequential(
            nn.Conv3d(1, width, 3, padding=1), nn.GELU(),
            nn.Conv3d(width, 2 * width, 3, stride=(1, 2, 2), padding=1), nn.GELU(),
            nn.Conv3d(2 * width, 2 * width, 3, padding=1), nn.GELU(),
        )
        self.head = nn.Linear(2 * width, len(DIRECTION_NAMES) + 1)

    @property
    def config(self) -> dict:
        return {"width": self.width}

    def forward(self, clips: torch.Tensor) -> torch.Tensor:
        """``clips [B, F, 3, 16, 16]`` float in [0, 1] → direction logits ``[B, 5]``."""
        ink = clips.amax(2).unsqueeze(1) * 2.0 - 1.0  # [B, 1, F, H, W]
        return self.head(self.trunk(ink).mean((2, 3, 4)))


def frame_probabilities(classifier: DigitsClassifier, clips: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p(digit | frame) [B, F, 10], p(colour | frame) [B, F, 6])`` of float clips ``[B, F, 3, 16, 16]``."""
    b = clips.shape[0]
    d_logits, c_logits = classifier(clips.flatten(0, 1))
    return d_logits.softmax(-1).view(b, FRAMES, -1), c_logits.softmax(-1).view(b, FRAMES, -1)


@register_reward("digits_video")
class DigitsVideoReward(Reward):
    """The mean (or product) of the four factors of the shipped reward nets (module docstring); receives whole clips
    (``video = True``).

    Args:
        path: folder holding ``reward_frames/`` and ``reward_motion/`` (default: the shipped ``assets/digits_video``).
        combine: ``"mean"`` or ``"product"`` of the four factors.
    """

    unit = "probability in [0, 1]"
    scale = (0.0, 1.0)
    video = True

    def __init__(self, path: str | None = None, device: str = "cpu", combine: str = "mean"):
        if combine not in COMBINES:
            raise ValueError(f"digits_video: combine={combine!r} is unknown; set +reward.options.digits_video.combine to one of {COMBINES}")
        self.combine = combine
        folder = Path(path) if path else VIDEO_ASSET_DIR
        self.device = device
        self.frames = DigitsClassifier.from_pretrained(folder / "reward_frames").to(device)
        self.motion = MotionNet.from_pretrained(folder / "reward_motion").to(device)

    @torch.no_grad()
    def properties(self, clips: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        """The four factors ``[B]`` of float clips ``[B, F, 3, 16, 16]`` in [0, 1] (keys :data:`PROPERTIES`)."""
        digit, colour, direction = (t.to(self.device) for t in parse_prompts(prompts))
        clips = clips.to(self.device)
        p_digit, p_colour = frame_probabilities(self.frames, clips)
        p_direction = self.motion(clips).softmax(-1)
        pick = lambda p, k: p.gather(-1, k.view(-1, *[1] * (p.ndim - 1)).expand(*p.shape[:-1], 1))[..., 0]  # noqa: E731
        return {
            "identity": pick(p_digit, digit).mean(1),
            "colour": pick(p_colour, colour).mean(1),
            "direction": pick(p_direction, direction),
            "consistency": (p_digit[:, 1:] * p_digit[:, :-1]).sqrt().sum(-1).mean(1).clamp(0, 1),
        }

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> dict[str, torch.Tensor]:
        check_clips(images, "the digits_video reward")
        props = self.properties(images.float() / 255.0, list(prompts))
        if self.combine == "mean":
            total = sum(props.values()) / len(props)
        else:
            total = props["identity"] * props["colour"] * props["direction"] * props["consistency"]
        return {self.name: total.cpu(), **{f"{self.name}_{k}": v.cpu() for k, v in props.items()}}
