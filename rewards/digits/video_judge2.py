"""The digits-video second judge ``digits_video_gold2``: another digit reader, colour rule and motion estimator.

Beside the gold judge (``rewards.digits.video_judge``: nearest neighbours, mean-colour rule, centroid tracking) it
reads the same properties a third way, so a policy that games one reading shows up as a disagreement:

- **digit**: the digits miniature's second judge (:class:`~rewards.digits.judge2.Judge2`, an MLP on 8×8 intensity,
  trained on the 73 digits outside both image classifiers' splits) on a crop centred on each frame's centre of
  ink, taken through the 8 → 16 → 8 round trip its training digits went through;
- **colour**: the palette colour nearest (Euclidean) to the mean RGB of each frame's 12 brightest pixels, the
  clip's colour the most frequent;
- **direction**: phase correlation: the peak of the normalised cross-power spectrum of each pair of consecutive
  frames gives their integer shift; the summed shift must go the prompt's way by ≥ 3.5 px and at most half as
  far across;
- **consistency**: at least 6 of the 8 frame digits equal the clip's most frequent one.

``digits_video_gold2`` is 1.0 when all four hold (evaluation only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rewards.base import Reward, register_reward
from rewards.digits.judge2 import JUDGE2_DIR, PALETTE, Judge2
from rewards.digits.video_data import CANVAS, DIGIT_SIZE, FRAMES, check_clips, parse_prompts
from rewards.digits.video_judge import direction_right

BRIGHTEST = 12
MIN_TRAVEL = 3.5


def frame_colours(clips: torch.Tensor) -> torch.Tensor:
    """``[B]``: the most frequent per-frame palette colour nearest to the mean RGB of the frame's brightest pixels."""
    b = clips.shape[0]
    pixels = clips.flatten(3).transpose(2, 3)  # [B, F, HW, 3]
    top = pixels.amax(-1).topk(BRIGHTEST, dim=-1).indices
    mean = pixels.gather(2, top[..., None].expand(-1, -1, -1, 3)).mean(2)  # [B, F, 3]
    nearest = torch.cdist(mean.view(-1, 3), PALETTE.to(mean)).argmin(1).view(b, FRAMES)
    return nearest.mode(1).values


def phase_shifts(ink: torch.Tensor) -> torch.Tensor:
    """``[B, F − 1, 2]``: the integer ``(dy, dx)`` from each frame of ``ink [B, F, H, W]`` to the next, by phase correlation."""
    spectrum = torch.fft.fft2(ink.double())
    cross = spectrum[:, 1:] * spectrum[:, :-1].conj()
    response = torch.fft.ifft2(cross / cross.abs().clamp_min(1e-9)).real  # peak at the shift of frame f+1 against frame f
    peak = response.flatten(2).argmax(2)
    dy, dx = peak // CANVAS, peak % CANVAS
    wrap = lambda s: torch.where(s >= CANVAS // 2, s - CANVAS, s)  # noqa: E731
    return torch.stack([wrap(dy), wrap(dx)], -1).to(ink.dtype)


def centred_crops(ink: torch.Tensor) -> torch.Tensor:
    """``[B·F, 1, 8, 8]``: the 8×8 window of each frame of ``ink [B, F, H, W]`` whose centre is nearest its centre of ink."""
    frames = ink.flatten(0, 1)
    mass = frames.sum((1, 2)).clamp_min(1e-6)
    coords = torch.arange(CANVAS, dtype=ink.dtype)
    cy, cx = (frames.sum(2) * coords).sum(1) / mass, (frames.sum(1) * coords).sum(1) / mass
    top = (cy - (DIGIT_SIZE - 1) / 2).round().clamp(0, CANVAS - DIGIT_SIZE).long()
    left = (cx - (DIGIT_SIZE - 1) / 2).round().clamp(0, CANVAS - DIGIT_SIZE).long()
    rows = top[:, None] + torch.arange(DIGIT_SIZE)
    cols = left[:, None] + torch.arange(DIGIT_SIZE)
    n = frames.shape[0]
    return frames[torch.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]].unsqueeze(1)


@register_reward("digits_video_gold2")
class DigitsVideoGold2(Reward):
    """Second gold accuracy of clips: judge2's digit, the brightest-pixel colour, phase correlation (module docstring).

    Args:
        path: folder of judge2 (default: the shipped ``assets/digits/judge2``).
    """

    unit = "accuracy in {0, 1}"
    scale = (0.0, 1.0)
    video = True

    def __init__(self, path: str | None = None, device: str = "cpu"):
        self.device = device
        self.model = Judge2.from_pretrained(path or JUDGE2_DIR)

    @torch.no_grad()
    def readings(self, clips: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        """bool ``[B]`` per property of float clips ``[B, F, 3, 16, 16]``, and ``gold2``."""
        digit, colour, direction = parse_prompts(prompts)
        clips = clips.float().cpu()
        ink = clips.amax(2)
        crops = centred_crops(ink)
        round_trip = F.avg_pool2d(F.interpolate(crops, size=(2 * DIGIT_SIZE,) * 2, mode="bilinear", align_corners=False), 2)
        labels = self.model.digit_head(self.model.hidden_layer(round_trip.flatten(1) * 2.0 - 1.0)).argmax(1).view(-1, FRAMES)
        mode = labels.mode(1).values
        out = {
            "identity": mode == digit,
            "colour": frame_colours(clips) == colour,
            "direction": direction_right(phase_shifts(ink).sum(1).float(), direction, MIN_TRAVEL),
            "consistency": (labels == mode[:, None]).sum(1) >= 6,
        }
        out["gold2"] = out["identity"] & out["colour"] & out["direction"] & out["consistency"]
        return out

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> dict[str, torch.Tensor]:
        check_clips(images, "the digits_video_gold2 judge")
        return {self.name: self.readings(images.float() / 255.0, list(prompts))["gold2"].float()}
