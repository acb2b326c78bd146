"""The digits world: sklearn's 8×8 digits, upsampled to 16×16 and coloured with a named palette.

Images live in pixel space: ``[3, 16, 16]`` float in ``[0, 1]`` (black background, the digit's
strokes in one named colour). Prompts read ``"a <colour> <digit-word>"``, e.g. ``"a red seven"``.
The reward and gold judge parse prompts with it; the digits generator family (``pipelines.digits``)
takes its prompts and pretraining data from it. ``ASSET_DIR`` is the shipped miniature's folder
(generator, reward classifier and gold judge).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

ASSET_DIR = Path(__file__).resolve().parents[2] / "assets" / "digits"

COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.15, 0.1),
    "green": (0.1, 0.9, 0.2),
    "blue": (0.15, 0.3, 1.0),
    "yellow": (1.0, 0.9, 0.1),
    "magenta": (0.95, 0.1, 0.9),
    "cyan": (0.1, 0.9, 0.95),
}
COLOUR_NAMES: list[str] = list(COLOURS)
DIGIT_WORDS: list[str] = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
IMAGE_SIZE = 16


def make_prompt(digit: int, colour: int) -> str:
    """``make_prompt(7, 0) == "a red seven"``."""
    return f"a {COLOUR_NAMES[colour]} {DIGIT_WORDS[digit]}"


def all_prompts() -> list[str]:
    """Every (digit, colour) prompt, digit-major: 10 × 6 = 60 prompts."""
    return [make_prompt(d, c) for d in range(10) for c in range(len(COLOUR_NAMES))]


def parse_prompt(prompt: str) -> tuple[int, int]:
    """Inverse of :func:`make_prompt`: ``"a red seven" -> (7, 0)``.

    Raises:
        ValueError: naming the prompt when it is not of the form ``"a <colour> <digit-word>"``.
    """
    words = prompt.strip().lower().split()
    if len(words) != 3 or words[0] != "a" or words[1] not in COLOURS or words[2] not in DIGIT_WORDS:
        raise ValueError(
            f"digits prompt {prompt!r} is not of the form 'a <colour> <digit>' with colour in "
            f"{COLOUR_NAMES} and digit in {DIGIT_WORDS}"
        )
    return DIGIT_WORDS.index(words[2]), COLOUR_NAMES.index(words[1])


def load_digit_intensities() -> tuple[torch.Tensor, torch.Tensor]:
    """sklearn's digits as ``[N, 1, 16, 16]`` intensities in [0, 1] and labels ``[N]`` (N = 1797)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False)
    return x.clamp(0, 1), torch.tensor(bunch.target, dtype=torch.long)


def colourise(intensity: torch.Tensor, colour: torch.Tensor) -> torch.Tensor:
    """``intensity [N, 1, H, W]`` × palette colour ``colour [N]`` → images ``[N, 3, H, W]`` in [0, 1]."""
    palette = torch.tensor([COLOURS[c] for c in COLOUR_NAMES], dtype=intensity.dtype)
    return intensity * palette[colour].view(-1, 3, 1, 1)


def split_indices(n: int, seed: int, held_out_fraction: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded permutation split into (train, held-out) indices."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_held = int(round(n * held_out_fraction))
    return perm[n_held:], perm[:n_held]
