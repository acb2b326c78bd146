"""The digits editing world: instructions, source digits, the training reward and the gold edit judge.

An edit takes a source digit (a real sklearn digit, 16×16, one palette colour) and an instruction of one
of two kinds:

- **recolour** ``"make it blue"``: the target is the colour; what must be preserved is the digit;
- **redraw** ``"turn the three into an eight"``: the target is the digit (the source's digit is named);
  what must be preserved is the colour.

``digits_edit`` (training reward, ``needs_source``): from the digits reward classifier (the CNN of
``assets/digits/reward_classifier``), ``success = p(target | edit)`` and ``preservation = p(kept | edit)``
where *kept* is the attribute the classifier reads on the source (its digit for a recolour, its colour for a
redraw); the reward is ``success · preservation`` in [0, 1] (both parts are returned too).

``digits_edit_gold`` / ``digits_edit_gold_preservation`` / ``digits_edit_gold_joint`` (evaluation only): the
same questions answered in {0, 1} by :class:`EditJudge`, trained separately (``scripts/train_edit_judge.py``:
other seed, split, input and architecture; the colour is read by a rule): *success* when it reads the target
on the edit, *preservation* when it reads on the edit the kept attribute it reads on the source, *joint*
when both hold.

``digits_edit_fidelity`` (evaluation only; issue 39): success, preservation **read strictly**, and a real-looking
edit. The class-level preservation above forgives an edit that redraws a recoloured digit as another person's seven, or
blends a second colour into a redraw; a person would not. Strictly (:class:`StrictPreservation`, no learned parts):

- a **recolour** keeps *the drawing*: the edit's ink is closer to the source's than all but
  :data:`KEEP_QUANTILE` of pairs of *different* real drawings of the same digit are to each other — the RMS distance
  of the 8×8 ink (:func:`rewards.digits.judge2.intensity_8x8`, each scaled to a peak of 1, so a dimmer or brighter
  copy is the same drawing) aligned over one-pixel shifts, against τ_keep, that distance's 5th percentile over seeded
  pairs of calibration digits of one class (:func:`rewards.digits.realness.realness_split`);
- a **redraw** keeps *the colour*: at least :data:`COLOUR_KEPT_SHARE` of the edit's ink (pixels weighted by their
  brightest channel) is nearest in hue to the source's palette colour;

and the edit passes the digits realness check (:mod:`rewards.digits.realness`). Beside it: ``digits_edit_strict_preservation``
and ``digits_edit_real``.

:func:`edit_prompt_records` gives the family's built-in (instruction, source) pairs: sources from the digits
held out of the editing model's pretraining (:data:`PRETRAIN_SPLIT_SEED`).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import torch
from torch import nn

from rewards.base import Reward, register_reward
from rewards.digits.classifiers import DigitsClassifier
from rewards.digits.data import ASSET_DIR, COLOUR_NAMES, DIGIT_WORDS, load_digit_intensities, split_indices
from rewards.digits.io import JsonSafetensorsMixin
from rewards.digits.judge2 import PALETTE, ink_intensity, intensity_8x8, read_colour, render
from rewards.digits.realness import SPLIT_SEED, realness_check, realness_split

EDIT_ASSET_DIR = ASSET_DIR.parent / "digits_edit"
EDIT_KINDS = ("recolour", "redraw")
EDIT_WORDS = ["make", "it", "turn", "the", "into", "a", "an", *COLOUR_NAMES, *DIGIT_WORDS]
"""every word of every instruction (the editing text encoder's vocabulary after its padding token)"""
MAX_WORDS = 6
"""words of the longest instruction (``turn the <digit> into a(n) <digit>``)"""
PRETRAIN_SPLIT_SEED = 33
"""``split_indices(1797, 33)``: the editing model pretrains on the first part; the built-in edit sources
come from the held-out part"""
KEEP_QUANTILE = 0.05
"""strict preservation of a recolour: the share of pairs of different real drawings of one digit that count as the same drawing"""
COLOUR_KEPT_SHARE = 0.9
"""strict preservation of a redraw: the least share of the edit's ink in the source's hue"""
SHIFTS = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)]
"""one-pixel alignments (16×16) over which a recolour's drawing is compared"""
SOURCES_PER_DIGIT = 2
REDRAWS_PER_SOURCE = 2
PROMPTS_SEED = 7


