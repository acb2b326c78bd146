"""The digits miniature's reward and gold metric.

``digits``: ``p_reward(digit | image) · p_reward(colour | image)`` from the shipped CNN reward
classifier, in [0, 1] (unit: probability). ``digits_gold``: 1 when the independently trained gold
judge's argmax digit and colour both match the prompt, else 0 — used for evaluation only.
``digits_gold2``: the same for a second judge that shares neither data nor architecture with the two
classifiers (``judge2``: trained on the digits in neither of their training splits, colour by a rule, digit
by an MLP on the 8×8 intensity); its hidden layer is the feature space of the distribution metrics.
``digits_real`` / ``digits_fidelity``: is the sample within reach of a real digit at all (no classifier), and the
gold judge's accuracy counting only such samples (``realness``); ``digits_compose_fidelity`` and ``digits_edit_fidelity``
do the same for the compose and editing worlds (``compose_judge``, ``edit``).

The package holds the digits world (``data``: palette, prompts, the sklearn digits), the classifiers
(``classifiers``) and their safetensors I/O (``io``); the generator family ``pipelines.digits`` builds on it.
"""

from __future__ import annotations

import torch

from rewards.base import Reward, register_reward
from rewards.digits.classifiers import DigitsClassifier
from rewards.digits.compose_judge import DigitsComposeExact, DigitsComposeFidelity, DigitsComposeGold, DigitsComposeReal
from rewards.digits.data import ASSET_DIR, parse_prompt
from rewards.digits.edit import DigitsEditFidelity, DigitsEditGold, DigitsEditReward, DigitsEditStrictPreservation
from rewards.digits.judge2 import DigitsGold2
from rewards.digits.realness import DigitsReal, realness_check
from rewards.digits.stroke import DigitsStroke
from rewards.digits.video import DigitsVideoReward  # noqa: F401  the video miniature's rewards register on import
from rewards.digits.video_judge import DigitsVideoFidelity, DigitsVideoGold  # noqa: F401
from rewards.digits.video_judge2 import DigitsVideoGold2  # noqa: F401

__all__ = [
    "DigitsComposeExact", "DigitsComposeFidelity", "DigitsComposeGold", "DigitsComposeReal", "DigitsEditFidelity", "DigitsEditGold",
    "DigitsEditStrictPreservation", "DigitsEditReward", "DigitsFidelity", "DigitsGold", "DigitsGold2", "DigitsReal", "DigitsReward",
    "DigitsStroke", "judge_correct",
]


def _targets(prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    parsed = [parse_prompt(p) for p in prompts]
    return torch.tensor([d for d, _ in parsed]), torch.tensor([c for _, c in parsed])


@torch.no_grad()
def judge_correct(judge: DigitsClassifier, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """``[B]`` bool: the classifier's argmax digit and colour both match each prompt."""
    digit, colour = _targets(prompts)
    d_logits, c_logits = judge(images.float() / 255.0)
    return (d_logits.argmax(-1) == digit) & (c_logits.argmax(-1) == colour)


@register_reward("digits")
class DigitsReward(Reward):
    """Probability of the prompt's digit × probability of its colour under the reward classifier.

    Args:
        path: folder of the reward classifier (default: the shipped ``assets/digits/reward_classifier``).
    """

    unit = "probability in [0, 1]"

    def __init__(self, path: str | None = None, device: str = "cpu"):
        self.device = device
        self.model = DigitsClassifier.from_pretrained(path or ASSET_DIR / "reward_classifier").to(device)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> dict[str, torch.Tensor]:
        if images.ndim != 4 or tuple(images.shape[1:]) != (3, 16, 16):
            raise ValueError(f"the digits reward reads images [B, 3, 16, 16] (the miniature's size), got {tuple(images.shape)}")
        digit, colour = _targets(prompts)
        d_logits, c_logits = self.model(images.to(self.device).float() / 255.0)
        p_digit = d_logits.softmax(-1).gather(1, digit.to(self.device)[:, None])[:, 0]
        p_colour = c_logits.softmax(-1).gather(1, colour.to(self.device)[:, None])[:, 0]
        return {self.name: (p_digit * p_colour).cpu()}


@register_reward("digits_gold")
class DigitsGold(Reward):
    """Gold accuracy: 1.0 when the independent gold judge reads the prompt's digit and colour, else 0.0."""

    unit = "accuracy in {0, 1}"

    def __init__(self, path: str | None = None, device: str = "cpu"):
        self.device = device
        self.model = DigitsClassifier.from_pretrained(path or ASSET_DIR / "gold_classifier").to(device)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> dict[str, torch.Tensor]:
        if images.ndim != 4 or tuple(images.shape[1:]) != (3, 16, 16):
            raise ValueError(f"the digits gold judge reads images [B, 3, 16, 16] (the miniature's size), got {tuple(images.shape)}")
        return {self.name: judge_correct(self.model, images.to(self.device), prompts).float().cpu()}


@register_reward("digits_fidelity")
class DigitsFidelity(DigitsGold):
    """Fidelity gold: 1.0 when the gold judge reads the prompt's digit and colour **and** the sample passes the
    realness check (:mod:`rewards.digits.realness`), else 0.0; evaluation only. Also outputs ``digits_real``.

    Args:
        path: folder of the gold judge (default: the shipped ``assets/digits/gold_classifier``).
    """

    def __init__(self, path: str | None = None, device: str = "cpu"):
        super().__init__(path, device)
        self.check = realness_check()

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> dict[str, torch.Tensor]:
        right = super().__call__(images, prompts)[self.name].bool()
        real = self.check.passes(images.cpu())
        return {self.name: (real & right).float(), "digits_real": real.float()}
