"""Golden short runs of every digits recipe: the numbers a refactor must leave bit-identical.

Each case runs ``diffrl train`` (the CLI, so the script does not depend on internal module names) for a
few steps with evaluations in between and records every number of ``metrics.jsonl`` and ``summary.json``
except wall-clock times. ``--write FILE`` stores them; ``--check FILE`` reruns and compares exactly
(floats with ``==``: on one machine the code path decides them, so any difference is a change of
behaviour). Cases cover every recipe, plus variants that exercise mini-batches × epochs with a
shuffle, micro-batches, the KL to the reference, the MixGRPO window moving and offline DPO pairs.

    python benchmarks/parity/recipe_parity.py --write benchmarks/results/recipe_parity_before.json
    python benchmarks/parity/recipe_parity.py --check benchmarks/results/recipe_parity_before.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["trainer.steps=4", "eval.every=2", "trainer.checkpoint_every=2", "eval.seeds_per_prompt=1",
         "trainer.wandb=disabled", "trainer.progress=false", "trainer.threads=2"]

CASES: dict[str, list[str]] = {
    "default": [],
    "digits_flow_grpo": ["experiment=digits_flow_grpo"],
    "digits_flow_grpo+kl+minibatch": ["experiment=digits_flow_grpo", "algorithm.kl_beta=0.01", "algorithm.mini_batch_size=16",
                                      "algorithm.epochs=2", "algorithm.micro_batch_size=8"],
    "digits_flow_grpo_fast": ["experiment=digits_flow_grpo_fast"],
    "digits_mixgrpo": ["experiment=digits_mixgrpo", "sampler.window_shift_every=1"],
    "digits_grpo_guard": ["experiment=digits_grpo_guard", "algorithm.mini_batch_size=32"],
    "digits_dance_grpo": ["experiment=digits_dance_grpo"],
    "digits_ddpo": ["experiment=digits_ddpo", "algorithm.adv_tracker_min_count=2"],
    "digits_dpo": ["experiment=digits_dpo"],
    "digits_dpo+offline": ["experiment=digits_dpo", "algorithm.preference_pairs={pairs}", "trainer.prompts_per_step=4"],
    "digits_nft": ["experiment=digits_nft"],
    "digits_nft+kl+epochs": ["experiment=digits_nft", "algorithm.kl_beta=0.01", "algorithm.epochs=2", "algorithm.mini_batch_size=32"],
    "digits_awm": ["experiment=digits_awm"],
    "digits_compose_flow_grpo": ["experiment=digits_compose_flow_grpo"],
    "digits_compose_flow_grpo_fast": ["experiment=digits_compose_flow_grpo_fast"],
    "digits_compose_nft": ["experiment=digits_compose_nft"],
    "digits_edit_flow_grpo": ["experiment=digits_edit_flow_grpo"],
    "digits_edit_nft": ["experiment=digits_edit_nft"],
    "digits_dgpo": ["experiment=digits_dgpo"],
    "digits_flow_dppo": ["experiment=digits_flow_dppo"],
    "digits_gardo": ["experiment=digits_gardo"],
}

VOLATILE = ("seconds", "time/", "perf/", "wall", "output_dir", "checkpoint")


def _numbers(record):
    """``record`` without wall-clock times and paths, at every depth."""
    if isinstance(record, dict):
        return {k: _numbers(v) for k, v in record.items() if not any(tag in k for tag in VOLATILE)}
    return record


def _make_pairs(folder: Path) -> Path:
    """A small offline pair file: digits from sklearn drawn in two colours, the prompt's colour preferred."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    names = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    rows = []
    for i in range(12):
        img = digits.images[i] / 16.0
        big = np.kron(img, np.ones((2, 2)))
        red = np.stack([big, big * 0.1, big * 0.1], -1)
        blue = np.stack([big * 0.1, big * 0.1, big], -1)
        for name, arr in (("r", red), ("b", blue)):
            Image.fromarray((arr * 255).astype("uint8")).save(folder / f"{i}_{name}.png")
        rows.append({"prompt": f"a red {names[digits.target[i]]}", "image_0": f"{i}_r.png", "image_1": f"{i}_b.png", "label_0": 1 if i % 3 else 0})
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_case(name: str, overrides: list[str], work: Path, pairs: Path) -> dict:
    out = work / name.replace("+", "_")
    cmd = [str(Path(sys.executable).with_name("diffrl")), "train", *[o.format(pairs=pairs) for o in overrides], *SHORT, f"trainer.output_dir={out}"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "DIFFRL_TRACEBACK": "1"})
    if proc.returncode:
        raise SystemExit(f"{name}: diffrl train failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    records = [_numbers(json.loads(line)) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = _numbers(json.loads((out / "summary.json").read_text()))
    return {"records": records, "summary": summary, "seconds": time.perf_counter() - start}


def _diff(a, b, path="") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        # keys the reference lacks are new measurements (e.g. eval/diversity_*), not changed behaviour
        out = [f"{path}.{k}: missing now" for k in sorted(set(a) - set(b))]
        for k in sorted(set(a) & set(b)):
            out += _diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} vs {len(b)} entries"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=Path)
    group.add_argument("--check", type=Path)
    parser.add_argument("--only", nargs="*", default=None, help="case names (default: all)")
    args = parser.parse_args()
    names = args.only or list(CASES)
    work = Path(tempfile.mkdtemp(prefix="diffrl-parity-"))
    pairs_dir = work / "pairs"
    pairs_dir.mkdir()
    pairs = _make_pairs(pairs_dir)
    results = {}
    try:
        for name in names:
            results[name] = run_case(name, CASES[name], work, pairs)
            print(f"{name}: {len(results[name]['records'])} records, {results[name]['seconds']:.1f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(json.dumps(results, indent=1, sort_keys=True))
        return 0
    reference = json.loads(args.check.read_text())
    failed = 0
    for name in names:
        diffs = _diff(_numbers({k: v for k, v in reference[name].items() if k != "seconds"}), {k: v for k, v in results[name].items() if k != "seconds"})
        print(f"{name}: {'identical' if not diffs else f'{len(diffs)} differences'} ({reference[name]['seconds']:.1f} s → {results[name]['seconds']:.1f} s)")
        for d in diffs[:10]:
            print(f"   {d}")
        failed += bool(diffs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
