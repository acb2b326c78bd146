"""Pretrain the digits epsilon UNet (family ``digits_eps``), the base model of the DDPO recipe.

    python scripts/pretrain_digits_eps.py --out assets/digits_eps [--device cuda]

Seeded end to end. The UNet and a fresh ``DigitsTextEncoder`` learn ε-prediction jointly
(``x_t = √ᾱ_t·x0 + √(1 − ᾱ_t)·ε``, uniform t, loss ‖ε̂ − ε‖², 10 % empty prompts for CFG) on the colourised
digits (the same data as the flow generator). Every ``--eval-every`` steps the gold accuracy of 20-step DDIM
(η = 0) samples on the trainer's evaluation prompts and seeds is measured with the shipped gold judge; training
stops at the first evaluation at or above ``--stop-at-gold`` (the base is left imperfect so that RL has room).
``metadata.json`` records every number.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from diffrl.config import SamplerConfig
from diffrl.sampling.evaluation import eval_prompts_and_seeds
from diffrl.sampling.rollout import sample_trajectories
from pipelines.digits.eps import DigitsEpsAdapter, build_unet
from rewards.digits import judge_correct
from rewards.digits.classifiers import DigitsClassifier
from rewards.digits.data import ASSET_DIR, COLOUR_NAMES, all_prompts, colourise, load_digit_intensities, make_prompt


@torch.no_grad()
def gold_accuracy(adapter, judge, guidance_scale: float, num_steps: int = 20, seeds_per_prompt: int = 4, eval_seed: int = 1234) -> float:
    """Gold accuracy of ``num_steps``-step DDIM (η = 0) samples on the trainer's evaluation prompts and seeds."""
    prompts, seeds = eval_prompts_and_seeds(all_prompts(), seeds_per_prompt, eval_seed)
    settings = SamplerConfig(num_steps=num_steps, kind="ddim", noise_level=0.0, clip_sample=1.0, guidance_scale=guidance_scale)
    td = sample_trajectories(adapter, prompts, settings=settings, seeds=seeds)
    return judge_correct(judge, td["images"].cpu(), prompts).float().mean().item()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="assets/digits_eps")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--cond-dropout", type=float, default=0.1)
    ap.add_argument("--max-steps", type=int, default=20000)
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--stop-at-gold", type=float, default=0.35)
    ap.add_argument("--guidance-scale", type=float, default=1.0)
    ap.add_argument("--max-seconds", type=float, default=float("inf"), help="stop (and save) after this much training time")
    ap.add_argument("--width", type=int, default=64, help="first UNet stage width (then 2×, 2×)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    judge = DigitsClassifier.from_pretrained(ASSET_DIR / "gold_classifier").eval()  # scores CPU images
    intens, labels = load_digit_intensities()
    torch.manual_seed(args.seed)
    adapter = DigitsEpsAdapter(path=None, seed=args.seed, device=args.device)
    if args.width != 64:
        w = args.width
        adapter.denoiser = build_unet(args.seed, block_out_channels=(w, 2 * w, 2 * w)).to(args.device)
    unet, te = adapter.denoiser.train(), adapter.text_encoder.requires_grad_(True).train()
    params = list(unet.parameters()) + list(te.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 500))
    abar = adapter._abar.float().to(args.device)
    g = torch.Generator().manual_seed(args.seed)
    history, t0, step = [], time.time(), 0
    for step in range(1, args.max_steps + 1):
        idx = torch.randint(0, len(labels), (args.batch_size,), generator=g)
        colour = torch.randint(0, len(COLOUR_NAMES), (args.batch_size,), generator=g)
        x0 = (colourise(intens[idx], colour) * 2 - 1).to(args.device)
        prompts = [make_prompt(int(d), int(c)) for d, c in zip(labels[idx], colour)]
        drop = (torch.rand(args.batch_size, generator=g) < args.cond_dropout).tolist()
        seq, _ = te.encode(["" if dr else p for p, dr in zip(prompts, drop)])
        t = torch.randint(0, len(abar), (args.batch_size,), generator=g).to(args.device)
        eps = torch.randn(x0.shape, generator=g).to(args.device)
        a = abar[t].view(-1, 1, 1, 1)
        x_t = a.sqrt() * x0 + (1 - a).sqrt() * eps
        loss = F.mse_loss(adapter.forward_train(x_t, t, seq), eps)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % args.eval_every == 0:
            unet.eval(); te.eval()
            acc = gold_accuracy(adapter, judge, args.guidance_scale)
            unet.train(); te.train()
            history.append({"step": step, "loss": loss.item(), "gold_accuracy": acc, "seconds": time.time() - t0})
            print(json.dumps(history[-1]), flush=True)
            if acc >= args.stop_at_gold or time.time() - t0 > args.max_seconds:
                break
    unet.eval().requires_grad_(False)
    te.eval().requires_grad_(False)
    adapter.denoiser, adapter.text_encoder = unet.cpu(), te.cpu()
    adapter.save_pretrained(out)
    adapter.denoiser.to(args.device); adapter.text_encoder.to(args.device)
    base = {str(gs): gold_accuracy(adapter, judge, gs) for gs in (1.0, 2.0, 4.5)}
    meta = {"args": vars(args), "steps": step, "history": history, "base_gold_accuracy_by_guidance": base}
    (out / "metadata.json").write_text(json.dumps(meta, indent=2))
    print(json.dumps({"base_gold_accuracy_by_guidance": base}), flush=True)


if __name__ == "__main__":
    main()
