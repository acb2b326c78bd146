"""Run every digits recipe and compare them under fidelity: gold counting only real-looking samples, gold, wall time.

    python benchmarks/learning/compare_algorithms.py --out outputs/compare            # all recipes, one at a time
    python benchmarks/learning/compare_algorithms.py --jobs 8 --threads 2 --out DIR   # in parallel (many cores)
    python benchmarks/learning/compare_algorithms.py --only nft,dpo --set "dpo=algorithm.dpo_beta=500"

Each run is ``diffrl train experiment=digits_<name>`` in its own process (``trainer.threads`` torch
threads). The script writes ``results.json`` (every run's evaluations and summary), ``table.md`` (the
RESULTS.md table) and ``gold_curves.png`` (gold accuracy vs images sampled and vs wall time, plus
training reward vs gold accuracy for the runs with and without the KL term, and — when the evaluations hold
them — pixel diversity relative to the base model and the Fréchet distance to real digits vs images sampled)
into ``--out``. The table is ranked by the fidelity headline (``summary.json``'s ``fidelity``: ``digits_fidelity``, the
gold judge's accuracy over the samples within reach of a real digit, at the best evaluation whose feature diversity stays
≥ 0.70 × the base's; issue 39), with the realness pass rate beside it. What the reward misses (``diffrl.sampling.distribution``) gets its own columns: the second
judge before → after and whether its change disagrees with gold's beyond the noise, diversity relative to
the base model, the near-duplicate share and the Fréchet distance before → after; runs whose evaluations
lack these metrics show "–".
Wall times are only comparable between runs made side by side on one machine with the same threads.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from omegaconf import OmegaConf

from diffrl.sampling.distribution import DISTRIBUTION_KEYS, collapse_summary
from diffrl.sampling.evaluation import run_paired_change

ROOT = Path(__file__).resolve().parents[2]

# every digits recipe of one algorithm (configs/experiment/digits_<name>.yaml; the miniatures with their own
# benchmarks, compose and edit, aside), plus Flow-GRPO with its KL; a new algorithm's recipe joins by existing
RECIPES = {
    name: [f"experiment=digits_{name}"]
    for name in sorted(p.stem[len("digits_"):] for p in (ROOT / "configs" / "experiment").glob("digits_*.yaml"))
    if not name.startswith(("compose_", "edit_"))
}
RECIPES["flow_grpo_kl"] = ["experiment=digits_flow_grpo", "algorithm.kl_beta=0.04", "algorithm.name=flow_grpo_kl"]
# ddpo runs JPEG compressibility on digits_eps: gold shows what it costs in content


def run_one(name: str, overrides: list[str], out: Path, threads: int, reuse: Path | None = None) -> dict:
    if reuse is not None:  # a finished run folder (summary.json written), read instead of trained again
        return collect({"name": name, "overrides": overrides, "returncode": 0, "process_seconds": None, "reused": str(reuse)}, reuse)
    run_dir = out / name
    cmd = [sys.executable, "-m", "diffrl.tools.cli", "train", *overrides, f"trainer.output_dir={run_dir}", f"trainer.threads={threads}", "trainer.progress=false", "trainer.wandb=disabled"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS=str(threads))
    start = time.perf_counter()
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    result = {"name": name, "overrides": overrides, "returncode": proc.returncode, "process_seconds": elapsed}
    if proc.returncode != 0:
        result["error"] = (proc.stderr or proc.stdout)[-2000:]
        return result
    return collect(result, run_dir)


def collect(result: dict, run_dir: Path) -> dict:
    if not (run_dir / "summary.json").is_file():
        raise FileNotFoundError(f"{run_dir} holds no summary.json: not a finished `diffrl train` run")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    cfg_lines = (run_dir / "config.yaml").read_text()
    result["summary"] = summary = json.loads((run_dir / "summary.json").read_text())
    if "judges" not in summary:  # a run from before summary.json held it: from the eval files
        reward = OmegaConf.create(cfg_lines).reward
        judges = [j for j in reward.get("judges", []) if f"eval/{j}" in summary["eval_after"]]
        summary.update(collapse_summary(summary["eval_before"], summary["eval_after"], run_dir, summary["steps"], reward.gold, judges))
    if "paired_change" not in summary:  # a run from before summary.json held it: compute it from the eval files
        paired = run_paired_change(run_dir, summary["steps"], [k[5:] for k in summary["eval_after"] if k != "eval/seconds"])
        if paired is not None:
            summary["paired_change"] = paired
    result["evals"] = [r for r in records if r["kind"] == "eval"]
    result["train"] = [
        {k: r.get(k) for k in ("step", "reward_mean", "loss", "kl", "wall_seconds")} for r in records if r["kind"] == "train"
    ]
    result["images_per_step"] = _images_per_step(cfg_lines)
    result["gold"] = OmegaConf.create(cfg_lines).reward.get("gold") or "digits_gold"
    return result


def _images_per_step(config_yaml: str) -> int:
    cfg = OmegaConf.create(config_yaml)
    return int(cfg.trainer.prompts_per_step) * int(cfg.trainer.group_size)


def fidelity_rank(result: dict) -> float:
    """Sort key of the table (descending): the fidelity headline's gain (``summary.json``'s ``fidelity``, issue 39); a
    run without one, or whose every trained evaluation collapsed below the diversity floor, ranks last."""
    gain = (result.get("summary") or {}).get("fidelity", {}).get("gain") if result["returncode"] == 0 else None
    return float("-inf") if gain is None else gain


REALNESS_KEYS = ("eval/digits_real", "eval/digits_compose_real")
"""the realness pass rate of each digits world (digits and edit: the sample; compose: every object of the canvas), the
table's "real pass" column"""


