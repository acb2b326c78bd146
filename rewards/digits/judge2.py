"""The second gold judge ``digits_gold2``: other data, other architecture, other input than the first two.

The reward classifier and the gold judge (``rewards.digits.classifiers``) are both CNNs on the 16×16 colour
image, trained on 80 % splits of sklearn's 1797 digits that share about 64 % of the digits. This judge
shares neither their data nor their form:

- **data**: it trains only on the digits in *neither* of their training splits (the intersection of their
  held-out sets, split seeds read from ``assets/digits/metadata.json``: 73 digits, :func:`judge2_split`);
  every other digit is its held-out set;
- **colour**: a rule, not a learned head: the palette colour with the largest cosine similarity to the
  brightness-weighted mean RGB of the image (:func:`read_colour`);
- **digit**: an MLP (64 → ``hidden`` ReLU → 10) on the 8×8 intensity, sklearn's own resolution: the image
  projected on the colour it read and average-pooled 16×16 → 8×8 (:func:`intensity_8x8`), so that the real
  digits it learns from went through the same 8 → 16 → 8 round trip as what it reads.

``digits_gold2`` scores 1.0 when the judge reads the prompt's digit and colour, else 0.0 (evaluation only,
like ``digits_gold``). Its hidden layer is also the miniature's feature space for the distribution metrics
(``diffrl.sampling.distribution.FeatureSpace``): :meth:`DigitsGold2.features` and
:meth:`DigitsGold2.reference_features` (the judge's held-out real digits of the prompt's class, rendered
in the prompt's colour as uint8 16×16 images, the way generated ones arrive). ``scripts/train_judge2.py``
makes the shipped weights (``assets/digits/judge2/``) and records their held-out accuracy.
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from torch import nn

from rewards.base import Reward, register_reward
from rewards.digits.data import (
    ASSET_DIR,
    COLOUR_NAMES,
    COLOURS,
    colourise,
    load_digit_intensities,
    parse_prompt,
    split_indices,
)
from rewards.digits.io import JsonSafetensorsMixin

JUDGE2_DIR = ASSET_DIR / "judge2"
PALETTE = torch.tensor([COLOURS[c] for c in COLOUR_NAMES])


def shipped_split_seeds() -> dict[str, int]:
    """``{"reward_classifier": seed, "gold_classifier": seed}``: the split seeds the shipped classifiers were
    trained with (``assets/digits/metadata.json``, written by ``scripts/pretrain_digits.py``)."""
    meta = json.loads((ASSET_DIR / "metadata.json").read_text())
    return {name: int(meta[name]["split_seed"]) for name in ("reward_classifier", "gold_classifier")}


def judge2_split(n: int = 1797) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, held_out)`` indices of sklearn's ``n`` digits for the second judge, ascending.

    ``train``: the digits in neither the reward classifier's nor the gold judge's training split (each
    classifier trained on ``split_indices(n, seed)[0]``); ``held_out``: all the others.
    """
    free = torch.ones(n, dtype=torch.bool)
    for seed in shipped_split_seeds().values():
        free[split_indices(n, seed)[0]] = False
    return free.nonzero()[:, 0], (~free).nonzero()[:, 0]


def render(intensity: torch.Tensor, colour: torch.Tensor) -> torch.Tensor:
    """Real digits as generated ones arrive: ``intensity [N, 1, 16, 16]`` in [0, 1] coloured with palette
    colour ``colour [N]`` → uint8 ``[N, 3, 16, 16]`` (rounded, as ``diffrl.sampling.rollout.uint8_images``)."""
    return (colourise(intensity, colour).clamp(0, 1) * 255.0).round().to(torch.uint8)


def read_colour(images: torch.Tensor) -> torch.Tensor:
    """``images [B, 3, H, W]`` float in [0, 1] → palette index ``[B]``: the palette colour with the largest
    cosine similarity to the image's mean RGB, each pixel weighted by its brightest channel."""
    weight = images.amax(1, keepdim=True)
    mean_rgb = (images * weight).sum((2, 3)) / weight.sum((2, 3)).clamp_min(1e-8)
    palette = F.normalize(PALETTE.to(images), dim=1)
    return (F.normalize(mean_rgb, dim=1) @ palette.T).argmax(1)


