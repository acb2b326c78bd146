"""Kill -9 campaign: runs of the default (Flow-GRPO), NFT (EMA old adapter) and MixGRPO (moving window)
recipes are killed with SIGKILL at random moments — half of them while a checkpoint is being written —
and continued with ``trainer.resume=auto`` (a resumed run may be killed again) until they finish. Each
finished run must equal the uninterrupted run of its recipe bit for bit: the final LoRA weights, the
optimizer state, every training record (timings aside) and the last evaluation.

    PYTHONPATH=. python benchmarks/faults/faults.py --kills 21 --out benchmarks/results/faults_kill.json

Short runs (6 steps, a checkpoint every step) keep one trial to ~20 s on a 2-core CPU; wandb is disabled
to keep the process start short (its offline writer is exercised by tests/faults/test_fault_checkpoints.py's
disk-full cases). Prints a markdown row for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
RECIPES = {
    "digits_flow_grpo": [],
    "digits_nft": ["algorithm.old_schedule=constant", "algorithm.old_decay_max=0.5"],
    "digits_mixgrpo": ["sampler.window_shift_every=2", "sampler.window_range=[0,4]"],
}


def command(recipe: str, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "diffrl.tools.cli", "train", f"experiment={recipe}", *RECIPES[recipe], "sampler.num_steps=4", "sampler.eval_num_steps=2",
        f"trainer.steps={STEPS}", "trainer.prompts_per_step=2", "trainer.group_size=4", "eval.seeds_per_prompt=1", "eval.every=3",
        "trainer.checkpoint_every=1", "trainer.threads=1", "trainer.wandb=disabled", "trainer.progress=false", "algorithm.mini_batch_size=4",
        f"trainer.output_dir={out}", *extra,
    ]


def train_records(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time", "perf/")) and "seconds" not in k} for r in rows if r["kind"] == "train"]


def same_run(a: Path, b: Path) -> str | None:
    """None when ``b`` equals ``a`` bit for bit, else what differs."""
    final = Path("checkpoints") / f"step_{STEPS:06d}"
    for name in ("model.safetensors", "optimizer.safetensors"):
        x, y = load_file(str(a / final / name)), load_file(str(b / final / name))
        if x.keys() != y.keys() or any(not torch.equal(x[k], y[k]) for k in x):
            return f"{name} differs"
    if train_records(a) != train_records(b):
        return "training records differ"
    evals = [{k: v for k, v in json.loads((r / "summary.json").read_text())["eval_after"].items() if "seconds" not in k} for r in (a, b)]
    return None if evals[0] == evals[1] else "final evaluation differs"


def kill_once(cmd: list[str], out: Path, env: dict, rng: random.Random, during_checkpoint: bool, budget_s: float) -> str:
    """Start ``cmd``; kill it at a random moment after training began (or as soon as a checkpoint is being
    written). Returns ``killed`` or ``finished`` (it ended before the kill)."""
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600
    while proc.poll() is None and not (out / "metrics.jsonl").exists() and time.time() < deadline:
        time.sleep(0.01)
    if during_checkpoint:
        skip = rng.randint(0, 2)  # let a few checkpoint writes pass first
        seen: set[str] = set()
        while proc.poll() is None and time.time() < deadline:
            tmp = [p.name for p in (out / "checkpoints").glob("step_*.tmp-*")] if (out / "checkpoints").is_dir() else []
            new = [t for t in tmp if t not in seen]
            if new:
                seen.update(new)
                if len(seen) > skip:
                    break
            time.sleep(0.0005)
    else:
        time.sleep(rng.uniform(0, budget_s))
    if proc.poll() is not None:
        return "finished"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return "killed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=21, help="SIGKILLs in all (spread over the recipes)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "faults_kill.json"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    work = Path(tempfile.mkdtemp(prefix="diffrl-kill-"))
    results = {"kills": 0, "trials": [], "steps": STEPS}
    straight = {}
    for recipe in RECIPES:
        start = time.perf_counter()
        straight[recipe] = work / f"{recipe}-straight"
        subprocess.run(command(recipe, straight[recipe]), check=True, env=env, cwd=ROOT, capture_output=True)
        results.setdefault("straight_seconds", {})[recipe] = time.perf_counter() - start
    recipes = list(RECIPES)
    trial = 0
    while results["kills"] < args.kills:
        recipe = recipes[trial % len(recipes)]
        out = work / f"{recipe}-trial{trial}"
        budget = 0.4 * results["straight_seconds"][recipe]  # the process start is part of it; training is the rest
        kills, during, launches = 0, [], 0
        first = True
        while True:
            cmd = command(recipe, out, *([] if first else ["trainer.resume=auto"]))
            first = False
            launches += 1
            # the first launch is always killed; a resumed one is killed again with probability 0.3
            if launches == 1 or rng.random() < 0.3:
                at_checkpoint = rng.random() < 0.5
                outcome = kill_once(cmd, out, env, rng, at_checkpoint, budget)
                if outcome == "killed":
                    kills += 1
                    during.append("checkpoint write" if at_checkpoint else "random")
                    continue
            else:
                proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise SystemExit(f"trial {trial} ({recipe}): resume failed: {proc.stderr.strip().splitlines()[-1:]}")
            if (out / "summary.json").exists():
                break
        problem = same_run(straight[recipe], out)
        results["trials"].append({"trial": trial, "recipe": recipe, "kills": kills, "kill_moments": during, "launches": launches,
                                  "identical": problem is None, "problem": problem})
        results["kills"] += kills
        print(f"trial {trial} {recipe}: {kills} kill(s) ({', '.join(during) or 'none landed'}), {launches} launches → "
              f"{'identical' if problem is None else problem}", flush=True)
        shutil.rmtree(out, ignore_errors=True)
        trial += 1
    identical = sum(t["identical"] for t in results["trials"])
    results["identical_trials"] = identical
    at_ckpt = sum(m == "checkpoint write" for t in results["trials"] for m in t["kill_moments"])
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"| kill -9 (SIGKILL), {len(RECIPES)} recipes | {results['kills']} kills ({at_ckpt} during a checkpoint write) in {len(results['trials'])} runs | "
          f"{identical}/{len(results['trials'])} resumed bit-identical |")
    shutil.rmtree(work, ignore_errors=True)
    if identical != len(results["trials"]):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
