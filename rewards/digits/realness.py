"""Is it a digit at all? The realness check ``digits_real`` and the fidelity gold ``digits_fidelity``.

The gold judges are classifiers: they answer "which digit, which colour" for any input, a filled shape
included, so a policy that draws saturated blobs the reward classifier likes can score on them too (issue 39).
This check is no classifier and has no learned features. It asks how far a sample is from the nearest real
digit:

- **feature**: the image projected on the palette colour it reads and average-pooled 16 → 8
  (:func:`rewards.digits.judge2.intensity_8x8`: sklearn's own 8×8 resolution, ink intensity in [0, 1]);
- **distance**: the RMS difference ``‖a − r‖₂ / 8`` to the nearest digit ``r`` of a reference set of real
  digits, whatever its class (the class is the gold judge's business);
- **threshold** ``τ``: the 95th percentile of the same distance for real digits outside the reference set
  (the calibration split), rendered as generated samples arrive (coloured, uint8). A sample passes when its
  distance is ≤ τ.

sklearn's 1797 digits are split by a seeded permutation (:data:`SPLIT_SEED`): 70 % reference, 15 %
calibration, 15 % test; :attr:`RealnessCheck.test_pass` is the pass rate of the test digits, which
neither set τ nor serve as neighbours (≈ 0.95 when the calibration generalises).

``digits_real`` scores 1.0 for a sample that passes (``digits_real_distance``: its distance);
``digits_fidelity`` (``rewards.digits``, beside the gold judge it extends) scores 1.0 when the gold judge reads the
prompt's digit and colour **and** the sample passes: the headline that counts only what a person would count
(``reward.fidelity``).
"""

from __future__ import annotations

from functools import lru_cache

import torch

from rewards.base import Reward, register_reward
from rewards.digits.data import COLOUR_NAMES, load_digit_intensities
from rewards.digits.judge2 import intensity_8x8, read_colour, render

SPLIT_SEED = 33
"""Seed of the reference / calibration / test split of sklearn's digits."""
PASS_QUANTILE = 0.95
"""Share of the calibration digits that pass: τ is their distances' quantile at this level."""


def _as_unit(images: torch.Tensor) -> torch.Tensor:
    if images.ndim != 4 or tuple(images.shape[1:]) != (3, 16, 16):
        raise ValueError(f"the digits realness check reads images [B, 3, 16, 16] (the miniature's size), got {tuple(images.shape)}")
    return images.float() / 255.0 if images.dtype == torch.uint8 else images.float()


def realness_features(images: torch.Tensor) -> torch.Tensor:
    """uint8 (or float in [0, 1]) ``[B, 3, 16, 16]`` → ``[B, 64]``: the 8×8 ink intensity on the colour each image reads."""
    x = _as_unit(images)
    return intensity_8x8(x, read_colour(x))


def nearest_distance(features: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``[B]``: the RMS distance ``‖a − r‖₂ / √D`` from each row of ``features [B, D]`` to its nearest row of ``reference [R, D]``."""
    return torch.cdist(features.double(), reference.double()).min(1).values.float() / features.shape[1] ** 0.5


def realness_split(n: int = 1797, seed: int = SPLIT_SEED) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(reference, calibration, test)`` indices of sklearn's ``n`` digits: a seeded permutation cut 70 / 15 / 15 %."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_ref, n_cal = int(round(0.70 * n)), int(round(0.15 * n))
    return perm[:n_ref], perm[n_ref:n_ref + n_cal], perm[n_ref + n_cal:]


def rendered_real(indices: torch.Tensor, seed: int = SPLIT_SEED) -> torch.Tensor:
    """Real digits ``indices`` as generated samples arrive: each coloured with a seeded palette colour, uint8 ``[N, 3, 16, 16]``."""
    intensity, _ = load_digit_intensities()
    colour = torch.randint(len(COLOUR_NAMES), (len(indices),), generator=torch.Generator().manual_seed(seed + 1))
    return render(intensity[indices], colour)


class RealnessCheck:
    """The nearest-real-digit check, built from sklearn's digits (deterministic; about 0.1 s).

    Attributes:
        reference: ``[R, 64]`` features of the reference digits.
        threshold: τ, the pass distance (RMS ink intensity, in [0, 1]).
        calibration_pass: share of the calibration digits that pass (≥ :data:`PASS_QUANTILE` by construction).
        test_pass: share of the test digits that pass (digits used for neither the reference nor τ).
    """

    def __init__(self, seed: int = SPLIT_SEED, quantile: float = PASS_QUANTILE):
        ref, cal, test = realness_split(seed=seed)
        self.reference = realness_features(rendered_real(ref, seed))
        cal_d = nearest_distance(realness_features(rendered_real(cal, seed + 10)), self.reference)
        self.threshold = float(torch.quantile(cal_d.double(), quantile, interpolation="higher"))
        self.calibration_pass = float((cal_d <= self.threshold).float().mean())
        self.test_pass = float(self.passes(rendered_real(test, seed + 20)).float().mean())

    def distance(self, images: torch.Tensor) -> torch.Tensor:
        """``[B]`` distance of each image (uint8 or float in [0, 1], ``[B, 3, 16, 16]``) to the nearest reference digit."""
        return nearest_distance(realness_features(images), self.reference)

    def passes(self, images: torch.Tensor) -> torch.Tensor:
        """``[B]`` bool: the image is within τ of a real digit."""
        return self.distance(images) <= self.threshold


@lru_cache(maxsize=4)
def realness_check(seed: int = SPLIT_SEED, quantile: float = PASS_QUANTILE) -> RealnessCheck:
    """The shared :class:`RealnessCheck` of these settings (built once per process)."""
    return RealnessCheck(seed, quantile)


@register_reward("digits_real")
class DigitsReal(Reward):
    """1.0 when the sample lies within τ of a real digit (:class:`RealnessCheck`), else 0.0; evaluation only.

    Outputs ``digits_real`` and ``digits_real_distance`` (the RMS distance to the nearest real digit).
    """

    unit = "share in {0, 1}"

    def __init__(self, device: str = "cpu"):
        self.check = realness_check()

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> dict[str, torch.Tensor]:
        d = self.check.distance(images.cpu())
        return {self.name: (d <= self.check.threshold).float(), f"{self.name}_distance": d}