def ink_intensity(images: torch.Tensor, colour: torch.Tensor) -> torch.Tensor:
    """``images [B, 3, H, W]`` in [0, 1] projected on palette colour ``colour [B]`` (least squares, ``<x, c> / <c, c>``
    per pixel) and clipped to [0, 1] → ``[B, 1, H, W]``."""
    c = PALETTE.to(images)[colour]
    return ((images * c[:, :, None, None]).sum(1, keepdim=True) / (c * c).sum(1).view(-1, 1, 1, 1)).clamp(0, 1)


def intensity_8x8(images: torch.Tensor, colour: torch.Tensor) -> torch.Tensor:
    """:func:`ink_intensity` of ``images [B, 3, 16, 16]`` average-pooled to 8×8 → ``[B, 64]``."""
    return F.avg_pool2d(ink_intensity(images, colour), 2).flatten(1)


class Judge2(JsonSafetensorsMixin, nn.Module):
    """Colour by :func:`read_colour`; digit by an MLP on :func:`intensity_8x8`.

    Args:
        hidden: width of the hidden layer (the feature space of the distribution metrics).
    """

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.hidden = hidden
        self.hidden_layer = nn.Sequential(nn.Linear(64, hidden), nn.ReLU())
        self.digit_head = nn.Linear(hidden, 10)

    @property
    def config(self) -> dict:
        return {"hidden": self.hidden}

    def features(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``images [B, 3, 16, 16]`` float in [0, 1] → (hidden activations ``[B, hidden]``, colour read ``[B]``)."""
        colour = read_colour(images)
        return self.hidden_layer(intensity_8x8(images, colour) * 2.0 - 1.0), colour

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``images [B, 3, 16, 16]`` float in [0, 1] → (digit logits ``[B, 10]``, colour read ``[B]``)."""
        h, colour = self.features(images)
        return self.digit_head(h), colour


@register_reward("digits_gold2")
class DigitsGold2(Reward):
    """Second gold accuracy: 1.0 when :class:`Judge2` reads the prompt's digit and colour, else 0.0.

    Also the miniature's feature space (``diffrl.sampling.distribution.FeatureSpace``).

    Args:
        path: folder of the judge (default: the shipped ``assets/digits/judge2``).
    """

    unit = "accuracy in {0, 1}"
    scale = (0.0, 1.0)

    def __init__(self, path: str | None = None, device: str = "cpu"):
        self.device = device
        self.model = Judge2.from_pretrained(path or JUDGE2_DIR).to(device)
        self._reference: dict[tuple[int, int], torch.Tensor] = {}
        self._real: tuple[torch.Tensor, torch.Tensor] | None = None

    def _float(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1:] != (3, 16, 16):
            raise ValueError(f"digits_gold2 reads uint8 images [B, 3, 16, 16], got {images.dtype} {tuple(images.shape)}")
        return images.to(self.device).float() / 255.0

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> dict[str, torch.Tensor]:
        parsed = [parse_prompt(p) for p in prompts]
        digit, colour = self.model(self._float(images))
        correct = (digit.argmax(-1).cpu() == torch.tensor([d for d, _ in parsed])) & (colour.cpu() == torch.tensor([c for _, c in parsed]))
        return {self.name: correct.float()}

    @torch.no_grad()
    def features(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 ``[N, 3, 16, 16]`` → the judge's hidden activations, float ``[N, hidden]`` (CPU)."""
        return self.model.features(self._float(images))[0].cpu()

    @torch.no_grad()
    def reference_features(self, prompt: str) -> torch.Tensor:
        """Features of the judge's held-out real digits of the prompt's class in the prompt's colour
        (uint8 16×16, :func:`render`): ``[M, hidden]``, M ≈ 172 per class."""
        key = parse_prompt(prompt)
        if key not in self._reference:
            if self._real is None:
                intensity, labels = load_digit_intensities()
                held = judge2_split(len(labels))[1]
                self._real = intensity[held], labels[held]
            intensity, labels = self._real
            digits = intensity[labels == key[0]]
            self._reference[key] = self.features(render(digits, torch.full((len(digits),), key[1])))
        return self._reference[key]
