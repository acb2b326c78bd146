"""GenEval's table for the digits-compose recipes: overall and per task type, before and after, and the plot.

    python benchmarks/learning/compose_table.py --run nft=outputs/compose_nft --run flow_grpo=outputs/compose_flow_grpo \\
        --run flow_grpo_fast=outputs/compose_fast --out benchmarks/results/digits_compose

Reads each finished run folder (``diffrl train experiment=digits_compose_<name>``; its evaluations log
``eval/digits_compose_gold`` and ``eval/digits_compose_gold/<task>``) and writes into ``--out``:

- ``table.md``: one row for the base model (the runs' shared step-0 evaluation) and one per run, overall and per
  task type, with the change in points, the paired t of the overall change, steps and wall time, and the overall gold
  averaged over the run's last ``--last-k`` evaluations (a steadier figure where the curve oscillates between evaluations);
- ``gold_by_task.png``: gold per task type before and after every run (bars), and overall gold against step;
- ``grids/<name>_step<N>.png``: each run's first and last evaluation grids (the first seed of each prompt), which
  the notebook shows and judges again. The run folders themselves stay where they are (``outputs/``, not in git).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from diffrl.tools.analysis import load_run  # noqa: E402
from rewards.digits.compose import TASKS  # noqa: E402

GOLD = "eval/digits_compose_gold"
COLUMNS = ["overall", *TASKS]


def key(column: str) -> str:
    return GOLD if column == "overall" else f"{GOLD}/{column}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, help="NAME=RUN_DIR (repeatable)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--last-k", type=int, default=3, help="evaluations averaged in the last column (the final one included)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = {}
    for spec in args.run:
        name, _, path = spec.partition("=")
        runs[name] = load_run(path)
    firsts = {name: run.eval.iloc[0] for name, run in runs.items()}
    base = next(iter(firsts.values()))
    for name, first in firsts.items():
        if any(abs(first[key(c)] - base[key(c)]) > 1e-9 for c in COLUMNS):
            raise SystemExit(f"run {name!r} starts from another base model or evaluation set than the first run")
    head = "| model | steps | wall (s) | " + " | ".join(COLUMNS) + f" | paired t (overall) | overall, mean of the last {args.last_k} evaluations |"
    lines = [head, "|---|---:|---:|" + "---:|" * len(COLUMNS) + "---:|---:|",
             "| base (`assets/digits_compose`) | – | – | " + " | ".join(f"{base[key(c)]:.3f}" for c in COLUMNS) + " | – | – |"]
    for name, run in runs.items():
        last = run.eval.iloc[-1]
        summary = json.loads((run.path / "summary.json").read_text())
        t = (summary.get("paired_change") or {}).get("digits_compose_gold", {}).get("t", float("nan"))
        cells = [f"{last[key(c)]:.3f} ({100 * (last[key(c)] - base[key(c)]):+.1f})" for c in COLUMNS]
        tail = run.eval[GOLD].iloc[1:].iloc[-args.last_k:]  # trained evaluations only
        late = f"{tail.mean():.3f} ({100 * (tail.mean() - base[GOLD]):+.1f}; steps {int(run.eval['step'].iloc[-len(tail)])}–{int(last['step'])})"
        lines.append(f"| {name} | {int(last['step'])} | {summary['wall_seconds']:.0f} | " + " | ".join(cells) + f" | {t:.1f} | {late} |")
        (out / "grids").mkdir(exist_ok=True)
        for step in (int(run.eval.iloc[0]["step"]), int(last["step"])):
            shutil.copy(run.grid_path(step), out / "grids" / f"{name}_step{step}.png")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    fig, (bars, curves) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    width = 0.8 / (1 + len(runs))
    for i, (label, row) in enumerate([("base", base), *((n, r.eval.iloc[-1]) for n, r in runs.items())]):
        bars.bar([c + i * width for c in range(len(COLUMNS))], [row[key(c)] for c in COLUMNS], width, label=label)
    bars.set_xticks([c + width * len(runs) / 2 for c in range(len(COLUMNS))], COLUMNS, rotation=20)
    bars.set_ylabel("gold (GenEval correctness)")
    bars.set_ylim(0, 1)
    bars.legend()
    bars.set_title("digits-compose: gold per task type, before and after")
    for i, (name, run) in enumerate(runs.items()):  # the bars' colours (base is C0)
        curves.plot(run.eval["step"], run.eval[GOLD], marker="o", label=name, color=f"C{i + 1}")
    curves.set_xlabel("RL step")
    curves.set_ylabel("overall gold")
    curves.set_title("overall gold during training")
    curves.legend()
    fig.tight_layout()
    fig.savefig(out / "gold_by_task.png", dpi=110)


if __name__ == "__main__":
    main()