def fidelity_cells(summary: dict) -> list[str]:
    """Cells of the headline under fidelity: fidelity gold before → at its best evaluation that keeps ≥ 0.70 × the base's
    diversity (step), its gain in points, and the realness pass rate before → after ("–" without them; "none" when
    every trained evaluation collapsed)."""
    f = summary.get("fidelity")
    before, after = summary["eval_before"], summary["eval_after"]
    key = next((k for k in REALNESS_KEYS if k in before and k in after), None)
    real = f"{before[key]:.3f} → {after[key]:.3f}" if key else "–"
    if not f:
        return ["–", "–", real]
    if f["best"] is None:
        return [f"{f['before']:.3f} → none (last {f['last']:.3f})", "none", real]
    return [f"{f['before']:.3f} → {f['best']:.3f} (step {f['step']})", f"{100 * f['gain']:+.1f}", real]


def write_table(results: list[dict], path: Path) -> str:
    """The comparison table, ranked by the fidelity headline's gain (then as given)."""
    lines = [
        ("| recipe | steps | images sampled | fidelity gold before → best (step) | Δ fidelity (points) | real pass before → after "
         "| gold before | gold after | Δ gold (points) | reward before → after | paired t of the reward (improved share) "
         "| judge 2 before → after | judges disagree (Δgold − Δjudge ± se) | diversity px / feat (vs base) | near-dup pairs after | Fréchet before → after | wall (s) |"),
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in sorted(results, key=fidelity_rank, reverse=True):
        if r["returncode"] != 0:
            lines.append(f"| {r['name']} | failed: see {r['name']}.log |" + " |" * 15)
            continue
        s = r["summary"]
        delta = 100 * (s["gold_accuracy_after"] - s["gold_accuracy_before"])
        paired = s.get("paired_change", {}).get(_main_reward(r))
        t = f"{paired['t']:+.1f} ({paired['improved_fraction']:.0%})" if paired else "–"
        lines.append(
            f"| {r['name']} | {s['steps']} | {s['steps'] * r['images_per_step']} | {' | '.join(fidelity_cells(s))} | {s['gold_accuracy_before']:.3f} | "
            f"{s['gold_accuracy_after']:.3f} | {delta:+.1f} | {s['reward_before']:.4f} → {s['reward_after']:.4f} | {t} | "
            f"{' | '.join(collapse_cells(s))} | {s['wall_seconds']:.0f} |"
        )
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def collapse_cells(summary: dict) -> list[str]:
    """Table cells of what the reward misses: judge 2 before → after, the disagreement flag, diversity
    relative to base, near-duplicates after, Fréchet before → after ("–" where the run lacks them)."""
    before, after = summary["eval_before"], summary["eval_after"]
    judges = {name: d for name, d in (summary.get("judges") or {}).items() if f"eval/{name}" not in REALNESS_KEYS}  # realness: its own column
    judge = "; ".join(f"{d['judge_before']:.3f} → {d['judge_after']:.3f}" for d in judges.values()) or "–"
    flag = "; ".join(f"{'**yes**' if d['disagree'] else 'no'} ({d['difference']:+.3f} ± {d['stderr']:.3f})" for d in judges.values()) or "–"
    ratio = lambda k: f"{after[k] / before[k]:.2f}×" if k in before and k in after and before[k] > 0 else "–"
    dup = f"{after['eval/near_duplicate_frac']:.1%}" if "eval/near_duplicate_frac" in after else "–"
    fd = f"{before['eval/frechet']:.1f} → {after['eval/frechet']:.1f}" if "eval/frechet" in before and "eval/frechet" in after else "–"
    return [judge, flag, f"{ratio('eval/diversity_pixel')} / {ratio('eval/diversity_feature')}", dup, fd]


def _main_reward(result: dict) -> str:
    """The first training reward's name (``eval/<name>`` in the evaluations, not a judge or distribution metric)."""
    skip = {"eval/seconds", *(f"eval/{k}" for k in DISTRIBUTION_KEYS), *(f"eval/{j}" for j in result["summary"].get("judges", {}))}
    keys = [k[5:] for k in result["evals"][0] if k.startswith("eval/") and k != "eval/digits_gold" and k not in skip]
    return keys[0] if keys else "digits"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 9))
    axes = list(axes.flat)
    for r in results:
        if r["returncode"] != 0:
            continue
        steps = [e["step"] for e in r["evals"]]
        gold = [e[f"eval/{r.get('gold', 'digits_gold')}"] for e in r["evals"]]
        axes[0].plot([s * r["images_per_step"] for s in steps], gold, marker="o", label=r["name"])
        axes[1].plot([e["wall_seconds"] for e in r["evals"]], gold, marker="o", label=r["name"])
        if r["name"].startswith("flow_grpo") and "fast" not in r["name"]:
            axes[2].plot([e["eval/digits"] for e in r["evals"]], gold, marker="o", label=r["name"])
        if _main_reward(r) == "jpeg_compressibility":
            axes[3].plot([s * r["images_per_step"] for s in steps], [e["eval/jpeg_compressibility"] for e in r["evals"]], marker="o", label=r["name"])
        if all("eval/diversity_pixel" in e for e in r["evals"]):
            base = r["evals"][0]["eval/diversity_pixel"]
            axes[4].plot([s * r["images_per_step"] for s in steps], [e["eval/diversity_pixel"] / base for e in r["evals"]], marker="o", label=r["name"])
        if all("eval/frechet" in e for e in r["evals"]):
            axes[5].plot([s * r["images_per_step"] for s in steps], [e["eval/frechet"] for e in r["evals"]], marker="o", label=r["name"])
    axes[0].set(xlabel="images sampled", ylabel="gold accuracy", title="gold accuracy vs images sampled")
    axes[1].set(xlabel="wall time (s)", ylabel="gold accuracy", title="gold accuracy vs wall time")
    axes[2].set(xlabel="training reward (eval)", ylabel="gold accuracy", title="reward vs gold, with and without KL")
    axes[3].set(xlabel="images sampled", ylabel="−JPEG kB (eval, η = 1 on fixed seeds)", title="DDPO: JPEG compressibility")
    axes[4].set(xlabel="images sampled", ylabel="pixel diversity / base", title="diversity across seeds (1 = base model)")
    axes[5].set(xlabel="images sampled", ylabel="Fréchet distance (per prompt, mean)", title="distance to real digits (judge 2 features)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="outputs/compare_algorithms", help="output folder (must not hold results.json)")
    parser.add_argument("--jobs", type=int, default=1, help="runs in parallel")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per run")
    parser.add_argument("--only", default="", help="comma-separated recipe names or --variant labels (default: every recipe and variant)")
    parser.add_argument("--set", action="append", default=[], help="NAME=override: extra override for one recipe (repeatable)")
    parser.add_argument("--variant", action="append", default=[], help="'LABEL:override override …': an extra run (overrides separated by spaces)")
    parser.add_argument("--all", action="append", default=[], help="override for every run (repeatable), e.g. model.device=cuda")
    parser.add_argument("--reuse", action="append", default=[], help="NAME=RUN_DIR: take a finished run folder instead of training NAME again")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if (out / "results.json").exists():
        print(f"{out} already holds results.json; choose another --out", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    recipes = {k: list(v) for k, v in RECIPES.items()}
    for item in args.variant:
        label, overrides = item.split(":", 1)
        recipes[label] = overrides.split()
    if args.only:
        unknown = set(args.only.split(",")) - set(recipes)
        if unknown:
            print(f"unknown recipes {sorted(unknown)}; known: {sorted(recipes)}", file=sys.stderr)
            return 2
        recipes = {k: v for k, v in recipes.items() if k in args.only.split(",")}
    for item in args.set:
        name, override = item.split("=", 1)
        recipes[name].append(override)
    for overrides in recipes.values():
        overrides.extend(args.all)
    reuse = dict(item.split("=", 1) for item in args.reuse)
    unknown = set(reuse) - set(recipes)
    if unknown:
        print(f"--reuse names {sorted(unknown)} are not among the runs {sorted(recipes)}", file=sys.stderr)
        return 2
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_one, name, ov, out, args.threads, Path(reuse[name]) if name in reuse else None) for name, ov in recipes.items()]
        results = [f.result() for f in futures]
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(write_table(results, out / "table.md"))
    plot(results, out / "gold_curves.png")
    return 0 if all(r["returncode"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
