"""Print the fidelity (and gold, realness) curves that ``probe_runs.sh`` wrote: one row per run, one column per
evaluation, with each evaluation's gain over step 0 in fidelity points.

    python benchmarks/learning/probe_curves.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def curves(out: Path) -> dict[str, list[dict]]:
    """``{run: [eval rows in step order]}`` for every ``OUT/<run>/metrics.jsonl``."""
    found = {}
    for metrics in sorted(out.glob("*/metrics.jsonl")):
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        evals = sorted((r for r in rows if r.get("kind") == "eval"), key=lambda r: r["step"])
        if evals:
            found[metrics.parent.name] = evals
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: probe_curves.py OUT", file=sys.stderr)
        return 2
    for name, evals in curves(Path(argv[0])).items():
        key = next((k for k in evals[0] if k.endswith("_fidelity")), None)
        if key is None:
            print(f"{name}: no fidelity metric in its evaluations")
            continue
        gold = key.replace("_fidelity", "_gold")
        base = evals[0][key]
        cells = [f"{r['step']}: {r[key]:.3f} ({100 * (r[key] - base):+.1f})" for r in evals]
        print(f"{name} [{key}]: " + ", ".join(cells))
        print(f"{'':{len(name)}}  gold: " + ", ".join(f"{r['step']}: {r.get(gold, float('nan')):.3f}" for r in evals))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
