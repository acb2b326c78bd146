"""Rollout replicas on the CPU: the digits recipe with 1 rollout replica + 1 actor (Ray, gloo) at
``distributed.max_staleness`` = 0, 1, 2, against the colocated synchronous loop.

    PYTHONPATH=. python benchmarks/speed/replicas.py                     # runs in outputs/replicas, tables in benchmarks/results
    PYTHONPATH=. python benchmarks/speed/replicas.py --staleness 0 1 --no-colocated --set trainer.steps=40

Each run is ``diffrl train experiment=digits_flow_grpo`` in its own process (the recipe's 120 steps; gold
accuracy evaluated every ``--eval-every`` steps on the recipe's held-out seeds). The replica runs are
``distributed.backend=ray distributed.rollout_replicas=1`` with one torch thread per process (the actor and the
replica each get one of the machine's cores); the colocated run is today's loop in one process with
``--threads`` threads. The run folders go to ``--runs``; ``replicas_cpu.json`` (every evaluation and the
per-step timings) and ``replicas_cpu.md`` (gold vs steps and vs wall time, seconds per step, weight-sync
time and bytes, whether every sync's hashes matched, the staleness and the truncated importance weights)
to ``--out``.
Wall times are only comparable between runs made one after the other on one otherwise idle machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ["experiment=digits_flow_grpo"]


def run_one(name: str, overrides: list[str], out: Path, threads: int) -> dict:
    run_dir = out / name
    cmd = [sys.executable, "-m", "diffrl.tools.cli", "train", *RECIPE, *overrides, f"trainer.output_dir={run_dir}", f"trainer.threads={threads}",
           "trainer.progress=false", "trainer.wandb=disabled"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS=str(threads))
    start = time.perf_counter()
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({' '.join(cmd)}):\n{(proc.stderr or proc.stdout)[-3000:]}")
    return summarise(name, overrides, run_dir, elapsed)


def summarise(name: str, overrides: list[str], run_dir: Path, process_seconds: float) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    train = [r for r in records if r["kind"] == "train"]
    gold = [{"step": r["step"], "gold": r["eval/digits_gold"], "wall_seconds": r["wall_seconds"]} for r in evals]
    # seconds per RL step: between consecutive train records with no evaluation in between
    eval_steps = {r["step"] for r in evals}
    per_step = [b["wall_seconds"] - a["wall_seconds"] for a, b in itertools.pairwise(train) if a["step"] not in eval_steps]

    def mean(key: str) -> float | None:
        values = [r[key] for r in train if key in r]
        return statistics.fmean(values) if values else None

    syncs = [r for r in train if "weight_sync/hash" in r]
    return {
        "name": name, "overrides": overrides, "process_seconds": process_seconds, "gold": gold,
        "gold_gain": gold[-1]["gold"] - gold[0]["gold"],
        "seconds_per_step": statistics.median(per_step) if per_step else None,
        "wall_seconds": evals[-1]["wall_seconds"], "eval_seconds": sum(r["eval/seconds"] for r in evals),
        "time_rollout": mean("time/rollout"), "time_train": mean("time/train"), "time_reward": mean("time/reward"),
        "time_rollout_wait": mean("time/rollout_wait"), "time_proximal": mean("time/proximal"),
        "time_weight_sync": mean("time/weight_sync"), "time_weight_sync_max": max((r["time/weight_sync"] for r in syncs), default=None),
        "time_weight_sync_wait": mean("time/weight_sync_wait"), "weight_sync_bytes": syncs[0]["weight_sync/bytes"] if syncs else None,
        "weight_sync_buckets": syncs[0]["weight_sync/buckets"] if syncs else None,
        "syncs": len(syncs) + (1 if syncs and "weight_sync/initial_hash" in syncs[0] else 0),
        "hashes_equal": all(r["weight_sync/hash_replicas"] == [r["weight_sync/hash"]] for r in syncs) if syncs else None,
        "staleness_mean": mean("staleness"), "rollout_is_weight_mean": mean("rollout_is_weight_mean"),
        "rollout_is_truncated": mean("rollout_is_truncated"),
    }


def _f(value, fmt: str = ".3f") -> str:
    return "–" if value is None else format(value, fmt)


def table(runs: list[dict]) -> str:
    steps = sorted({g["step"] for r in runs for g in r["gold"]})
    lines = ["### Gold accuracy vs steps (wall seconds since the start in brackets)", "",
             "| run | " + " | ".join(f"step {s}" for s in steps) + " | gain |", "|---|" + "---:|" * (len(steps) + 1)]
    for r in runs:
        by_step = {g["step"]: g for g in r["gold"]}
        cells = [f"{by_step[s]['gold']:.3f} ({by_step[s]['wall_seconds']:.0f} s)" if s in by_step else "–" for s in steps]
        lines.append(f"| {r['name']} | " + " | ".join(cells) + f" | {r['gold_gain'] * 100:+.1f} pts |")
    lines += ["", "### Time per step and weight sync", "",
              ("| run | s/step | rollout (s) | train (s) | reward (s) | waiting for rollouts (s) | proximal re-score (s) | sync (s, mean / max) "
              "| sync bytes × buckets | syncs, hashes equal | staleness | IS weight (truncated) | wall (s) |"),
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|---:|"]
    for r in runs:
        sync = f"{_f(r['time_weight_sync'], '.4f')} / {_f(r['time_weight_sync_max'], '.4f')}" if r["time_weight_sync"] is not None else "–"
        size = f"{r['weight_sync_bytes']} × {r['weight_sync_buckets']}" if r["weight_sync_bytes"] else "–"
        hashes = f"{r['syncs']}, {'yes' if r['hashes_equal'] else 'NO'}" if r["hashes_equal"] is not None else "–"
        is_w = f"{_f(r['rollout_is_weight_mean'], '.4f')} ({_f(r['rollout_is_truncated'], '.4f')})" if r["rollout_is_weight_mean"] is not None else "–"
        lines.append(f"| {r['name']} | {_f(r['seconds_per_step'], '.2f')} | {_f(r['time_rollout'], '.2f')} | {_f(r['time_train'], '.2f')} | "
                     f"{_f(r['time_reward'], '.2f')} | {_f(r['time_rollout_wait'], '.2f')} | {_f(r['time_proximal'], '.2f')} | {sync} | {size} | "
                     f"{hashes} | {_f(r['staleness_mean'], '.2f')} | {is_w} | {r['wall_seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results", help="folder of replicas_cpu.json and .md")
    parser.add_argument("--runs", type=Path, default=ROOT / "outputs/replicas", help="folder of the run folders and logs")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2], help="distributed.max_staleness values of the replica runs")
    parser.add_argument("--no-colocated", action="store_true", help="skip the colocated synchronous run")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the colocated run (the replica runs use 1 per process)")
    parser.add_argument("--eval-every", type=int, default=30)
    parser.add_argument("--set", action="append", default=[], help="extra override for every run (repeatable)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    args.runs.mkdir(parents=True, exist_ok=True)
    common = [f"eval.every={args.eval_every}", *args.set]
    plan = [] if args.no_colocated else [("colocated (synchronous, local)", "colocated", [*common], args.threads)]
    plan += [(f"1 replica + 1 actor, k={k}", f"replica_k{k}", [*common, "distributed.backend=ray", "distributed.rollout_replicas=1", f"distributed.max_staleness={k}"], 1)
             for k in args.staleness]
    runs = []
    for name, folder, overrides, threads in plan:
        print(f"running {name} …", flush=True)
        runs.append(run_one(folder, overrides, args.runs, threads))
        runs[-1]["name"] = name
        print(f"  gold {runs[-1]['gold'][0]['gold']:.3f} → {runs[-1]['gold'][-1]['gold']:.3f}, {runs[-1]['wall_seconds']:.0f} s", flush=True)
        (args.out / "replicas_cpu.json").write_text(json.dumps(runs, indent=2))
    (args.out / "replicas_cpu.md").write_text(table(runs))
    print(table(runs))
    short = [r["name"] for r in runs if "k=0" not in r["name"] and "replica" in r["name"] and r["gold_gain"] < 0.20]
    if short:
        print(f"gain below 20 gold points: {', '.join(short)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
