"""The digits-compose gold judge, GenEval's way: detect the digits, classify each, then apply GenEval's rules.

**Detection** (:func:`detect_components`), per canvas: foreground = pixels whose brightest channel exceeds
:data:`FOREGROUND` (0.3); components = 8-connected regions of the foreground *dilated by one pixel* (3×3), so
fragments up to 2 pixels apart merge into one object (**merge rule**); each object keeps only its own
foreground pixels; objects under :data:`MIN_AREA` (8) foreground pixels are dropped as specks. There is no
split rule: two digits that touch are one object (the shipped layout keeps them ≥ 4 pixels apart).

**Classification** of an object: its **colour** is the palette colour with the largest cosine similarity to
the mean RGB of its foreground pixels (a rule); its **digit** is the argmax of :class:`ComposeJudgeNet` on
:func:`object_crop` (the pixels' intensity along that colour, the tight box padded to a square, resized to
12×12); its confidence is that softmax probability. The net is trained separately by
``scripts/train_compose_judge.py`` (own seed, split and architecture; shipped in ``assets/digits_compose/judge``).

**Rules**: ``rewards.geneval.check`` on the detections grouped by digit word, most confident first, with each
object's box (``xyxy`` of its pixels) and colour — GenEval's: a clause holds when its class has ≥ ``count``
objects and the first ``count`` have the asked colour and stand in the asked relation (centre offset with
GenEval's 0.1 margin) to the target clause's objects; counting prompts also exclude ``count + 1``, so
counts are exact.

Reward (evaluation only): ``digits_compose_gold`` ∈ {0, 1} per canvas (all clauses hold). Its ``groups`` method
gives each prompt's task type, so every evaluation also reports ``eval/digits_compose_gold/<task>``, GenEval's
per-task table (``diffrl.sampling.evaluation.group_means``).

**Fidelity** (issue 39): the judge's digit net answers "which digit" for any object, a blob included, and GenEval's
``≥ count`` rule lets a policy fill every slot with copies of the asked digit, so ``digits_compose_fidelity`` counts a
canvas only when the gold holds, **the canvas holds exactly the objects the prompt names** (:func:`exact_counts`) **and
every object on it looks like a real digit** (:class:`ObjectRealness`, no classifier, no learned features): an object's feature is its crop
(:func:`object_crop`) average-pooled to sklearn's 8×8, its distance the RMS difference to the nearest reference
real digit, and it passes within τ, the 95th percentile of the same distance for calibration real digits — every
real digit drawn on a canvas as the compose world draws them and read back through the same detection. The split
is :func:`rewards.digits.realness.realness_split` (70 % reference, 15 % calibration, 15 % test).
``digits_compose_real`` (a judge beside it): 1 when every object of a canvas passes (a canvas with no object passes
vacuously and fails the gold).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rewards.base import Reward, register_reward
from rewards.digits.compose import CANVAS, COMPOSE_ASSET_DIR, DIGIT_SIZE, load_digits_12, parse, render, to_uint8
from rewards.digits.data import COLOUR_NAMES, DIGIT_WORDS
from rewards.digits.io import JsonSafetensorsMixin
from rewards.digits.judge2 import PALETTE
from rewards.digits.realness import PASS_QUANTILE, SPLIT_SEED, nearest_distance, realness_split
from rewards.geneval import check

FOREGROUND = 0.3
MIN_AREA = 8
CROP = DIGIT_SIZE
JUDGE_DIR = COMPOSE_ASSET_DIR / "judge"


def detect_components(image: torch.Tensor) -> list[dict]:
    """Objects of one float canvas ``[3, H, W]`` in [0, 1] (see the module docstring), top-to-bottom then
    left-to-right by first pixel: ``{"mask": bool [H, W], "box": [x0, y0, x1, y1] (pixel edges), "area",
    "colour": palette index}``."""
    from scipy import ndimage  # scikit-learn's dependency; imported here like sklearn in rewards.digits.data

    rgb = image.detach().float().cpu()
    fg = (rgb.amax(0) > FOREGROUND).numpy()
    labels, n = ndimage.label(ndimage.binary_dilation(fg, structure=np.ones((3, 3))), structure=np.ones((3, 3)))
    palette = F.normalize(PALETTE, dim=1)
    out = []
    for k in range(1, n + 1):
        mask = (labels == k) & fg
        area = int(mask.sum())
        if area < MIN_AREA:
            continue
        ys, xs = np.nonzero(mask)
        m = torch.from_numpy(mask)
        mean_rgb = rgb[:, m].mean(1)
        colour = int((F.normalize(mean_rgb, dim=0) @ palette.T).argmax())
        out.append({"mask": m, "box": [float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1)], "area": area, "colour": colour})
    return out


def object_crop(image: torch.Tensor, obj: dict) -> torch.Tensor:
    """``[1, 12, 12]``: the object's pixels' least-squares intensity along its colour (others 0), its box
    padded to a centred square, resized (bilinear, antialiased) to 12×12."""
    c = PALETTE[obj["colour"]]
    intensity = ((image.float().cpu() * c[:, None, None]).sum(0) / (c * c).sum()).clamp(0, 1) * obj["mask"]
    x0, y0, x1, y1 = (int(v) for v in obj["box"])
    side = max(x1 - x0, y1 - y0)
    box = intensity[y0:y1, x0:x1]
    pad_y, pad_x = side - (y1 - y0), side - (x1 - x0)
    square = F.pad(box, (pad_x // 2, pad_x - pad_x // 2, pad_y // 2, pad_y - pad_y // 2))
    return F.interpolate(square[None, None], size=(CROP, CROP), mode="bilinear", align_corners=False, antialias=True)[0]


class ComposeJudgeNet(JsonSafetensorsMixin, nn.Module):
    """Digit classifier of object crops ``[B, 1, 12, 12]`` in [0, 1]: two 3×3 convs (SiLU, the second
    strided), a 3×3 strided conv, then a linear layer — one channel, no pooling (the reward's classifier is a
    max-pooling CNN on 16×16 colour images).

    Args:
        width: channels of the first convolution.
    """

    def __init__(self, width: int = 16):
        super().__init__()
        self.width = width
        self.net = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.SiLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.SiLU(),  # 6×6
            nn.Conv2d(2 * width, 4 * width, 3, stride=2, padding=1), nn.SiLU(),  # 3×3
            nn.Flatten(), nn.Linear(4 * width * 9, 10),
        )

    @property
    def config(self) -> dict:
        return {"width": self.width}

    def forward(self, crops: torch.Tensor) -> torch.Tensor:
        return self.net(crops * 2.0 - 1.0)


@torch.no_grad()
def detect(judge: ComposeJudgeNet, image: torch.Tensor) -> dict[str, list[dict]]:
    """GenEval-style detections of one float canvas ``[3, H, W]``: ``{digit word: [{"box", "score", "color"}, …]}``,
    most confident first."""
    objects = detect_components(image)
    if not objects:
        return {}
    probs = judge(torch.stack([object_crop(image, o) for o in objects])).softmax(-1)
    score, digit = probs.max(-1)
    found: dict[str, list[dict]] = {}
    for o, s, d in zip(objects, score.tolist(), digit.tolist()):
        found.setdefault(DIGIT_WORDS[d], []).append({"box": o["box"], "score": s, "color": COLOUR_NAMES[o["colour"]]})
    return {k: sorted(v, key=lambda x: -x["score"]) for k, v in found.items()}


def judge_canvases(judge: ComposeJudgeNet, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """``[B]`` bool: GenEval's correctness of each uint8 canvas for its prompt."""
    if images.dtype != torch.uint8 or images.ndim != 4 or tuple(images.shape[1:]) != (3, CANVAS, CANVAS) or images.shape[0] != len(prompts):
        raise ValueError(f"the digits-compose judge reads uint8 canvases [{len(prompts)}, 3, {CANVAS}, {CANVAS}], got {images.dtype} {tuple(images.shape)}")
    x = images.float() / 255.0
    return torch.tensor([check(detect(judge, x[i]), parse(p))[1] for i, p in enumerate(prompts)])


