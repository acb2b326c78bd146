"""Make the digits-compose miniature's base model (family ``digits_compose``) and record its gold numbers.

    python scripts/train_compose_judge.py --out assets/digits_compose/judge      # the gold judge, first
    python scripts/pretrain_digits_compose.py --out assets/digits_compose        # then the generator

The shipped base is this script's defaults with ``--eval-every 500``: 4000 steps of batch 64 with balanced task
weights, EMA 0.999 of the weights evaluated and saved; 928 s on the 2-core work machine, about 65 s of it in the
9 evaluations (``metadata.json`` holds the history). Evaluations do not change the weights
(``tests/test_digits_compose.py``), so the defaults (4 evaluations) give the same base in about 15 minutes. ``--max-minutes`` stops on wall time instead (machine
dependent); ``--device cuda`` and ``--snapshots`` serve sweeps (``benchmarks/learning/compose_sweep.py``).

Seeded end to end (``--seed``; ≤ 15 CPU minutes). Steps:

1. Canvases: a task type drawn with ``--task-weights`` (about even by default: with the hard types at 5 %, as
   the first shipped base had them, position and colour attribution stayed at 0–3 % and RL had no signal
   there), a random prompt of that type that is *not* in the built-in evaluation set (``rewards.digits.compose.default_prompts``; single_object has only its
   10 prompts, all in that set, so they are the one type not held out), and a canvas that
   satisfies it (``layout`` + ``render``) from the digits of the pretraining split (``split_indices(1797,
   --split-seed)``'s first 80 %), rounded to uint8.
2. The generator (tiny ``SD3Transformer2DModel`` at 32×32, 4×4 patches + the compose text encoder, trained
   jointly) learns rectified flow (``x_σ = (1 − σ)x0 + σε``, ``v = ε − x0``, logit-normal σ); ``--cond-dropout``
   of the prompts are emptied for CFG. Its step budget leaves it weak on the hard types (base: single object
   0.80, counting 0.35, colour attribution 0.05, position 0.00). Every ``--eval-every`` steps the trainer's
   evaluation runs on the EMA weights (the 60 built-in prompts × 4 held-out seeds ``eval.seed=1234``,
   10 ODE steps, guidance 1). ``--stop-at-gold`` stops at the first evaluation whose gold reaches it (default
   never); ``--max-minutes`` stops after that much wall time.
3. ``metadata.json`` records the settings, the history and the base model's gold overall and per task type
   and its training reward; ``pretrain_log.txt`` the printed log.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import SD3Transformer2DModel

from diffrl.sampling.evaluation import eval_prompts_and_seeds
from diffrl.sampling.evaluator import evaluate
from pipelines.digits_compose.adapter import TRANSFORMER_CONFIG, DigitsComposeAdapter
from pipelines.schedules import logit_normal_sigmas
from rewards.base import build_reward
from rewards.digits.compose import CANVAS, TASKS, default_prompts, layout, load_digits_12, make_prompt, random_meta, render, tag
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


def evaluate_base(adapter: DigitsComposeAdapter, metrics: dict, eval_seed: int = 1234, seeds_per_prompt: int = 4) -> dict:
    """The trainer's evaluation: the built-in prompts × held-out seeds, 10 ODE steps, guidance 1, 32×32; the
    means of ``metrics`` (``digits_compose_gold/<task>`` per task type)."""
    prompts, seeds = eval_prompts_and_seeds(adapter.default_prompts(), seeds_per_prompt, eval_seed)
    scores, _ = evaluate(adapter, prompts, seeds=seeds, num_steps=10, guidance_scale=1.0, metrics=metrics, height=CANVAS, width=CANVAS)
    return {k[len("eval/"):]: v for k, v in scores.items()}


@contextlib.contextmanager
def ema_weights(params: list[torch.Tensor], ema: list[torch.Tensor] | None):
    """``params`` hold the EMA weights inside the block (unchanged without ``ema``)."""
    if ema is None:
        yield
        return
    with torch.no_grad():
        saved = [p.detach().clone() for p in params]
        torch._foreach_copy_([p.data for p in params], ema)
    try:
        yield
    finally:
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in params], saved)


def train(metrics: dict, args, log) -> tuple[DigitsComposeAdapter, dict, dict | None]:
    """The trained adapter (EMA weights when ``--ema``), the history, and the last evaluation's full-precision scores
    when it ran at the final step (the saved weights' own evaluation; None otherwise)."""
    intensity, labels = load_digits_12()
    train_idx = split_indices(len(labels), PRETRAIN_SPLIT_SEED)[0]
    intensity, labels = intensity[train_idx], labels[train_idx]
    torch.manual_seed(args.seed)
    adapter = DigitsComposeAdapter(path=None, seed=args.seed, device=args.device)
    if args.layers or args.heads:  # another size than the family's TRANSFORMER_CONFIG (the saved config.json records it)
        heads = args.heads or TRANSFORMER_CONFIG["num_attention_heads"]
        config = {**TRANSFORMER_CONFIG, "num_layers": args.layers or TRANSFORMER_CONFIG["num_layers"], "num_attention_heads": heads,
                  "caption_projection_dim": heads * TRANSFORMER_CONFIG["attention_head_dim"]}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)
            adapter.denoiser = SD3Transformer2DModel(**config).to(args.device)
    te = adapter.text_encoder.requires_grad_(True).train()
    model = adapter.denoiser.train()
    params = list(model.parameters()) + list(te.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    if args.cosine:  # linear warm-up over 100 steps, then cosine to 0 at --max-steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 100) * 0.5 * (1 + math.cos(math.pi * min(i, args.max_steps) / args.max_steps)))
    ema = [p.detach().clone() for p in params] if args.ema else None
    g = torch.Generator().manual_seed(args.seed)
    weights = torch.tensor([float(w) for w in args.task_weights.split(",")])
    held = {p for p in default_prompts() if tag(p) != "single_object"}  # the 10 single-object prompts are all of them
    history, t0, step, scores, scored_at = [], time.time(), 0, None, -1
    for step in range(1, args.max_steps + 1):
        prompts, canvases = make_batch(intensity, labels, args.batch_size, weights, held, g)
        drop = torch.rand(args.batch_size, generator=g) < args.cond_dropout
        prompts = ["" if d else p for p, d in zip(prompts, drop.tolist())]
        seq, pooled = te.encode(prompts)
        x0 = adapter.images_to_latents(canvases).to(args.device)
        sigma = logit_normal_sigmas(args.batch_size, generator=g).to(args.device)
        eps = torch.randn(x0.shape, generator=g).to(args.device)
        s = sigma.view(-1, 1, 1, 1)
        v = adapter._forward((1 - s) * x0 + s * eps, sigma, {"prompt_embeds": seq, "pooled_prompt_embeds": pooled})
        loss = F.mse_loss(v, eps - x0)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if args.cosine:
            sched.step()
        if ema is not None:  # EMA of the weights (decay warmed up as (1 + n) / (10 + n)); what is evaluated and saved
            torch._foreach_lerp_(ema, [p.detach() for p in params], 1.0 - min(args.ema, (1 + step) / (10 + step)))
        minutes = (time.time() - t0) / 60
        if step % args.eval_every == 0 or minutes >= args.max_minutes:
            model.eval(); te.eval()
            with ema_weights(params, ema):
                scores, scored_at = evaluate_base(adapter, metrics, seeds_per_prompt=args.eval_seeds), step
                if args.snapshots:  # every evaluated step's weights, for sweeps (benchmarks/learning/compose_sweep.py)
                    adapter.save_pretrained(Path(args.out) / "snapshots" / f"step_{step:06d}")
            model.train(); te.train()
            history.append({"step": step, "loss": round(loss.item(), 5), **{k: round(v, 4) for k, v in scores.items()}, "seconds": round(time.time() - t0, 1)})
            log(json.dumps(history[-1]))
            if scores["digits_compose_gold"] >= args.stop_at_gold or minutes >= args.max_minutes:
                break
    model.eval(); te.eval().requires_grad_(False)
    model.requires_grad_(False)
    if ema is not None:
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in params], ema)
    return adapter, {"steps": step, "history": history, "seconds": round(time.time() - t0, 1)}, scores if scored_at == step else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="assets/digits_compose")
    ap.add_argument("--judge", default=None, help="folder of the gold judge (default: <out>/judge)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--task-weights", default="0.15,0.2,0.15,0.2,0.15,0.15", help=f"sampling weights of {', '.join(TASKS)}")
    ap.add_argument("--layers", type=int, default=0, help="transformer blocks (0: the family's TRANSFORMER_CONFIG)")
    ap.add_argument("--heads", type=int, default=0, help="attention heads of 32 dims (0: the family's)")
    ap.add_argument("--ema", type=float, default=0.999, help="EMA decay of the weights that are evaluated and saved (0: none)")
    ap.add_argument("--cosine", action="store_true", help="100-step warm-up, then cosine decay of the learning rate to 0 at --max-steps")
    ap.add_argument("--cond-dropout", type=float, default=0.1)
    ap.add_argument("--max-steps", type=int, default=4000)
    ap.add_argument("--max-minutes", type=float, default=1000.0)
    ap.add_argument("--eval-every", type=int, default=1000)
    ap.add_argument("--eval-seeds", type=int, default=4, help="held-out seeds per prompt of each evaluation (the shipped base: 4)")
    ap.add_argument("--stop-at-gold", type=float, default=1.1, help="stop at the first evaluation whose overall gold reaches this (default: never)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu (the shipped base) or cuda (sweeps; other numerics)")
    ap.add_argument("--snapshots", action="store_true", help="also save the weights at every evaluation under <out>/snapshots/step_N")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    judge = Path(args.judge) if args.judge else out / "judge"
    lines: list[str] = []

    def log(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    metrics = {"digits_compose": build_reward("digits_compose"), "digits_compose_gold": build_reward("digits_compose_gold", path=str(judge))}
    adapter, gen_meta, last = train(metrics, args, log)
    adapter.save_pretrained(out)
    base = last if last is not None else evaluate_base(adapter, metrics, seeds_per_prompt=args.eval_seeds)
    judge_meta = json.loads((judge / "metadata.json").read_text()) if (judge / "metadata.json").is_file() else None
    meta = {"args": vars(args), "pretrain_split_seed": PRETRAIN_SPLIT_SEED, "reward_classifier": "assets/digits/reward_classifier",
            "judge": judge_meta, "generator": gen_meta, "base": base}
    (out / "metadata.json").write_text(json.dumps(meta, indent=2))
    log(json.dumps({"base": base}))
    (out / "pretrain_log.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
