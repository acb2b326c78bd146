"""The digits-video gold judge ``digits_video_gold``: nearest real digits, a colour rule and centroid tracking.

It shares no weights and no data with the training reward (``rewards.digits.video``) and has no trained part:

- **locate**: in each frame (its ink: the frame projected on the clip's colour, :func:`rewards.digits.judge2.ink_intensity`),
  of the 9 8×8 windows holding the most ink, the one nearest to a real digit of the judge part is the digit's crop;
- **identity**: each crop's label is the vote of its 3 nearest real digits of the *judge part* of sklearn's digits
  (``video_split()["judge"]``, which neither the reward nets nor the generator saw); the clip's digit is the most
  frequent frame label;
- **colour**: the palette colour of the whole clip by the rule of :func:`rewards.digits.judge2.read_colour`;
- **direction**: centroid tracking: the ink-weighted centroid of each frame, its least-squares velocity ``v``
  (px/frame); right when the prompt's direction ``u`` has ``v·u ≥ 0.5`` and the velocity across it
  ``|v×u| ≤ (v·u)/2``;
- **consistency**: one digit, drawn steadily, moving smoothly: at least 6 of the 8 frame labels equal the clip's
  label, every frame's ink mass lies within [0.5, 2] × the median (no vanishing or flicker) and no centroid is
  farther than 1 px from the fitted straight track.

``digits_video_gold`` is 1.0 when all four hold (evaluation only); ``digits_video_gold_<property>`` report each.
``digits_video_real`` (the fidelity guard, no classifier): a clip is real when at least 6 of its 8 crops lie within
``τ`` (RMS ink) of a real digit of the judge part, ``τ`` the 95th percentile of the same distance for the free
part's real digits; ``digits_video_fidelity`` is gold **and** real (``reward.fidelity``).
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

from rewards.base import Reward, register_reward
from rewards.digits.judge2 import ink_intensity, read_colour
from rewards.digits.realness import nearest_distance
from rewards.digits.video_data import CANVAS, DIGIT_SIZE, DIRECTIONS, FRAMES, check_clips, load_digits_8, parse_prompts, video_split

NEIGHBOURS = 3
CANDIDATES = 9
MIN_SPEED = 0.5
MAX_TRACK_RESIDUAL = 1.0
MIN_AGREEING_FRAMES = 6
PASS_QUANTILE = 0.95


def clip_colour(clips: torch.Tensor) -> torch.Tensor:
    """``[B]`` palette index of float clips ``[B, F, 3, H, W]``: :func:`read_colour` over all frames at once."""
    return read_colour(clips.permute(0, 2, 1, 3, 4).flatten(2, 3))


def clip_ink(clips: torch.Tensor, colour: torch.Tensor) -> torch.Tensor:
    """``[B, F, H, W]``: each frame projected on palette colour ``colour [B]`` (:func:`ink_intensity`)."""
    b = clips.shape[0]
    return ink_intensity(clips.flatten(0, 1), colour.repeat_interleave(FRAMES)).view(b, FRAMES, CANVAS, CANVAS)


def candidate_windows(ink: torch.Tensor) -> torch.Tensor:
    """``[B·F, CANDIDATES, 64]``: per frame of ``ink [B, F, 16, 16]``, the :data:`CANDIDATES` 8×8 windows holding the
    most ink (a digit's blank border rows and columns leave several windows with nearly the same ink)."""
    frames = ink.reshape(-1, 1, CANVAS, CANVAS)
    windows = F.unfold(frames, DIGIT_SIZE)  # [BF, 64, 81]
    best = windows.sum(1).topk(CANDIDATES, dim=1).indices
    return windows.gather(2, best[:, None, :].expand(-1, DIGIT_SIZE * DIGIT_SIZE, -1)).transpose(1, 2)


def centroid_track(ink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Centroid tracking of ``ink [B, F, H, W]``: ``(velocity [B, 2] as (dy, dx) px/frame, max residual [B] px, mass [B, F])``."""
    mass = ink.sum((2, 3))
    coords = torch.arange(CANVAS, dtype=ink.dtype)
    cy = (ink.sum(3) * coords).sum(2) / mass.clamp_min(1e-6)
    cx = (ink.sum(2) * coords).sum(2) / mass.clamp_min(1e-6)
    c = torch.stack([cy, cx], -1)  # [B, F, 2]
    t = torch.arange(FRAMES, dtype=ink.dtype) - (FRAMES - 1) / 2
    velocity = (c * t[None, :, None]).sum(1) / (t * t).sum()
    fit = c.mean(1, keepdim=True) + t[None, :, None] * velocity[:, None, :]
    return velocity, (c - fit).abs().amax((1, 2)), mass


def direction_right(displacement: torch.Tensor, direction: torch.Tensor, min_along: float) -> torch.Tensor:
    """``[B]`` bool: ``displacement [B, 2]`` (dy, dx) goes the prompt's way ``direction [B]`` by at least ``min_along``
    and at most half as much across it."""
    unit = torch.tensor(list(DIRECTIONS.values()), dtype=displacement.dtype)[direction]
    along = (displacement * unit).sum(1)
    across = (displacement * unit.flip(1)).sum(1).abs()
    return (along >= min_along) & (across <= along / 2)


class NearestDigits:
    """Real 8×8 digits of one part of sklearn's digits; labels and distances of crops by their nearest neighbours."""

    def __init__(self, part: str = "judge"):
        intensity, labels = load_digits_8()
        idx = video_split(len(labels))[part]
        self.reference, self.labels = intensity[idx].flatten(1), labels[idx]

    def label(self, crops: torch.Tensor) -> torch.Tensor:
        """``[N]`` vote of the :data:`NEIGHBOURS` nearest reference digits of ``crops [N, 64]`` (ties: the nearest's)."""
        nearest = torch.cdist(crops.double(), self.reference.double()).topk(NEIGHBOURS, largest=False).indices
        votes = F.one_hot(self.labels[nearest], 10).sum(1).double()
        votes[torch.arange(len(crops)), self.labels[nearest[:, 0]]] += 0.5
        return votes.argmax(1)

    def distance(self, crops: torch.Tensor) -> torch.Tensor:
        """``[N]`` RMS distance of ``crops [N, 64]`` to the nearest reference digit."""
        return nearest_distance(crops, self.reference)

    def crops(self, ink: torch.Tensor) -> torch.Tensor:
        """``[B, F, 64]``: the digit's crop in each frame of ``ink [B, F, 16, 16]``: of the :func:`candidate_windows`,
        the one nearest to a reference digit."""
        b = ink.shape[0]
        windows = candidate_windows(ink)
        dist = self.distance(windows.flatten(0, 1)).view(windows.shape[:2])
        return windows[torch.arange(windows.shape[0]), dist.argmin(1)].view(b, FRAMES, -1)


@lru_cache(maxsize=1)
def judge_references() -> tuple[NearestDigits, float]:
    """The judge part's :class:`NearestDigits` and the realness threshold ``τ`` (95th percentile of the free part's distances)."""
    nearest = NearestDigits("judge")
    intensity, _ = load_digits_8()
    free = intensity[video_split(len(intensity))["free"]].flatten(1)
    tau = float(torch.quantile(nearest.distance(free).double(), PASS_QUANTILE, interpolation="higher"))
    return nearest, tau


@torch.no_grad()
def judge_clips(clips: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
    """Every reading of the gold judge on float clips ``[B, F, 3, 16, 16]``: bool ``[B]`` per property, ``gold``,
    ``real`` and the raw ``velocity [B, 2]``, ``labels [B, F]``."""
    digit, colour, direction = parse_prompts(prompts)
    nearest, tau = judge_references()
    clips = clips.float().cpu()
    read = clip_colour(clips)
    ink = clip_ink(clips, read)
    crop = nearest.crops(ink)
    labels = nearest.label(crop.flatten(0, 1)).view(-1, FRAMES)
    mode = labels.mode(1).values
    velocity, residual, mass = centroid_track(ink)
    median = mass.median(1).values[:, None]
    steady = ((mass >= 0.5 * median) & (mass <= 2.0 * median)).all(1) & (median[:, 0] > 1.0)
    out = {
        "identity": mode == digit,
        "colour": read == colour,
        "direction": direction_right(velocity, direction, MIN_SPEED),
        "consistency": ((labels == mode[:, None]).sum(1) >= MIN_AGREEING_FRAMES) & steady & (residual <= MAX_TRACK_RESIDUAL),
        "real": (nearest.distance(crop.flatten(0, 1)).view(-1, FRAMES) <= tau).sum(1) >= MIN_AGREEING_FRAMES,
    }
    out["gold"] = out["identity"] & out["colour"] & out["direction"] & out["consistency"]
    return {**out, "velocity": velocity, "labels": labels}


class _GoldReading(Reward):
    """A reading of :func:`judge_clips` as a 0/1 metric (subclasses name which one); evaluation only."""

    unit = "accuracy in {0, 1}"
    scale = (0.0, 1.0)
    video = True
    reading = "gold"

    def __init__(self, device: str = "cpu"):
        self.device = device

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> dict[str, torch.Tensor]:
        check_clips(images, f"the {self.name} judge")
        return {self.name: judge_clips(images.float() / 255.0, list(prompts))[self.reading].float()}


@register_reward("digits_video_gold")
class DigitsVideoGold(_GoldReading):
    """1.0 when the clip shows the prompt's digit in its colour, moving its way, consistently (module docstring)."""


@register_reward("digits_video_gold_identity")
class DigitsVideoGoldIdentity(_GoldReading):
    """1.0 when the most frequent nearest-neighbour frame label is the prompt's digit."""

    reading = "identity"


@register_reward("digits_video_gold_colour")
class DigitsVideoGoldColour(_GoldReading):
    """1.0 when the clip's colour read by rule is the prompt's."""

    reading = "colour"


@register_reward("digits_video_gold_direction")
class DigitsVideoGoldDirection(_GoldReading):
    """1.0 when the tracked centroid moves the prompt's way (≥ 0.5 px/frame, at most half as fast across)."""

    reading = "direction"


@register_reward("digits_video_gold_consistency")
class DigitsVideoGoldConsistency(_GoldReading):
    """1.0 when ≥ 6 frames agree on the digit, the ink mass is steady and the track is straight within 1 px."""

    reading = "consistency"


@register_reward("digits_video_real")
class DigitsVideoReal(_GoldReading):
    """1.0 when at least 6 of the clip's 8 crops lie within ``τ`` of a real digit (no classifier; the fidelity guard)."""

    unit = "share in {0, 1}"
    reading = "real"


@register_reward("digits_video_fidelity")
class DigitsVideoFidelity(_GoldReading):
    """Fidelity gold: 1.0 when the clip is gold **and** real (``reward.fidelity``)."""

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> dict[str, torch.Tensor]:
        check_clips(images, f"the {self.name} judge")
        read = judge_clips(images.float() / 255.0, list(prompts))
        return {self.name: (read["gold"] & read["real"]).float(), "digits_video_real": read["real"].float()}
