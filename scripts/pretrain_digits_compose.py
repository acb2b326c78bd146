"""Make the digits-compose miniature's base model (family ``digits_compose``) and record its gold numbers.

    python scripts/train_compose_judge.py --out assets/digits_compose/judge      # the gold judge, first
    python scripts/pretrain_digits_compose.py --out assets/digits_compose        # then the generator

The shipped base came from ``--max-minutes 7`` (it stopped on time at step 1842); the wall-time stop depends on
the machine, so ``--max-steps 1842 --max-minutes 1000`` reproduces its weights anywhere.

Seeded end to end (``--seed``; ≤ 15 CPU minutes). Steps:

1. Canvases: a task type drawn with ``--task-weights`` (the hard ones — counting, color_attr, position —
   under-represented, as compositional prompts are rare in web captions), a random prompt of that type that is
   *not* in the built-in evaluation set (``rewards.digits.compose.default_prompts``; single_object has only its
   10 prompts, all in that set, so they are the one type not held out), and a canvas that
   satisfies it (``layout`` + ``render``) from the digits of the pretraining split (``split_indices(1797,
   --split-seed)``'s first 80 %), rounded to uint8.
2. The generator (tiny ``SD3Transformer2DModel`` at 32×32, 4×4 patches + the compose text encoder, trained
   jointly) learns rectified flow (``x_σ = (1 − σ)x0 + σε``, ``v = ε − x0``, logit-normal σ); ``--cond-dropout``
   of the prompts are emptied for CFG. It is deliberately left under-trained: every ``--eval-every`` steps the
   trainer's evaluation runs (the 60 built-in prompts × 4 held-out seeds ``trainer.eval_seed=1234``, 10 ODE
   steps, guidance 1) and training stops at the first evaluation whose gold (``digits_compose_gold``)
   reaches ``--stop-at-gold``, or after ``--max-minutes``.
3. ``metadata.json`` records the settings, the history and the base model's gold overall and per task type
   and its training reward; ``pretrain_log.txt`` the printed log.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from diffrl.config import SamplerConfig
from diffrl.sampling.evaluation import deterministic_settings, eval_prompts_and_seeds, score_images
from diffrl.sampling.rollout import sample_trajectories
from pipelines.digits_compose.adapter import DigitsComposeAdapter
from pipelines.schedules import logit_normal_sigmas
from rewards.base import build_reward
from rewards.digits.compose import TASKS, default_prompts, layout, load_digits_12, make_prompt, random_meta, render, tag
from rewards.digits.data import split_indices

PRETRAIN_SPLIT_SEED = 44


def make_batch(intensity: torch.Tensor, labels: torch.Tensor, batch_size: int, weights: torch.Tensor, held: set[str], g: torch.Generator) -> tuple[list[str], torch.Tensor]:
    """``(prompts, canvases [B, 3, 32, 32] in [0, 1], uint8-rounded)`` (see the module docstring)."""
    by_class = [torch.nonzero(labels == d)[:, 0] for d in range(10)]
    prompts, canvases = [], []
    tasks = torch.multinomial(weights, batch_size, replacement=True, generator=g)
    for t in tasks.tolist():
        while True:
            meta = random_meta(TASKS[t], g)
            prompt = make_prompt(meta)
            if prompt not in held:
                break
        objects = layout(meta, g)
        picks = [by_class[d][int(torch.randint(0, len(by_class[d]), (1,), generator=g))] for _, d, _ in objects]
        prompts.append(prompt)
        canvases.append(render(objects, [intensity[i] for i in picks]))
    return prompts, (torch.stack(canvases) * 255.0).round() / 255.0


@torch.no_grad()
def evaluate_compose(adapter: DigitsComposeAdapter, prompts: list[str], seeds: list[int], num_steps: int, metrics: dict) -> tuple[dict, torch.Tensor]:
    """``diffrl.sampling.evaluation.evaluate`` at the canvas size (it samples at the sampler's default 16×16):
    the Euler ODE, ``num_steps`` steps, guidance 1, 32×32; ``({"eval/<name>": mean}, images uint8)``."""
    settings = deterministic_settings(SamplerConfig(num_steps=num_steps, guidance_scale=1.0, height=32, width=32), "flow", num_steps)
    images = sample_trajectories(adapter, prompts, settings=settings, seeds=seeds)["images"]
    return score_images(images, prompts, metrics), images


def evaluate_base(adapter: DigitsComposeAdapter, metrics: dict, eval_seed: int = 1234, seeds_per_prompt: int = 4) -> dict:
    """The trainer's evaluation: the built-in prompts × held-out seeds, 10 ODE steps, guidance 1; the means of
    ``metrics`` (``digits_compose_gold_<task>`` are the per-type golds)."""
    prompts, seeds = eval_prompts_and_seeds(adapter.default_prompts(), seeds_per_prompt, eval_seed)
    scores, _ = evaluate_compose(adapter, prompts, seeds, 10, metrics)
    return {k[len("eval/"):]: v for k, v in scores.items()}


def train(metrics: dict, args, log) -> tuple[DigitsComposeAdapter, dict]:
    intensity, labels = load_digits_12()
    train_idx = split_indices(len(labels), PRETRAIN_SPLIT_SEED)[0]
    intensity, labels = intensity[train_idx], labels[train_idx]
    torch.manual_seed(args.seed)
    adapter = DigitsComposeAdapter(path=None, seed=args.seed)
    te = adapter.text_encoder.requires_grad_(True).train()
    model = adapter.denoiser.train()
    params = list(model.parameters()) + list(te.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed)
    weights = torch.tensor([float(w) for w in args.task_weights.split(",")])
    held = {p for p in default_prompts() if tag(p) != "single_object"}  # the 10 single-object prompts are all of them
    history, t0, step = [], time.time(), 0
    for step in range(1, args.max_steps + 1):
        prompts, canvases = make_batch(intensity, labels, args.batch_size, weights, held, g)
        drop = torch.rand(args.batch_size, generator=g) < args.cond_dropout
        prompts = ["" if d else p for p, d in zip(prompts, drop.tolist())]
        seq, pooled = te.encode(prompts)
        x0 = adapter.images_to_latents(canvases)
        sigma = logit_normal_sigmas(args.batch_size, generator=g)
        eps = torch.randn(x0.shape, generator=g)
        s = sigma.view(-1, 1, 1, 1)
        v = adapter._forward((1 - s) * x0 + s * eps, sigma, {"prompt_embeds": seq, "pooled_prompt_embeds": pooled})
        loss = F.mse_loss(v, eps - x0)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        minutes = (time.time() - t0) / 60
        if step % args.eval_every == 0 or minutes >= args.max_minutes:
            model.eval(); te.eval()
            scores = evaluate_base(adapter, metrics)
            model.train(); te.train()
            history.append({"step": step, "loss": round(loss.item(), 5), **{k: round(v, 4) for k, v in scores.items()}, "seconds": round(time.time() - t0, 1)})
            log(json.dumps(history[-1]))
            if scores["digits_compose_gold"] >= args.stop_at_gold or minutes >= args.max_minutes:
                break
    model.eval(); te.eval().requires_grad_(False)
    model.requires_grad_(False)
    return adapter, {"steps": step, "history": history, "seconds": round(time.time() - t0, 1)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="assets/digits_compose")
    ap.add_argument("--judge", default=None, help="folder of the gold judge (default: <out>/judge)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--task-weights", default="0.3,0.25,0.05,0.3,0.05,0.05", help=f"sampling weights of {', '.join(TASKS)}")
    ap.add_argument("--cond-dropout", type=float, default=0.1)
    ap.add_argument("--max-steps", type=int, default=4000)
    ap.add_argument("--max-minutes", type=float, default=12.0)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--stop-at-gold", type=float, default=0.4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    judge = Path(args.judge) if args.judge else out / "judge"
    lines: list[str] = []

    def log(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    names = ["digits_compose", "digits_compose_gold", *(f"digits_compose_gold_{t}" for t in TASKS)]
    metrics = {name: build_reward(name, **({"path": str(judge)} if name.startswith("digits_compose_gold") else {})) for name in names}
    adapter, gen_meta = train(metrics, args, log)
    adapter.save_pretrained(out)
    base = evaluate_base(adapter, metrics)
    judge_meta = json.loads((judge / "metadata.json").read_text()) if (judge / "metadata.json").is_file() else None
    meta = {"args": vars(args), "pretrain_split_seed": PRETRAIN_SPLIT_SEED, "reward_classifier": "assets/digits/reward_classifier",
            "judge": judge_meta, "generator": gen_meta, "base": base}
    (out / "metadata.json").write_text(json.dumps(meta, indent=2))
    log(json.dumps({"base": base}))
    (out / "pretrain_log.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
