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
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rewards.base import Reward, register_reward
from rewards.digits.compose import CANVAS, COMPOSE_ASSET_DIR, DIGIT_SIZE, parse
from rewards.digits.data import COLOUR_NAMES, DIGIT_WORDS
from rewards.digits.io import JsonSafetensorsMixin
from rewards.digits.judge2 import PALETTE
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
