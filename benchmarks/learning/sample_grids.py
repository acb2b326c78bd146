"""Base against trained samples, same prompts and seeds, one pair of rows per run (issue 39: "a grid of base vs trained
samples per recipe").

    PYTHONPATH=. python benchmarks/learning/sample_grids.py --compare outputs/compare --out benchmarks/results/grids_digits.png
    PYTHONPATH=. python benchmarks/learning/sample_grids.py --run nft=outputs/nft --run awm=outputs/awm --out grids.png --prompts 20

Each run's evaluation grids hold the first held-out seed of every evaluation prompt (``diffrl.tools.analysis.Run.grid_images``,
exact pixels). For each run the figure shows the first ``--prompts`` of them at step 0 (the base) and at the step its
fidelity headline picked (``summary.json``'s ``fidelity.step``; the last evaluation when the run has no headline or every
trained evaluation collapsed, marked "last"), with the run's fidelity and gold at both steps in the row labels.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from diffrl.logging import image_grid  # noqa: E402
from diffrl.tools.analysis import load_run  # noqa: E402


def pick_step(summary: dict, steps: list[int]) -> tuple[int, str]:
    """``(step, why)``: the fidelity headline's step, else the last evaluation."""
    step = (summary.get("fidelity") or {}).get("step")
    return (int(step), "fidelity best") if step is not None else (steps[-1], "last")


def _score(run, step: int, metric: str | None) -> str:
    if not metric:
        return ""
    row = run.eval[run.eval["step"] == step]
    key = f"eval/{metric}"
    return f"{metric} {float(row[key].iloc[0]):.3f}" if len(row) and key in row else ""


def run_rows(label: str, path: Path, prompts: int, metrics: list[str] | None = None) -> list[tuple[str, torch.Tensor]]:
    """The run's two rows: ``(caption, uint8 [N, 3, H, W])`` for the base and for the picked step, captioned with
    ``metrics`` (default: the run's fidelity metric and gold; a metric the run did not evaluate is left out)."""
    run = load_run(path, label)
    summary = run.summary or {}
    steps = run.eval_steps()
    if not steps or steps[0] != 0 or len(steps) < 2:
        raise SystemExit(f"run {path} needs evaluation grids at step 0 and after training; it has {steps}")
    step, why = pick_step(summary, steps)
    if metrics is None:
        metrics = [(summary.get("fidelity") or {}).get("metric"), run.config.get("reward", {}).get("gold")]
    rows = []
    for s, caption in ((0, "base"), (step, f"step {step} ({why})")):
        images, _ = run.grid_images(s)
        scores = ", ".join(x for x in (_score(run, s, m) for m in metrics) if x)
        rows.append((f"{label}: {caption}\n{scores}", images[:prompts]))
    return rows


def figure(rows: list[tuple[str, torch.Tensor]], out: Path, scale: int = 4) -> Path:
    height = len(rows)
    fig, axes = plt.subplots(height, 1, figsize=(14, 1.0 * height), squeeze=False)
    for ax, (caption, images) in zip(axes[:, 0], rows):
        ax.imshow(image_grid(images, columns=len(images), scale=scale))
        ax.set_ylabel(caption, rotation=0, ha="right", va="center", fontsize=8)
        ax.set_xticks([]), ax.set_yticks([])
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=72)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--compare", action="append", default=[], help="an output folder of compare_algorithms.py (every run in its results.json)")
    parser.add_argument("--run", action="append", default=[], help="LABEL=RUN_DIR: one run folder")
    parser.add_argument("--out", required=True, help="the PNG to write")
    parser.add_argument("--prompts", type=int, default=20, help="evaluation prompts per row (their first seed)")
    parser.add_argument("--metric", action="append", default=None, help="evaluation metric in the row labels (repeatable; default: the fidelity metric and gold)")
    args = parser.parse_args(argv)
    runs: list[tuple[str, Path]] = []
    for folder in map(Path, args.compare):
        results = folder / "results.json"
        if not results.is_file():
            parser.error(f"--compare {folder}: no results.json (run benchmarks/learning/compare_algorithms.py --out {folder} first)")
        for r in json.loads(results.read_text()):
            if r["returncode"] == 0:
                runs.append((r["name"], Path(r.get("reused") or folder / r["name"])))
    for item in args.run:
        label, sep, path = item.partition("=")
        if not sep:
            parser.error(f"--run {item!r}: expected LABEL=RUN_DIR")
        runs.append((label, Path(path)))
    if not runs:
        parser.error("name runs with --compare or --run")
    rows = [row for label, path in runs for row in run_rows(label, path, args.prompts, args.metric)]
    print(figure(rows, Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