@dataclasses.dataclass(frozen=True)
class EditTarget:
    """A parsed instruction.

    Attributes:
        kind: ``"recolour"`` or ``"redraw"``.
        target: the colour index (recolour) or the digit (redraw) the edit must show.
        source_digit: the digit a redraw instruction names as the source's (``None`` for a recolour).
    """

    kind: str
    target: int
    source_digit: int | None = None


def article(digit: int) -> str:
    """``"an"`` before ``eight``, else ``"a"``."""
    return "an" if DIGIT_WORDS[digit][0] in "aeiou" else "a"


def recolour_instruction(colour: int) -> str:
    """``recolour_instruction(2) == "make it blue"``."""
    return f"make it {COLOUR_NAMES[colour]}"


def redraw_instruction(source_digit: int, target_digit: int) -> str:
    """``redraw_instruction(3, 8) == "turn the three into an eight"``."""
    return f"turn the {DIGIT_WORDS[source_digit]} into {article(target_digit)} {DIGIT_WORDS[target_digit]}"


def parse_instruction(text: str) -> EditTarget:
    """Inverse of :func:`recolour_instruction` and :func:`redraw_instruction`.

    Raises:
        ValueError: naming the instruction when it is of neither form.
    """
    words = text.strip().lower().split()
    if len(words) == 3 and words[:2] == ["make", "it"] and words[2] in COLOUR_NAMES:
        return EditTarget("recolour", COLOUR_NAMES.index(words[2]))
    if (len(words) == 6 and words[:2] == ["turn", "the"] and words[3] == "into" and words[2] in DIGIT_WORDS
            and words[5] in DIGIT_WORDS and words[4] == article(DIGIT_WORDS.index(words[5]))):
        return EditTarget("redraw", DIGIT_WORDS.index(words[5]), DIGIT_WORDS.index(words[2]))
    raise ValueError(
        f"digits edit instruction {text!r} is neither 'make it <colour>' (colour in {COLOUR_NAMES}) nor "
        "'turn the <digit> into a(n) <digit>' (digits spelt out: 'turn the three into an eight')"
    )


def edit_prompt_records(sources_per_digit: int = SOURCES_PER_DIGIT, redraws_per_source: int = REDRAWS_PER_SOURCE,
                        seed: int = PROMPTS_SEED) -> list[tuple[str, torch.Tensor, str]]:
    """The built-in editing prompts: ``(instruction, source uint8 [3, 16, 16], name)``.

    For each digit class, ``sources_per_digit`` real digits held out of the editing model's pretraining
    (seeded choice), each in a random palette colour, get one recolour to another random colour and
    ``redraws_per_source`` redraws into other, distinct random digits (colour kept):
    ``10 · sources_per_digit · (1 + redraws_per_source)`` prompts, digit-major. Redraws outnumber recolours
    because they are the edit that needs drawing (a recolour copies every stroke through the source channels).
    """
    intensity, labels = load_digit_intensities()
    held = split_indices(len(labels), PRETRAIN_SPLIT_SEED)[1]
    g = torch.Generator().manual_seed(seed)
    records = []
    for digit in range(10):
        pool = held[labels[held] == digit]
        chosen = pool[torch.randperm(len(pool), generator=g)[:sources_per_digit]]
        for index in chosen.tolist():
            colour = int(torch.randint(0, len(COLOUR_NAMES), (1,), generator=g))
            new_colour = (colour + 1 + int(torch.randint(0, len(COLOUR_NAMES) - 1, (1,), generator=g))) % len(COLOUR_NAMES)
            new_digits = [(digit + 1 + int(k)) % 10 for k in torch.randperm(9, generator=g)[:redraws_per_source]]
            source = render(intensity[index : index + 1], torch.tensor([colour]))[0]
            name = f"digit{index}-{COLOUR_NAMES[colour]}"
            records.append((recolour_instruction(new_colour), source, name))
            records.extend((redraw_instruction(digit, new_digit), source, name) for new_digit in new_digits)
    return records


