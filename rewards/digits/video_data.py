"""The digits-video world: clips of one coloured digit moving in a named direction.

A clip is ``FRAMES`` = 8 frames of a 16×16 RGB canvas (black background) holding one of sklearn's digits at
its own 8×8 resolution (intensity ``/16``), coloured with the digits palette (``rewards.digits.data``), that
moves one pixel per frame ``left``, ``right``, ``up`` or ``down``: 7 px over the clip, from a start on the side it
leaves (so that it stays on the canvas) and a random offset across the motion (the generator's pretraining clips keep
to tracks near the middle, :func:`start_positions`). Clips are float
``[N, F, 3, 16, 16]`` in [0, 1] (generated ones arrive as uint8, the rollout's ``images``).

Prompts read ``"a <colour> <digit-word> moving <direction>"`` (``"a red seven moving left"``): 10 digits × 6
colours × 4 directions = 240 prompts.

Data: sklearn's 1797 digits are cut by a seeded permutation (:data:`SPLIT_SEED`, :func:`video_split`) into the
**reward** part (40 %: the training reward's frame classifier and motion net learn only from it), the **judge**
part (40 %: the gold judge's nearest-neighbour references; never seen by the reward nor the generator) and the
**free** part (20 %: the generator's pretraining together with the reward part, and the realness check's
calibration). ``VIDEO_ASSET_DIR`` is the shipped miniature's folder.
"""

from __future__ import annotations

import torch

from rewards.digits.data import ASSET_DIR, COLOUR_NAMES, COLOURS, DIGIT_WORDS

VIDEO_ASSET_DIR = ASSET_DIR.parent / "digits_video"
FRAMES = 8
CANVAS = 16
DIGIT_SIZE = 8
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (0, -1), "right": (0, 1), "up": (-1, 0), "down": (1, 0)}
"""direction → ``(dy, dx)``, pixels per frame (y grows downwards)."""
DIRECTION_NAMES: list[str] = list(DIRECTIONS)
STILL = len(DIRECTION_NAMES)
"""Class index of a digit that does not move (the motion net's fifth class)."""
WORDS = ["a", *COLOUR_NAMES, *DIGIT_WORDS, "moving", *DIRECTION_NAMES]
MAX_WORDS = 5
SPLIT_SEED = 55
PARTS = ("reward", "judge", "free")


def make_prompt(digit: int, colour: int, direction: int) -> str:
    """``make_prompt(7, 0, 0) == "a red seven moving left"``."""
    return f"a {COLOUR_NAMES[colour]} {DIGIT_WORDS[digit]} moving {DIRECTION_NAMES[direction]}"


def all_prompts() -> list[str]:
    """Every (digit, colour, direction) prompt, digit-major then colour: 240 prompts."""
    return [make_prompt(d, c, m) for d in range(10) for c in range(len(COLOUR_NAMES)) for m in range(len(DIRECTION_NAMES))]


def parse_prompt(prompt: str) -> tuple[int, int, int]:
    """Inverse of :func:`make_prompt`: ``"a red seven moving left" -> (7, 0, 0)``; a one-line ``ValueError`` otherwise."""
    words = str(prompt).strip().lower().split()
    if (len(words) != 5 or words[0] != "a" or words[1] not in COLOURS or words[2] not in DIGIT_WORDS or words[3] != "moving"
            or words[4] not in DIRECTIONS):
        raise ValueError(f"digits-video prompt {prompt!r} is not of the form 'a <colour> <digit> moving <direction>' with colour in "
                         f"{COLOUR_NAMES}, digit in {DIGIT_WORDS} and direction in {DIRECTION_NAMES}")
    return DIGIT_WORDS.index(words[2]), COLOUR_NAMES.index(words[1]), DIRECTION_NAMES.index(words[4])


