"""What the reward misses: fresh seeds per prompt, base against trained, on both judges, diversity and the
Fréchet distance to real digits.

    python benchmarks/learning/collapse.py outputs/compare/flow_grpo outputs/compare/nft --out outputs/collapse
    python benchmarks/learning/collapse.py RUN/checkpoints/step_000060 --out DIR           # a checkpoint in a run folder
    python benchmarks/learning/collapse.py CKPT --recipe experiment=digits_nft --out DIR     # a checkpoint elsewhere

For every source (a run folder: its newest checkpoint, or ``--step``; or a checkpoint folder) the script
rebuilds the run's model, draws ``--seeds`` (8) fresh seeds of every prompt of the run's prompt set (stream
``EVAL`` of base seed ``--seed``, not the run's ``eval.seed``) with the run's deterministic
evaluation sampler, once with the base model (LoRA disabled) and once with the trained one, and scores:

- the run's rewards, its gold judge and ``--judges`` (default ``digits_gold2``); the judges "disagree" when
  their changes from base to trained differ beyond the noise (paired over the seeds,
  ``diffrl.sampling.distribution.judge_disagreement``, |t| > 2);
- diversity (pixel and feature), the near-duplicate fraction and the Fréchet distances
  (``diffrl.sampling.distribution``, feature space ``--feature-space``, default ``digits_gold2``);
- for digits prompts, the same for ``--seeds`` real held-out digits of each prompt's class in its colour
  (the second judge's held-out set): the floor of the Fréchet distance at this sample size and the diversity
  of real data.

Writes ``collapse.json`` (every number, per prompt too), ``collapse.md`` (one table row per source and
model) and ``<name>_seeds.png`` per source (one row per prompt: base seeds | trained seeds | real digits).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from diffrl.data import read_prompt_file
from diffrl.distributed.workers import TrainingWorker
from diffrl.sampling.distribution import (
    build_feature_space,
    distribution_metrics,
    judge_disagreement,
    per_prompt_metrics,
    relative_to_base,
)
from diffrl.sampling.evaluation import (
    deterministic_settings,
    eval_prompts_and_seeds,
    per_sample_scores,
)
from diffrl.sampling.rollout import sample_trajectories
from diffrl.tools.analysis import plot_seed_grid
from diffrl.tools.commands import (
    build_metrics,
    check_checkpoint,
    load_config,
    newest_checkpoint,
)
from diffrl.run_setup import worker_config
from rewards.digits.data import load_digit_intensities, parse_prompt
from rewards.digits.judge2 import judge2_split, render


# -- models and samples ----------------------------------------------------------------------------------
def resolve(source: str, step: int | None, recipe: list[str]) -> tuple[object, Path, str]:
    """``(config, checkpoint folder, label)`` of a run folder (its checkpoint ``step``, default the newest)
    or of a checkpoint folder (its run's config.yaml, else the recipe composed from ``recipe``)."""
    path = Path(source)
    if (path / "checkpoints").is_dir():
        ckpt = newest_checkpoint(path) if step is None else check_checkpoint(path / "checkpoints" / f"step_{step:06d}")
        return load_config(recipe, path / "config.yaml"), ckpt, path.name
    ckpt = check_checkpoint(path)
    run_config = ckpt.parent.parent / "config.yaml"
    if ckpt.parent.name == "checkpoints" and run_config.is_file() and not recipe:
        return load_config([], run_config), ckpt, f"{ckpt.parent.parent.name}@{ckpt.name}"
    if not recipe:
        raise ValueError(f"checkpoint {ckpt} is not inside a run folder: give the recipe it was trained with, e.g. --recipe experiment=digits_nft")
    return load_config(recipe, None), ckpt, ckpt.name


def prompt_set(cfg, adapter) -> list[str]:
    """The run's prompts: ``trainer.prompts`` or the family's built-in set (as the trainer)."""
    return read_prompt_file(cfg.trainer.prompts) if cfg.trainer.prompts else adapter.default_prompts()


def sample(cfg, adapter, prompts: list[str], seeds: list[int]) -> torch.Tensor:
    """uint8 images with the run's deterministic evaluation sampler (as ``RunEvaluation.evaluate``)."""
    settings = deterministic_settings(worker_config(cfg).sampler, adapter.prediction_type, int(cfg.sampler.eval_num_steps))
    return sample_trajectories(adapter, prompts, settings=settings, seeds=seeds, micro_batch_size=cfg.sampler.micro_batch_size)["images"]


def real_digits(prompts: list[str], per_prompt: int, seed: int) -> torch.Tensor | None:
    """``per_prompt`` held-out real digits of each prompt's class in its colour (uint8, as generated), in the
    order of ``prompts`` (each prompt repeated ``per_prompt`` times); None when a prompt is no digits prompt."""
    try:
        parsed = [parse_prompt(p) for p in prompts]
    except ValueError:
        return None
    intensity, labels = load_digit_intensities()
    held = judge2_split(len(labels))[1]
    g = torch.Generator().manual_seed(seed)
    out, i = [], 0
    while i < len(prompts):
        digit, colour = parsed[i]
        pool = held[labels[held] == digit]
        pick = pool[torch.randperm(len(pool), generator=g)[:per_prompt]]
        out.append(render(intensity[pick], torch.full((len(pick),), colour)))
        i += per_prompt
    return torch.cat(out)


# -- scores ----------------------------------------------------------------------------------------------
def evaluate(images: torch.Tensor, prompts: list[str], seeds: list[int], metrics: dict, space) -> dict:
    scores = per_sample_scores(images, prompts, metrics)
    rows = [{"prompt": p, "seed": s, **{k: float(v[i]) for k, v in scores.items()}} for i, (p, s) in enumerate(zip(prompts, seeds))]
    summary = {k: float(v.mean()) for k, v in scores.items()}
    summary.update(distribution_metrics(images, prompts, space, prefix=""))
    per_prompt = per_prompt_metrics(images, prompts, space)
    for row in per_prompt:
        row.update({k: sum(r[k] for r in rows if r["prompt"] == row["prompt"]) / row["n"] for k in scores})
    return {"summary": summary, "rows": rows, "per_prompt": per_prompt}


def measure(source: str, args) -> dict:
    cfg, ckpt, label = resolve(source, args.step, args.recipe)
    worker = TrainingWorker(worker_config(cfg))
    worker.reset()
    worker.load_checkpoint(ckpt)
    prompts, seeds = eval_prompts_and_seeds(prompt_set(cfg, worker.adapter), args.seeds, args.seed)
    metrics = build_metrics(cfg, [*cfg.reward.names, *([cfg.reward.gold] if cfg.reward.gold else []), *args.judges])
    space = None if args.feature_space == "none" else build_feature_space(args.feature_space)
    images = {"trained": sample(cfg, worker.adapter, prompts, seeds)}
    with worker.engine.reference() as base:
        images["base"] = sample(cfg, base, prompts, seeds)
    result = {"source": str(source), "label": label, "gold": cfg.reward.gold, "rewards": list(cfg.reward.names), "checkpoint": str(ckpt), "prompts": len(set(prompts)), "seeds_per_prompt": args.seeds,
              "models": {name: evaluate(images[name], prompts, seeds, metrics, space) for name in ("base", "trained")}}
    real = real_digits(prompts, args.seeds, args.seed) if not args.no_real else None
    if real is not None:
        real_metrics = {k: v for k, v in metrics.items() if k in [cfg.reward.gold, *args.judges]}
        result["models"]["real"] = evaluate(real, prompts, seeds, real_metrics, space)
        images["real"] = real
    base_s, trained_s = result["models"]["base"]["summary"], result["models"]["trained"]["summary"]
    result["vs_base"] = relative_to_base(base_s, trained_s, prefix="")
    gold = cfg.reward.gold
    result["judges"] = {j: judge_disagreement(result["models"]["base"]["rows"], result["models"]["trained"]["rows"], gold, j)
                        for j in args.judges if gold and j != gold}
    fig = plot_seed_grid(images, prompts, args.seeds, title=label)
    result["grid"] = str(args.out / f"{safe(label)}_seeds.png")
    fig.savefig(result["grid"])
    plt.close(fig)
    return result


def safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


# -- outputs ---------------------------------------------------------------------------------------------
def table(results: list[dict], gold: str | None) -> str:
    """The markdown table: one row per source and model (base, trained, real)."""
    judges = sorted({j for r in results for j in r["judges"]})
    rewards = list(dict.fromkeys(k for r in results for k in r["rewards"]))
    head = ["source", "model", *rewards, *([f"{gold} (gold)"] if gold else []), *judges, "diversity px (vs base)",
            "diversity feat (vs base)", "near-dup pairs", "Fréchet / prompt", "Fréchet pooled", "judges disagree (Δgold − Δjudge ± se)"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * 2 + " ---: |" * (len(head) - 2)]
    fmt = lambda s, k, f: f.format(s[k]) if k in s else "–"
    for r in results:
        for name, model in r["models"].items():
            s = model["summary"]
            cells = [r["label"], name]
            cells += [fmt(s, k, "{:.3f}") for k in [*rewards, *([gold] if gold else []), *judges]]
            for k, f in (("diversity_pixel", "{:.3f}"), ("diversity_feature", "{:.2f}")):
                ratio = f" ({r['vs_base'][k + '_vs_base']:.2f}×)" if name == "trained" and k + "_vs_base" in r["vs_base"] else ""
                cells.append(fmt(s, k, f) + ratio)
            cells += [fmt(s, "near_duplicate_frac", "{:.1%}"), fmt(s, "frechet", "{:.1f}"), fmt(s, "frechet_pooled", "{:.1f}")]
            flags = [f"{j}: {'**yes**' if d['disagree'] else 'no'} ({d['difference']:+.3f} ± {d['stderr']:.3f})" for j, d in r["judges"].items()]
            cells.append("; ".join(flags) if name == "trained" and flags else "")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources", nargs="+", help="run folders (newest checkpoint, or --step) or checkpoint folders")
    parser.add_argument("--out", required=True, type=Path, help="output folder (must not hold collapse.json)")
    parser.add_argument("--step", type=int, default=None, help="the checkpoint step of every run folder (default: the newest)")
    parser.add_argument("--recipe", nargs="*", default=[], help="overrides composing the config of a checkpoint outside a run folder (experiment=…)")
    parser.add_argument("--seeds", type=int, default=8, help="fresh seeds per prompt")
    parser.add_argument("--seed", type=int, default=4321, help="base seed of the fresh seeds (the trainer's evaluations use eval.seed=1234)")
    parser.add_argument("--judges", nargs="*", default=["digits_gold2"], help="judges beside the run's reward.gold (reward names)")
    parser.add_argument("--feature-space", default="digits_gold2", help="reward providing the feature space; none: pixel diversity only")
    parser.add_argument("--no-real", action="store_true", help="skip the real-digits floor")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.seeds < 2:
        parser.error("--seeds must be at least 2 (diversity needs pairs)")
    if (args.out / "collapse.json").exists():
        print(f"{args.out} already holds collapse.json; choose another --out", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    results = [measure(source, args) for source in args.sources]
    gold = results[0]["gold"]
    (args.out / "collapse.json").write_text(json.dumps(results, indent=1))
    text = table(results, gold)
    (args.out / "collapse.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