def _targets(prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(is_recolour [B] bool, target [B])`` of the instructions."""
    parsed = [parse_instruction(p) for p in prompts]
    return torch.tensor([t.kind == "recolour" for t in parsed]), torch.tensor([t.target for t in parsed])


def _check(name: str, images: torch.Tensor, prompts: list[str], source_images: torch.Tensor | None) -> None:
    if source_images is None:
        raise ValueError(f"reward {name!r} scores edits: call it with source_images= (uint8 [B, 3, 16, 16]), as an editing run does")
    for what, x in (("images", images), ("source_images", source_images)):
        if not isinstance(x, torch.Tensor) or x.dtype != torch.uint8 or x.ndim != 4 or tuple(x.shape[1:]) != (3, 16, 16) or x.shape[0] != len(prompts):
            got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"reward {name!r}: {what} must be uint8 [{len(prompts)}, 3, 16, 16], got {got}")


@register_reward("digits_edit")
class DigitsEditReward(Reward):
    """``p(target | edit) · p(kept | edit)`` under the digits reward classifier (see the module docstring).

    Args:
        path: folder of the classifier (default: the shipped ``assets/digits/reward_classifier``).
        device: where the classifier runs.
    """

    unit = "probability in [0, 1]"
    scale = (0.0, 1.0)
    needs_source = True

    def __init__(self, path: str | None = None, device: str = "cpu"):
        self.device = device
        self.model = DigitsClassifier.from_pretrained(path or ASSET_DIR / "reward_classifier").to(device)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None, *, source_images: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        _check(self.name, images, prompts, source_images)
        recolour, target = _targets(prompts)
        recolour, target = recolour.to(self.device), target.to(self.device)
        d_edit, c_edit = (logits.softmax(-1) for logits in self.model(images.to(self.device).float() / 255.0))
        d_src, c_src = self.model(source_images.to(self.device).float() / 255.0)
        pick = lambda p, i: p.gather(1, i[:, None])[:, 0]
        success = torch.where(recolour, pick(c_edit, target.clamp_max(len(COLOUR_NAMES) - 1)), pick(d_edit, target))
        preservation = torch.where(recolour, pick(d_edit, d_src.argmax(-1)), pick(c_edit, c_src.argmax(-1)))
        return {self.name: (success * preservation).cpu(), f"{self.name}_success": success.cpu(), f"{self.name}_preservation": preservation.cpu()}


def project_intensity(images: torch.Tensor, colour: torch.Tensor) -> torch.Tensor:
    """``images [B, 3, H, W]`` in [0, 1] → ``[B, 1, H, W]``: each pixel's least-squares intensity along palette
    colour ``colour [B]`` (``<x, c> / <c, c>``), clipped to [0, 1]."""
    c = PALETTE.to(images)[colour]
    return ((images * c[:, :, None, None]).sum(1, keepdim=True) / (c * c).sum(1).view(-1, 1, 1, 1)).clamp(0, 1)


class EditJudge(JsonSafetensorsMixin, nn.Module):
    """The gold edit judge: colour by a rule (:func:`rewards.digits.judge2.read_colour`, the palette colour
    nearest the brightness-weighted mean RGB), digit by a small all-convolutional net on the 16×16 intensity
    along that colour (:func:`project_intensity`) — no colour channels, no pooling layers, unlike the reward's CNN.

    Args:
        width: channels of the first convolution.
    """

    def __init__(self, width: int = 16):
        super().__init__()
        self.width = width
        self.digit_net = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.SiLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.SiLU(),
            nn.Conv2d(2 * width, 4 * width, 3, stride=2, padding=1), nn.SiLU(),
            nn.Conv2d(4 * width, 10, 4),  # 4×4 → 1×1: the digit logits
            nn.Flatten(),
        )

    @property
    def config(self) -> dict:
        return {"width": self.width}

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``images [B, 3, 16, 16]`` float in [0, 1] → (digit logits ``[B, 10]``, colour read ``[B]``)."""
        colour = read_colour(images)
        return self.digit_net(project_intensity(images, colour) * 2.0 - 1.0), colour


@torch.no_grad()
def judge_edits(judge: EditJudge, images: torch.Tensor, prompts: list[str], source_images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(success [B] bool, preservation [B] bool)`` of edits ``images`` (uint8) of ``source_images`` (uint8)
    under ``judge`` (see the module docstring)."""
    recolour, target = _targets(prompts)
    digit_logits, colour = judge(images.float() / 255.0)
    src_logits, src_colour = judge(source_images.float() / 255.0)
    digit, src_digit = digit_logits.argmax(-1).cpu(), src_logits.argmax(-1).cpu()
    colour, src_colour = colour.cpu(), src_colour.cpu()
    success = torch.where(recolour, colour == target, digit == target)
    preservation = torch.where(recolour, digit == src_digit, colour == src_colour)
    return success, preservation


class DigitsEditGold(Reward):
    """Gold edit scores in {0, 1} from :class:`EditJudge`: ``<name>`` is this metric (``metric``), and every
    call also returns ``digits_edit_gold`` (success), ``digits_edit_gold_preservation`` and
    ``digits_edit_gold_joint``.

    Args:
        path: folder of the judge (default: the shipped ``assets/digits_edit/judge``).
        device: where the judge runs.
    """

    unit = "accuracy in {0, 1}"
    scale = (0.0, 1.0)
    needs_source = True
    metric = "success"

    def __init__(self, path: str | None = None, device: str = "cpu"):
        self.device = device
        self.model = EditJudge.from_pretrained(path or EDIT_ASSET_DIR / "judge").to(device)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None, *, source_images: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        _check(self.name, images, prompts, source_images)
        success, preservation = judge_edits(self.model, images.to(self.device), prompts, source_images.to(self.device))
        scores = {"digits_edit_gold": success, "digits_edit_gold_preservation": preservation, "digits_edit_gold_joint": success & preservation}
        main = {"success": "digits_edit_gold", "preservation": "digits_edit_gold_preservation", "joint": "digits_edit_gold_joint"}[self.metric]
        return {self.name: scores[main].float(), **{k: v.float() for k, v in scores.items() if k != main}}


@register_reward("digits_edit_gold")
class DigitsEditGoldSuccess(DigitsEditGold):
    """Gold edit success: the judge reads the instruction's target (colour or digit) on the edit."""

    metric = "success"


@register_reward("digits_edit_gold_preservation")
class DigitsEditGoldPreservation(DigitsEditGold):
    """Gold preservation: the judge reads on the edit what it reads on the source, for the attribute the
    instruction did not ask to change (digit of a recolour, colour of a redraw)."""

    metric = "preservation"


@register_reward("digits_edit_gold_joint")
class DigitsEditGoldJoint(DigitsEditGold):
    """Gold success and preservation together."""

    metric = "joint"


# -- fidelity: preservation read strictly ------------------------------------------------------------------------
def hue_share(images: torch.Tensor, colour: torch.Tensor) -> torch.Tensor:
    """``[B]``: the share of each image's ink (pixels weighted by their brightest channel) whose nearest palette colour by
    cosine similarity is ``colour [B]``."""
    weight = images.amax(1)
    palette = torch.nn.functional.normalize(PALETTE.to(images), dim=1)
    nearest = torch.einsum("bchw,kc->bkhw", torch.nn.functional.normalize(images, dim=1), palette).argmax(1)
    kept = (nearest == colour.view(-1, 1, 1)).float()
    return (kept * weight).sum((1, 2)) / weight.sum((1, 2)).clamp_min(1e-8)


def _peak_normalised(x: torch.Tensor) -> torch.Tensor:
    return x / x.amax(-1, keepdim=True).clamp_min(1e-6)


def drawing_distance(edits: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
    """``[B]``: the RMS distance between each float edit's and its source's 8×8 ink (each on the colour it reads, scaled to
    a peak of 1), the smallest over the edit shifted by :data:`SHIFTS` (16×16 pixels)."""
    edit_ink = ink_intensity(edits, read_colour(edits))
    shifted = torch.stack([torch.nn.functional.avg_pool2d(torch.roll(edit_ink, s, dims=(2, 3)), 2).flatten(1) for s in SHIFTS], 1)
    source = _peak_normalised(intensity_8x8(sources, read_colour(sources)))
    return (_peak_normalised(shifted) - source[:, None]).pow(2).mean(-1).sqrt().min(1).values


class StrictPreservation:
    """Preservation as a person reads it (see the module docstring): the drawing distance for recolours, the hue share for
    redraws.

    Attributes:
        keep_threshold: τ_keep, the drawing distance under which a recolour kept the drawing.
        other_pass: the share of pairs of different test drawings of one digit within τ_keep (≈ :data:`KEEP_QUANTILE`).
    """

    def __init__(self, seed: int = SPLIT_SEED, quantile: float = KEEP_QUANTILE):
        intensity, labels = load_digit_intensities()
        _, cal, test = realness_split(seed=seed)
        g = torch.Generator().manual_seed(seed + 30)
        colour = torch.randint(len(COLOUR_NAMES), (len(labels),), generator=g)
        images = render(intensity, colour).float() / 255.0

        def other_pairs(split: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            firsts, seconds = [], []
            for digit in range(10):
                members = split[labels[split] == digit]
                partner = members[torch.randperm(len(members), generator=g)]
                keep = partner != members
                firsts.append(members[keep]), seconds.append(partner[keep])
            return torch.cat(firsts), torch.cat(seconds)

        a, b = other_pairs(cal)
        self.keep_threshold = float(torch.quantile(drawing_distance(images[a], images[b]).double(), quantile, interpolation="lower"))
        a, b = other_pairs(test)
        self.other_pass = float((drawing_distance(images[a], images[b]) <= self.keep_threshold).float().mean())

    def drawing_kept(self, edits: torch.Tensor, sources: torch.Tensor) -> torch.Tensor:
        """``[B]`` bool: each float edit ``[B, 3, 16, 16]`` is within τ_keep of its source's drawing."""
        return drawing_distance(edits, sources) <= self.keep_threshold

    def colour_kept(self, edits: torch.Tensor, source_colour: torch.Tensor) -> torch.Tensor:
        """``[B]`` bool: at least :data:`COLOUR_KEPT_SHARE` of each float edit's ink is in the hue of ``source_colour``."""
        return hue_share(edits, source_colour) >= COLOUR_KEPT_SHARE


@lru_cache(maxsize=2)
def strict_preservation(seed: int = SPLIT_SEED) -> StrictPreservation:
    """The shared :class:`StrictPreservation` (built once per process)."""
    return StrictPreservation(seed)


@register_reward("digits_edit_strict_preservation")
class DigitsEditStrictPreservation(Reward):
    """1.0 when the edit keeps what its instruction said to keep, read strictly (:class:`StrictPreservation`: the same
    drawing for a recolour, the same hue for a redraw), else 0.0; evaluation only (a judge beside the fidelity gold)."""

    unit = "share in {0, 1}"
    scale = (0.0, 1.0)
    needs_source = True

    def __init__(self, device: str = "cpu"):
        self.strict = strict_preservation()

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None, *, source_images: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        _check(self.name, images, prompts, source_images)
        recolour, _ = _targets(prompts)
        x, src = images.cpu().float() / 255.0, source_images.cpu().float() / 255.0
        kept = torch.where(recolour, self.strict.drawing_kept(x, src), self.strict.colour_kept(x, read_colour(src)))
        return {self.name: kept.float()}


@register_reward("digits_edit_fidelity")
class DigitsEditFidelity(DigitsEditGold):
    """Fidelity gold of an edit: the judge reads the target (success), the instruction's kept attribute is kept strictly
    (``digits_edit_strict_preservation``) and the edit passes the digits realness check (``digits_real``); 1.0 or 0.0,
    evaluation only. Also outputs those two parts, beside the gold judge's own three scores."""

    metric = "success"

    def __init__(self, path: str | None = None, device: str = "cpu"):
        super().__init__(path, device)
        self.strict = DigitsEditStrictPreservation(device)
        self.real = realness_check()

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None, *, source_images: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        scores = super().__call__(images, prompts, source_images=source_images)
        success = scores.pop(self.name).bool()
        kept = self.strict(images, prompts, source_images=source_images)[self.strict.name].bool()
        real = self.real.passes(images.cpu())
        return {self.name: (success & kept & real).float(), "digits_edit_strict_preservation": kept.float(), "digits_real": real.float(), **scores}