def parse_prompts(prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(digit [B], colour [B], direction [B])`` of ``prompts``."""
    parsed = torch.tensor([parse_prompt(p) for p in prompts], dtype=torch.long).view(-1, 3)
    return parsed[:, 0], parsed[:, 1], parsed[:, 2]


def load_digits_8() -> tuple[torch.Tensor, torch.Tensor]:
    """sklearn's digits at their own resolution: intensities ``[N, 1, 8, 8]`` in [0, 1] and labels ``[N]`` (N = 1797)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0, torch.tensor(bunch.target, dtype=torch.long)


def video_split(n: int = 1797, seed: int = SPLIT_SEED) -> dict[str, torch.Tensor]:
    """``{"reward", "judge", "free"}`` → disjoint index sets of sklearn's ``n`` digits (40 / 40 / 20 % of a seeded
    permutation; see the module docstring)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    a, b = int(round(0.4 * n)), int(round(0.8 * n))
    return {"reward": perm[:a], "judge": perm[a:b], "free": perm[b:]}


def check_clips(clips: torch.Tensor, what: str) -> None:
    """One-line ``ValueError`` unless ``clips`` are ``[B, 8, 3, 16, 16]``."""
    if clips.ndim != 5 or tuple(clips.shape[1:]) != (FRAMES, 3, CANVAS, CANVAS):
        raise ValueError(f"{what} reads clips [B, {FRAMES}, 3, {CANVAS}, {CANVAS}] (the digits-video miniature's size), got {tuple(clips.shape)}")


def start_positions(direction: torch.Tensor, g: torch.Generator, jitter: int | None = None) -> torch.Tensor:
    """``[N, 2]`` top-left ``(y, x)`` of frame 0 for clips moving in ``direction [N]`` (index; :data:`STILL` allowed).

    ``jitter=None``: along the motion, 0 or 1 px from the side it leaves; across it (and for still digits), anywhere on
    the canvas. ``jitter=j``: on a track near the middle: along the motion, at the side it leaves (``+1`` px at random
    when ``j ≥ 1``), across it at the centre ``± j`` px (still digits: the centre ``± j`` both ways).
    """
    n, room = len(direction), CANVAS - DIGIT_SIZE
    if jitter is None:
        pos = torch.randint(0, room + 1, (n, 2), generator=g)
        near = torch.randint(0, 2, (n,), generator=g)
    else:
        pos = room // 2 + torch.randint(-jitter, jitter + 1, (n, 2), generator=g)
        near = torch.randint(0, min(jitter, 1) + 1, (n,), generator=g)
    travel = (FRAMES - 1)
    for i, d in enumerate(direction.tolist()):
        if d == STILL:
            continue
        dy, dx = DIRECTIONS[DIRECTION_NAMES[d]]
        axis, step = (0, dy) if dy else (1, dx)
        pos[i, axis] = near[i] if step > 0 else room - near[i]
        assert 0 <= pos[i, axis] + step * travel <= room
    return pos


def velocities(direction: torch.Tensor) -> torch.Tensor:
    """``[N, 2]`` ``(dy, dx)`` per frame of ``direction [N]`` (:data:`STILL`: zero)."""
    table = torch.tensor([*DIRECTIONS.values(), (0, 0)], dtype=torch.long)
    return table[direction]


def render_clips(intensity: torch.Tensor, colour: torch.Tensor, start: torch.Tensor, velocity: torch.Tensor) -> torch.Tensor:
    """Clips ``[N, F, 3, 16, 16]`` in [0, 1]: digit ``intensity [N, 1, 8, 8]`` in palette colour ``colour [N]`` with its
    top-left corner at ``start + f·velocity`` (``[N, 2]`` each, integer pixels) in frame ``f``."""
    n = intensity.shape[0]
    pos = start[:, None, :] + torch.arange(FRAMES)[None, :, None] * velocity[:, None, :]  # [N, F, 2]
    if pos.min() < 0 or pos.max() > CANVAS - DIGIT_SIZE:
        raise ValueError(f"a digit leaves the {CANVAS}×{CANVAS} canvas: positions span {int(pos.min())}..{int(pos.max())}")
    # one gather: canvas pixel (y, x) of frame f reads the digit at (y − pos_y, x − pos_x) when that lies inside it
    ys = torch.arange(CANVAS)[None, None, :, None] - pos[..., 0, None, None]  # [N, F, 16, 1]
    xs = torch.arange(CANVAS)[None, None, None, :] - pos[..., 1, None, None]  # [N, F, 1, 16]
    inside = (ys >= 0) & (ys < DIGIT_SIZE) & (xs >= 0) & (xs < DIGIT_SIZE)
    flat = (ys.clamp(0, DIGIT_SIZE - 1) * DIGIT_SIZE + xs.clamp(0, DIGIT_SIZE - 1)).reshape(n, -1)
    ink = intensity.reshape(n, -1).gather(1, flat).view(n, FRAMES, CANVAS, CANVAS) * inside
    palette = torch.tensor([COLOURS[c] for c in COLOUR_NAMES], dtype=intensity.dtype)
    return ink[:, :, None] * palette[colour].view(n, 1, 3, 1, 1)


def random_clips(intensity: torch.Tensor, labels: torch.Tensor, n: int, g: torch.Generator, *, still_fraction: float = 0.0,
                 jitter: int | None = None):
    """``n`` clips of random digits of ``(intensity, labels)``, colours and directions (a share ``still_fraction`` still),
    placed by :func:`start_positions` with ``jitter``.

    Returns:
        ``(clips [n, F, 3, 16, 16] in [0, 1], digit [n], colour [n], direction [n])`` (direction :data:`STILL` for still ones).
    """
    idx = torch.randint(0, len(labels), (n,), generator=g)
    colour = torch.randint(0, len(COLOUR_NAMES), (n,), generator=g)
    direction = torch.randint(0, len(DIRECTION_NAMES), (n,), generator=g)
    if still_fraction > 0:
        direction[torch.rand(n, generator=g) < still_fraction] = STILL
    clips = render_clips(intensity[idx], colour, start_positions(direction, g, jitter), velocities(direction))
    return clips, labels[idx], colour, direction


def to_uint8(clips: torch.Tensor) -> torch.Tensor:
    """Float clips in [0, 1] → uint8, rounded (as rollouts store them)."""
    return (clips.clamp(0, 1) * 255.0).round().to(torch.uint8)