@register_reward("digits_compose_gold")
class DigitsComposeGold(Reward):
    """Gold correctness in {0, 1} per canvas (GenEval's per-image score; see the module docstring).

    Args:
        path: folder of the judge net (default: the shipped ``assets/digits_compose/judge``).
        device: informational (the judge runs on CPU).
    """

    unit = "accuracy in {0, 1}"
    scale = (0.0, 1.0)

    def __init__(self, path: str | None = None, device: str = "cpu"):
        self.device = device
        self.model = ComposeJudgeNet.from_pretrained(path or JUDGE_DIR)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> dict[str, torch.Tensor]:
        return {self.name: judge_canvases(self.model, images.cpu(), list(prompts)).float()}

    def groups(self, prompts: list[str]) -> list[str]:
        """Each prompt's GenEval task type (:func:`rewards.digits.compose.tag`): the evaluation reports the gold per type."""
        return [parse(p)["tag"] for p in prompts]


# -- fidelity: every object a real digit ----------------------------------------------------------------------
def object_features(image: torch.Tensor, objects: list[dict]) -> torch.Tensor:
    """``[len(objects), 64]``: each object's :func:`object_crop` average-pooled to 8×8 (a float canvas ``[3, H, W]``)."""
    if not objects:
        return torch.zeros(0, 64)
    crops = torch.stack([object_crop(image, o) for o in objects])
    return F.adaptive_avg_pool2d(crops, 8).flatten(1)


