"""Train the digits-compose gold judge's digit classifier (``rewards.digits.compose_judge.ComposeJudgeNet``).

    python scripts/train_compose_judge.py --out assets/digits_compose/judge

Seeded end to end (about a minute on one core). The judge must not share the training reward's classifier
(``assets/digits/reward_classifier``: a max-pooling CNN on 16×16 colour images, seed 1, split seed 11):

1. Split: sklearn's digits split with ``--split-seed`` (77); 80 % to train, the rest held out.
2. Crops exactly as the judge reads them: a training digit (12×12) under a random affine warp (rotation
   ±0.2 rad, scale ±10 %, shear ±0.15, shift ±1 px), a blur on half of them (3×3 box, weight ≤ 0.5), an
   intensity scale in [0.7, 1.2] and Gaussian noise σ ≤ 0.06, in a random palette colour, placed in a slot of
   a 32×32 canvas and rounded to uint8; then ``detect_components`` and ``object_crop`` of its largest object.
   ``--crops`` of them are made once; training draws batches of 128 from them for ``--steps`` AdamW steps.
3. Check (``metadata.json``): digit accuracy on the crops of every held-out digit (clean, colour ``i mod 6``),
   and the judge's GenEval correctness on ``--check-canvases`` canvases drawn from held-out digits that
   satisfy random prompts of each task type (should be ≈ 1).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rewards.digits.compose import TASKS, layout, load_digits_12, make_prompt, random_meta, render, to_uint8
from rewards.digits.compose_judge import ComposeJudgeNet, detect_components, judge_canvases, object_crop
from rewards.digits.data import COLOUR_NAMES, split_indices


def augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """``x [N, 1, 12, 12]`` → warped, sometimes blurred, rescaled and noised intensities in [0, 1]."""
    n = x.shape[0]

    def u(*shape):
        return torch.rand(*shape, generator=g) * 2 - 1

    a, s, sh, t = u(n) * 0.2, 1 + u(n) * 0.1, u(n) * 0.15, u(n, 2) * (1.0 / 6.0)
    theta = torch.stack([torch.stack([s * torch.cos(a), -s * torch.sin(a) + sh, t[:, 0]], 1),
                         torch.stack([s * torch.sin(a), s * torch.cos(a), t[:, 1]], 1)], 1)
    x = F.grid_sample(x, F.affine_grid(theta, list(x.shape), align_corners=False), align_corners=False)
    blur = 0.5 * torch.rand(n, 1, 1, 1, generator=g) * (torch.rand(n, 1, 1, 1, generator=g) < 0.5)
    x = (1 - blur) * x + blur * F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)
    x = x * (0.7 + 0.5 * torch.rand(n, 1, 1, 1, generator=g))
    return (x + 0.06 * torch.rand(n, 1, 1, 1, generator=g) * torch.randn(x.shape, generator=g)).clamp(0, 1)


def crops_of(intensity: torch.Tensor, colour: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The judge's crops of single digits drawn in ``slot`` with ``colour``: ``(crops [N, 1, 12, 12], found [N] bool)``
    (``found`` False when no object was detected; its crop is zeros)."""
    out, found = [], []
    for x, c, s in zip(intensity, colour.tolist(), slot.tolist()):
        canvas = to_uint8(render([(s, 0, c)], [x])).float() / 255.0
        objects = detect_components(canvas)
        found.append(bool(objects))
        out.append(object_crop(canvas, max(objects, key=lambda o: o["area"])) if objects else torch.zeros(1, 12, 12))
    return torch.stack(out), torch.tensor(found)


@torch.no_grad()
def canvas_check(model: ComposeJudgeNet, intensity: torch.Tensor, labels: torch.Tensor, n: int, seed: int) -> dict:
    """GenEval correctness of the judge on ``n`` canvases per task type built from ``intensity`` to satisfy random prompts."""
    g = torch.Generator().manual_seed(seed)
    by_class = [torch.nonzero(labels == d)[:, 0] for d in range(10)]
    out = {}
    for task in TASKS:
        images, prompts = [], []
        for _ in range(n):
            meta = random_meta(task, g)
            objects = layout(meta, g)
            picks = [by_class[d][int(torch.randint(0, len(by_class[d]), (1,), generator=g))] for _, d, _ in objects]
            images.append(to_uint8(render(objects, [intensity[i] for i in picks])))
            prompts.append(make_prompt(meta))
        out[task] = judge_canvases(model, torch.stack(images), prompts).float().mean().item()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="assets/digits_compose/judge")
    ap.add_argument("--seed", type=int, default=9)
    ap.add_argument("--split-seed", type=int, default=77)
    ap.add_argument("--crops", type=int, default=20000)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--check-canvases", type=int, default=100)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    start = time.time()
    intensity, labels = load_digits_12()
    train_idx, held_idx = split_indices(len(labels), args.split_seed)
    g = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    idx = train_idx[torch.randint(0, len(train_idx), (args.crops,), generator=g)]
    colour = torch.randint(0, len(COLOUR_NAMES), (args.crops,), generator=g)
    slot = torch.randint(0, 4, (args.crops,), generator=g)
    crops, found = crops_of(augment(intensity[idx], g), colour, slot)
    crops, y = crops[found], labels[idx][found]
    model = ComposeJudgeNet(args.width)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps)
    model.train()
    for _ in range(args.steps):
        b = torch.randint(0, len(y), (128,), generator=g)
        loss = F.cross_entropy(model(crops[b]), y[b])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    with torch.no_grad():
        held_crops, held_found = crops_of(intensity[held_idx], torch.arange(len(held_idx)) % len(COLOUR_NAMES), torch.arange(len(held_idx)) % 4)
        digit_ok = (model(held_crops).argmax(-1) == labels[held_idx]) & held_found
    meta = {
        "architecture": f"connected components (foreground > 0.3, 1-px dilation merge, min area 8); colour by rule; digit: strided conv net (width {args.width}) on 12x12 crops",
        "seed": args.seed, "split_seed": args.split_seed, "crops": int(found.sum()), "steps": args.steps, "lr": args.lr,
        "held_out": {"digit_accuracy": digit_ok.float().mean().item(), "detected": held_found.float().mean().item(), "size": len(held_idx)},
        "held_out_canvases": canvas_check(model, intensity[held_idx], labels[held_idx], args.check_canvases, args.seed + 1),
        "train_seconds": round(time.time() - start, 1),
    }
    out = Path(args.out)
    model.save_pretrained(out)
    (out / "metadata.json").write_text(json.dumps(meta, indent=2))
    print(json.dumps(meta, indent=2))


if __name__ == "__main__":
    main()
