"""Train the digits editing miniature's gold judge (``rewards.digits.edit.EditJudge``) and ship it.

    python scripts/train_edit_judge.py --out assets/digits_edit/judge

Seeded end to end (torch's CPU generator; about a minute on one core). The judge must not share the
training reward's classifier (``assets/digits/reward_classifier``: a CNN with max-pooling on the colour image,
seed 1, split seed 11), so it differs in every part it can:

1. Split: sklearn's digits split with ``--split-seed`` (55); 80 % to train, the rest held out.
2. Input and architecture: colour by a parameter-free rule (nearest palette colour to the brightness-weighted
   mean RGB); digit by an all-convolutional net (strided 3×3 convs, SiLU, no pooling) on the one-channel
   16×16 intensity along the colour it read.
3. Training: ``--steps`` AdamW steps on batches of 128 training digits, each with a random palette colour, a
   random affine warp (rotation ±0.25 rad, scale ±12 %, shear ±0.2, shift ±0.15 of the half-width), a blur
   (3×3 box with weight in [0, 0.5]) on half of them, an intensity scale in [0.6, 1.2] and Gaussian pixel noise
   σ ≤ 0.1, rounded to uint8 like generated images.
4. Check: digit, colour and joint accuracy on every held-out digit rendered in colour ``i mod 6`` (uint8),
   written with the settings to ``metadata.json`` beside the weights.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rewards.digits.data import COLOUR_NAMES, colourise, load_digit_intensities, split_indices
from rewards.digits.edit import EditJudge
from rewards.digits.judge2 import render


def random_affine(x: torch.Tensor, g: torch.Generator, rotation: float = 0.25, scale: float = 0.12, shear: float = 0.2, shift: float = 0.15) -> torch.Tensor:
    """``x [B, 1, H, W]`` under a random rotation, scale, shear and shift per image (bilinear, zero padding)."""
    b = x.shape[0]

    def uniform(*shape):
        return torch.rand(*shape, generator=g) * 2 - 1

    angle, s, sh, t = uniform(b) * rotation, 1 + uniform(b) * scale, uniform(b) * shear, uniform(b, 2) * shift
    theta = torch.stack([
        torch.stack([s * torch.cos(angle), -s * torch.sin(angle) + sh, t[:, 0]], 1),
        torch.stack([s * torch.sin(angle), s * torch.cos(angle), t[:, 1]], 1),
    ], 1)
    return F.grid_sample(x, F.affine_grid(theta, list(x.shape), align_corners=False), align_corners=False)


def training_batch(intensity: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Augmented, coloured, uint8-rounded images ``[B, 3, 16, 16]`` in [0, 1] (see the module docstring)."""
    n = intensity.shape[0]
    x = random_affine(intensity, g)
    blurred = F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)
    blur = 0.5 * torch.rand(n, 1, 1, 1, generator=g) * (torch.rand(n, 1, 1, 1, generator=g) < 0.5)
    x = (1 - blur) * x + blur * blurred
    x = x * (0.6 + 0.6 * torch.rand(n, 1, 1, 1, generator=g))
    x = x + 0.1 * torch.rand(n, 1, 1, 1, generator=g) * torch.randn(x.shape, generator=g)
    colour = torch.randint(0, len(COLOUR_NAMES), (n,), generator=g)
    return (colourise(x.clamp(0, 1), colour) * 255.0).round() / 255.0


@torch.no_grad()
def held_out_accuracy(model: EditJudge, intensity: torch.Tensor, labels: torch.Tensor) -> dict:
    """Digit, colour and joint accuracy on ``intensity`` rendered in colour ``i mod 6`` (uint8, as generated)."""
    colour = torch.arange(len(labels)) % len(COLOUR_NAMES)
    digit_logits, colour_read = model(render(intensity, colour).float() / 255.0)
    digit_ok, colour_ok = digit_logits.argmax(-1) == labels, colour_read == colour
    return {"digit_accuracy": digit_ok.float().mean().item(), "colour_accuracy": colour_ok.float().mean().item(),
            "accuracy": (digit_ok & colour_ok).float().mean().item(), "size": len(labels)}


def train(seed: int, split_seed: int, steps: int, width: int, batch_size: int = 128, lr: float = 3e-3) -> tuple[EditJudge, dict]:
    intensity, labels = load_digit_intensities()
    train_idx, held_idx = split_indices(len(labels), split_seed)
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = EditJudge(width)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    start = time.time()
    model.train()
    for _ in range(steps):
        idx = train_idx[torch.randint(0, len(train_idx), (batch_size,), generator=g)]
        loss = F.cross_entropy(model(training_batch(intensity[idx], g))[0], labels[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    meta = {
        "architecture": f"colour: nearest palette colour (rule); digit: all-convolutional net (width {width}) on the 16x16 intensity along that colour",
        "seed": seed, "split_seed": split_seed, "steps": steps, "batch_size": batch_size, "lr": lr,
        "train_seconds": round(time.time() - start, 1),
        "held_out": held_out_accuracy(model, intensity[held_idx], labels[held_idx]),
    }
    return model, meta


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="assets/digits_edit/judge")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--split-seed", type=int, default=55)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--width", type=int, default=16)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, meta = train(args.seed, args.split_seed, args.steps, args.width)
    out = Path(args.out)
    model.save_pretrained(out)
    (out / "metadata.json").write_text(json.dumps(meta, indent=2))
    print(json.dumps(meta, indent=2))


if __name__ == "__main__":
    main()