def rendered_real_canvases(indices: torch.Tensor, seed: int, digits_12: torch.Tensor | None = None) -> torch.Tensor:
    """Real digits ``indices``, each alone on a uint8 canvas as the compose world draws them (12×12 in a seeded slot,
    a seeded palette colour) → ``[N, 3, 32, 32]``; ``digits_12``: :func:`load_digits_12`'s intensities, if at hand."""
    x12 = load_digits_12()[0] if digits_12 is None else digits_12
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(4, (len(indices),), generator=g)
    colours = torch.randint(len(COLOUR_NAMES), (len(indices),), generator=g)
    return to_uint8(torch.stack([render([(int(s), 0, int(c))], [x12[i]]) for i, s, c in zip(indices.tolist(), slots, colours)]))


class ObjectRealness:
    """Is every object on a canvas within reach of a real digit? (see the module docstring; deterministic, ~1 s to build)

    Attributes:
        reference: ``[R, 64]`` features of the reference digits' objects (the largest object of each canvas).
        threshold: τ, the pass distance (RMS ink intensity in [0, 1]).
        calibration_pass / test_pass: share of calibration / test canvases (one real digit each) whose objects all pass.
    """

    def __init__(self, seed: int = SPLIT_SEED, quantile: float = PASS_QUANTILE):
        ref, cal, test = realness_split(seed=seed)
        x12, _ = load_digits_12()
        feats = []
        for canvas in rendered_real_canvases(ref, seed, x12).float() / 255.0:
            objects = detect_components(canvas)
            if objects:
                feats.append(object_features(canvas, [max(objects, key=lambda o: o["area"])])[0])
        self.reference = torch.stack(feats)
        cal_d = torch.stack([self.canvas_distance(c) for c in rendered_real_canvases(cal, seed + 10, x12)])
        self.threshold = float(torch.quantile(cal_d.double(), quantile, interpolation="higher"))
        self.calibration_pass = float((cal_d <= self.threshold).float().mean())
        self.test_pass = float(self.passes(rendered_real_canvases(test, seed + 20, x12)).float().mean())

    def canvas_distance(self, image: torch.Tensor, objects: list[dict] | None = None) -> torch.Tensor:
        """The largest distance to the nearest reference digit over the objects of one canvas (uint8 or float
        ``[3, H, W]``; ``objects``: its :func:`detect_components`, if already at hand); 0 for a canvas without objects."""
        x = image.float() / 255.0 if image.dtype == torch.uint8 else image.float()
        objects = detect_components(x) if objects is None else objects
        if not objects:
            return torch.tensor(0.0)
        return nearest_distance(object_features(x, objects), self.reference).max()

    def passes(self, images: torch.Tensor) -> torch.Tensor:
        """``[B]`` bool: every object of each canvas ``images [B, 3, H, W]`` lies within τ of a real digit."""
        return torch.stack([self.canvas_distance(x) for x in images]) <= self.threshold


