"""Train the digits miniature's second gold judge (``rewards.digits.judge2``) and ship it.

    python scripts/train_judge2.py --out assets/digits/judge2

Seeded end to end (torch's CPU generator; about 15 s on one core). Steps:

1. Split: the judge learns only from the digits that neither the reward classifier nor the gold judge
   trained on (``judge2_split``: the intersection of their held-out sets, 73 digits); the other 1724
   digits are its held-out set.
2. Training: ``--steps`` AdamW steps on batches of 128 of those digits, each with a random palette colour,
   a random affine warp (rotation ±0.2 rad, scale ±10 %, shear ±0.15, shift ±0.12 of the half-width), an
   intensity scale in [0.7, 1.2] and Gaussian pixel noise σ ≤ 0.08, rounded to uint8 like generated images,
   then read through the judge's own colour rule and 8×8 projection. The colour rule has no parameters.
3. Check: digit, colour and joint accuracy on every held-out digit rendered in colour ``i mod 6``
   (uint8 16×16, ``judge2.render``), written with the split to ``metadata.json`` beside the weights.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rewards.digits.data import COLOUR_NAMES, colourise, load_digit_intensities
from rewards.digits.judge2 import Judge2, judge2_split, render, shipped_split_seeds


def random_affine(x: torch.Tensor, g: torch.Generator, rotation: float = 0.2, scale: float = 0.1, shear: float = 0.15, shift: float = 0.12) -> torch.Tensor:
    """``x [B, 1, H, W]`` warped by a random rotation, scale, shear and shift per image (bilinear, zero padding)."""
    b = x.shape[0]
    u = lambda *shape: torch.rand(*shape, generator=g) * 2 - 1
    angle, s, sh, t = u(b) * rotation, 1 + u(b) * scale, u(b) * shear, u(b, 2) * shift
    theta = torch.zeros(b, 2, 3)
    theta[:, 0, 0], theta[:, 0, 1] = s * torch.cos(angle), -s * torch.sin(angle) + sh
    theta[:, 1, 0], theta[:, 1, 1] = s * torch.sin(angle), s * torch.cos(angle)
    theta[:, :, 2] = t
    return F.grid_sample(x, F.affine_grid(theta, list(x.shape), align_corners=False), align_corners=False)


def training_batch(intensity: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Augmented, coloured, uint8-rounded images ``[B, 3, 16, 16]`` in [0, 1] and their colours."""
    n = intensity.shape[0]
    x = random_affine(intensity, g)
    x = x * (0.7 + 0.5 * torch.rand(n, 1, 1, 1, generator=g))
    x = x + 0.08 * torch.rand(n, 1, 1, 1, generator=g) * torch.randn(x.shape, generator=g)
    colour = torch.randint(0, len(COLOUR_NAMES), (n,), generator=g)
    images = (colourise(x.clamp(0, 1), colour) * 255.0).round() / 255.0
    return images, colour


@torch.no_grad()
def held_out_accuracy(model: Judge2, intensity: torch.Tensor, labels: torch.Tensor) -> dict:
    """Digit, colour and joint accuracy on ``intensity`` rendered in colour ``i mod 6`` (uint8, as generated)."""
    colour = torch.arange(len(labels)) % len(COLOUR_NAMES)
    digit_logits, colour_read = model(render(intensity, colour).float() / 255.0)
    digit_ok, colour_ok = digit_logits.argmax(-1) == labels, colour_read == colour
    return {"digit_accuracy": digit_ok.float().mean().item(), "colour_accuracy": colour_ok.float().mean().item(),
            "accuracy": (digit_ok & colour_ok).float().mean().item(), "size": len(labels)}


def train(seed: int, steps: int, hidden: int, batch_size: int = 128, lr: float = 3e-3) -> tuple[Judge2, dict]:
    intensity, labels = load_digit_intensities()
    train_idx, held_idx = judge2_split(len(labels))
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = Judge2(hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-3)
    start = time.time()
    model.train()
    for _ in range(steps):
        idx = train_idx[torch.randint(0, len(train_idx), (batch_size,), generator=g)]
        images, _ = training_batch(intensity[idx], g)
        loss = F.cross_entropy(model(images)[0], labels[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    meta = {
        "architecture": f"colour: nearest palette colour (rule); digit: MLP 64 -> {hidden} ReLU -> 10 on the 8x8 projected intensity",
        "seed": seed, "steps": steps, "batch_size": batch_size, "lr": lr, "train_seconds": round(time.time() - start, 1),
        "excluded_split_seeds": shipped_split_seeds(), "train_indices": train_idx.tolist(),
        "train_accuracy": held_out_accuracy(model, intensity[train_idx], labels[train_idx]),
        "held_out": held_out_accuracy(model, intensity[held_idx], labels[held_idx]),
    }
    return model, meta


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="assets/digits/judge2")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--hidden", type=int, default=64)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model, meta = train(args.seed, args.steps, args.hidden)
    out = Path(args.out)
    model.save_pretrained(out)
    (out / "metadata.json").write_text(json.dumps(meta, indent=2))
    print(json.dumps({k: v for k, v in meta.items() if k != "train_indices"}, indent=2))


if __name__ == "__main__":
    main()
