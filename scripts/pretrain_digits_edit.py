"""Make the digits editing miniature's base model (family ``digits_edit``) and record its gold numbers.

    python scripts/train_edit_judge.py --out assets/digits_edit/judge      # the gold judge, first
    python scripts/pretrain_digits_edit.py --out assets/digits_edit        # then the editor

Seeded end to end (``--seed``; a few CPU minutes). Steps:

1. Pairs: sklearn's digits of the pretraining split (``split_indices(1797, 33)``'s first 80 %; the built-in
   edit sources come from the rest), rendered in a random palette colour (uint8-rounded) as sources. A
   **recolour** pair (probability ``--recolour-fraction``) has the same digit in another random colour as
   target, instruction ``"make it <colour>"``; a **redraw** pair has a random other digit of another random
   class in the source's colour as target, instruction ``"turn the <digit> into a(n) <digit>"``.
2. The editor (tiny ``SD3Transformer2DModel`` with 6 input channels + the instruction text encoder, trained
   jointly) learns rectified flow towards the target (``x_σ = (1 − σ)x0 + σε``, ``v = ε − x0``, logit-normal
   σ), the source concatenated to ``x_σ``; ``--cond-dropout`` of the instructions are emptied (source kept) for
   CFG. It is deliberately left under-trained: every ``--eval-every`` steps the trainer's evaluation is run
   (the 60 built-in prompts × 4 held-out seeds ``eval.seed=1234``, 10 ODE steps, guidance 1) and
   training stops at the first evaluation whose gold edit success (``digits_edit_gold``) reaches
   ``--stop-at-success``, so that RL has room to improve it.
3. ``metadata.json`` records the settings, the history and the base model's gold edit success, preservation
   and training reward; ``pretrain_log.txt`` the printed log.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from diffrl.sampling.evaluation import eval_prompts_and_seeds
from diffrl.sampling.evaluator import evaluate
from pipelines.digits_edit.adapter import DigitsEditAdapter
from pipelines.schedules import logit_normal_sigmas
from rewards.base import build_reward
from rewards.digits.data import COLOUR_NAMES, colourise, load_digit_intensities, split_indices
from rewards.digits.edit import PRETRAIN_SPLIT_SEED, parse_instruction, recolour_instruction, redraw_instruction

EVAL_METRICS = ("digits_edit", "digits_edit_gold", "digits_edit_gold_preservation", "digits_edit_gold_joint")


def uint8_round(x: torch.Tensor) -> torch.Tensor:
    return (x.clamp(0, 1) * 255.0).round() / 255.0


def make_pairs(intensity: torch.Tensor, labels: torch.Tensor, batch_size: int, recolour_fraction: float, g: torch.Generator) -> tuple[torch.Tensor, list[str], torch.Tensor]:
    """``(sources [B, 3, 16, 16], instructions, targets [B, 3, 16, 16])`` in [0, 1] (see the module docstring)."""
    n_colours = len(COLOUR_NAMES)
    idx = torch.randint(0, len(labels), (batch_size,), generator=g)
    colour = torch.randint(0, n_colours, (batch_size,), generator=g)
    recolour = torch.rand(batch_size, generator=g) < recolour_fraction
    new_colour = (colour + 1 + torch.randint(0, n_colours - 1, (batch_size,), generator=g)) % n_colours
    digit = labels[idx]
    new_digit = (digit + 1 + torch.randint(0, 9, (batch_size,), generator=g)) % 10
    # a random training digit of each new class: rank r among that class's digits
    by_class = [torch.nonzero(labels == d)[:, 0] for d in range(10)]
    pick = torch.rand(batch_size, generator=g)
    target_idx = torch.stack([by_class[d][int(p * len(by_class[d]))] for d, p in zip(new_digit.tolist(), pick.tolist())])
    sources = uint8_round(colourise(intensity[idx], colour))
    targets = torch.where(
        recolour.view(-1, 1, 1, 1),
        uint8_round(colourise(intensity[idx], new_colour)),
        uint8_round(colourise(intensity[target_idx], colour)),
    )
    instructions = [recolour_instruction(int(c)) if r else redraw_instruction(int(d), int(nd))
                    for r, c, d, nd in zip(recolour.tolist(), new_colour, digit, new_digit)]
    return sources, instructions, targets


@torch.no_grad()
def evaluate_base(adapter: DigitsEditAdapter, metrics: dict, eval_seed: int = 1234, seeds_per_prompt: int = 4) -> dict:
    """The trainer's evaluation (``diffrl.sampling.evaluator.evaluate``): the built-in prompts × held-out seeds,
    10 ODE steps, guidance 1; the means of ``metrics`` and the gold success split by instruction kind."""
    prompts, seeds = eval_prompts_and_seeds(adapter.default_prompts(), seeds_per_prompt, eval_seed)
    scores, images = evaluate(adapter, prompts, seeds=seeds, num_steps=10, guidance_scale=1.0, metrics=metrics)
    out = {k[len("eval/"):]: v for k, v in scores.items()}
    recolour = torch.tensor([parse_instruction(str(p)).kind == "recolour" for p in prompts])
    sources = torch.stack([p.source for p in prompts])
    detail = metrics["digits_edit_gold"](images, [str(p) for p in prompts], None, source_images=sources)
    for kind, mask in (("recolour", recolour), ("redraw", ~recolour)):
        out[f"gold_success_{kind}"] = detail["digits_edit_gold"][mask].mean().item()
        out[f"gold_preservation_{kind}"] = detail["digits_edit_gold_preservation"][mask].mean().item()
    return out


def train_editor(metrics: dict, args, log) -> tuple[DigitsEditAdapter, dict]:
    intensity, labels = load_digit_intensities()
    train_idx = split_indices(len(labels), PRETRAIN_SPLIT_SEED)[0]
    intensity, labels = intensity[train_idx], labels[train_idx]
    torch.manual_seed(args.seed)
    adapter = DigitsEditAdapter(path=None, seed=args.seed)
    te = adapter.text_encoder.requires_grad_(True).train()
    model = adapter.denoiser.train()
    params = list(model.parameters()) + list(te.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed)
    history, t0, step = [], time.time(), 0
    for step in range(1, args.max_steps + 1):
        sources, instructions, targets = make_pairs(intensity, labels, args.batch_size, args.recolour_fraction, g)
        drop = torch.rand(args.batch_size, generator=g) < args.cond_dropout
        instructions = ["" if d else text for text, d in zip(instructions, drop.tolist())]
        seq, pooled = te.encode(instructions)
        x0 = adapter.images_to_latents(targets)
        sigma = logit_normal_sigmas(args.batch_size, generator=g)
        eps = torch.randn(x0.shape, generator=g)
        s = sigma.view(-1, 1, 1, 1)
        cond = {"prompt_embeds": seq, "pooled_prompt_embeds": pooled, "source_latents": adapter.images_to_latents(sources)}
        v = adapter._forward((1 - s) * x0 + s * eps, sigma, cond)
        loss = F.mse_loss(v, eps - x0)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % args.eval_every == 0:
            model.eval(); te.eval()
            scores = evaluate_base(adapter, metrics)
            model.train(); te.train()
            history.append({"step": step, "loss": round(loss.item(), 5), **{k: round(v, 4) for k, v in scores.items()}, "seconds": round(time.time() - t0, 1)})
            log(json.dumps(history[-1]))
            if scores["digits_edit_gold"] >= args.stop_at_success:
                break
    model.eval(); te.eval().requires_grad_(False)
    model.requires_grad_(False)
    return adapter, {"steps": step, "history": history, "seconds": round(time.time() - t0, 1)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="assets/digits_edit")
    ap.add_argument("--judge", default=None, help="folder of the gold edit judge (default: <out>/judge)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--recolour-fraction", type=float, default=0.5)
    ap.add_argument("--cond-dropout", type=float, default=0.1)
    ap.add_argument("--max-steps", type=int, default=3000)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--stop-at-success", type=float, default=0.53)
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

    metrics = {name: build_reward(name, **({"path": str(judge)} if name.startswith("digits_edit_gold") else {})) for name in EVAL_METRICS}
    adapter, gen_meta = train_editor(metrics, args, log)
    adapter.save_pretrained(out)
    base = evaluate_base(adapter, metrics)
    judge_meta = json.loads((judge / "metadata.json").read_text()) if (judge / "metadata.json").is_file() else None
    meta = {"args": vars(args), "pretrain_split_seed": PRETRAIN_SPLIT_SEED, "reward_classifier": "assets/digits/reward_classifier",
            "judge": judge_meta, "editor": gen_meta, "base": base}
    (out / "metadata.json").write_text(json.dumps(meta, indent=2))
    log(json.dumps({"base": base}))
    (out / "pretrain_log.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