@lru_cache(maxsize=2)
def object_realness(seed: int = SPLIT_SEED, quantile: float = PASS_QUANTILE) -> ObjectRealness:
    """The shared :class:`ObjectRealness` of these settings (built once per process)."""
    return ObjectRealness(seed, quantile)


@register_reward("digits_compose_real")
class DigitsComposeReal(Reward):
    """1.0 when every object on the canvas passes :class:`ObjectRealness`, else 0.0; evaluation only (a judge beside the
    fidelity gold). Also outputs ``digits_compose_real_distance``, the largest object distance of each canvas."""

    unit = "share in {0, 1}"
    scale = (0.0, 1.0)

    def __init__(self, device: str = "cpu"):
        self.check = object_realness()

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> dict[str, torch.Tensor]:
        d = torch.stack([self.check.canvas_distance(x) for x in images.cpu()])
        return {self.name: (d <= self.check.threshold).float(), f"{self.name}_distance": d}


@register_reward("digits_compose_fidelity")
class DigitsComposeFidelity(DigitsComposeGold):
    """Fidelity gold: 1.0 when GenEval's rules hold, the canvas holds **exactly** the objects the prompt names (``a one``:
    one object, not four copies; GenEval's ``≥ 1`` lets copies pass) **and** every object passes :class:`ObjectRealness`,
    else 0.0; evaluation only. Also outputs ``digits_compose_real`` and ``digits_compose_exact``."""

    def __init__(self, path: str | None = None, device: str = "cpu"):
        super().__init__(path, device)
        self.check = object_realness()

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> dict[str, torch.Tensor]:
        right = super().__call__(images, prompts)[self.name].bool()
        x = images.cpu().float() / 255.0
        objects = [detect_components(canvas) for canvas in x]  # once per canvas, for both checks
        real = torch.stack([self.check.canvas_distance(c, o) for c, o in zip(x, objects)]) <= self.check.threshold
        exact = exact_counts(prompts, [len(o) for o in objects])
        return {self.name: (right & exact & real).float(), "digits_compose_real": real.float(), "digits_compose_exact": exact.float()}


def exact_counts(prompts: list[str], object_counts: list[int]) -> torch.Tensor:
    """``[B]`` bool: the number of objects found on each canvas (:func:`detect_components`) equals the number its prompt
    names (the sum of its clauses' counts)."""
    return torch.tensor([n == sum(c["count"] for c in parse(p)["include"]) for p, n in zip(prompts, object_counts)])


@register_reward("digits_compose_exact")
class DigitsComposeExact(Reward):
    """1.0 when the canvas holds exactly as many objects as the prompt names (:func:`exact_counts`), else 0.0; evaluation
    only (a judge beside the fidelity gold: extra copies of the asked digits are GenEval-correct and read as wrong here)."""

    unit = "share in {0, 1}"
    scale = (0.0, 1.0)

    def __init__(self, device: str = "cpu"):
        pass

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> dict[str, torch.Tensor]:
        x = images.cpu().float() / 255.0
        return {self.name: exact_counts(list(prompts), [len(detect_components(canvas)) for canvas in x]).float()}
