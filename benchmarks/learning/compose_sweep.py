"""Sweep the digits-compose miniature: base models from several pretraining settings, then RL recipes from each.

    python benchmarks/learning/compose_sweep.py --out outputs/compose_sweep --jobs 12 \\
        --pretrain "bal:--task-weights 0.15,0.2,0.15,0.2,0.15,0.15" --pretrain "easy:--task-weights 0.3,0.25,0.05,0.3,0.05,0.05" \\
        --pretrain-common "--device cuda --max-steps 4000 --eval-every 250" --base-gold 0.3,0.4 \\
        --recipe digits_compose_nft --recipe digits_compose_flow_grpo --all model.device=cuda --all trainer.steps=300

Stage 1 runs ``scripts/pretrain_digits_compose.py`` once per ``--pretrain LABEL:ARGS`` (in parallel, with
``--snapshots --stop-at-gold 1.1`` so it saves the weights at every evaluation and never stops early). Stage 2
picks, for each pretraining and each ``--base-gold`` target, the first snapshot whose overall gold reaches the
target, and trains every ``--recipe`` (× every ``--rl-variant LABEL:overrides``) from it with
``model.path=<snapshot>``. ``results.json`` (rewritten after every run, so a cut-off sweep keeps what finished)
holds each pretraining's evaluation history and each RL run's gold overall and per task type at every evaluation;
``table.md`` the RL runs' before → after per task type, and each failed run with its exit code and the last line of its
log (a mistyped override fails at once with a one-line error). Exploratory: wall times of parallel runs are contended.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rewards.digits.compose import TASKS

ROOT = Path(__file__).resolve().parents[2]
GOLD = "digits_compose_gold"
TRAIN = "import sys; from diffrl.recipes import compose; from diffrl.trainer import Trainer; Trainer(compose(sys.argv[1:])).fit()"
"""``diffrl train`` without the CLI module (whose reward server needs uvicorn, absent on some GPU machines)"""


def labelled(spec: str) -> tuple[str, str]:
    label, sep, rest = spec.partition(":")
    if not sep or not label:
        raise SystemExit(f"expected LABEL:ARGS, got {spec!r}")
    return label, rest


def run(cmd: list[str], log: Path, threads: int) -> tuple[int, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS=str(threads))
    start = time.perf_counter()
    proc = subprocess.run(cmd, check=False, cwd=ROOT, env=env, capture_output=True, text=True)
    log.write_text(proc.stdout + proc.stderr)
    return proc.returncode, time.perf_counter() - start


def last_error(log: Path) -> str:
    """The last non-empty line of a failed run's log (its one-line error), with table pipes escaped."""
    lines = [line for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []
    return (lines[-1] if lines else "no output").replace("|", "\\|")


def gold_row(metrics: dict) -> dict:
    """``{"overall", <task>...}`` of one evaluation record (``eval/digits_compose_gold[/<task>]``)."""
    return {"overall": metrics.get(f"eval/{GOLD}"), **{t: metrics.get(f"eval/{GOLD}/{t}") for t in TASKS}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--pretrain", action="append", default=[], help="LABEL:ARGS for scripts/pretrain_digits_compose.py (repeatable)")
    ap.add_argument("--pretrain-common", default="", help="arguments for every pretraining")
    ap.add_argument("--base", action="append", default=[], help="LABEL:PATH, an existing base folder to train from (repeatable)")
    ap.add_argument("--base-gold", default="0.3", help="comma-separated overall-gold targets picking each pretraining's snapshots")
    ap.add_argument("--recipe", action="append", default=[], help="experiment name (repeatable)")
    ap.add_argument("--rl-variant", action="append", default=[], help="LABEL:overrides separated by spaces (repeatable; default: the recipe as is)")
    ap.add_argument("--all", action="append", default=[], help="override for every RL run (repeatable)")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"pretrain": {}, "rl": {}}
    lock = threading.Lock()

    def save() -> None:
        with lock:
            (out / "results.json").write_text(json.dumps(results, indent=1))

    def pretrain(label: str, extra: str) -> None:
        folder = out / "pretrain" / label
        cmd = [sys.executable, "scripts/pretrain_digits_compose.py", "--out", str(folder), "--judge", "assets/digits_compose/judge", "--snapshots",
               "--stop-at-gold", "1.1", "--threads", str(args.threads), *shlex.split(args.pretrain_common), *shlex.split(extra)]
        rc, seconds = run(cmd, out / f"pretrain_{label}.log", args.threads)
        meta = json.loads((folder / "metadata.json").read_text()) if (folder / "metadata.json").is_file() else {}
        results["pretrain"][label] = {"args": extra, "returncode": rc, "seconds": round(seconds, 1), "history": meta.get("generator", {}).get("history", [])}
        save()

    with ThreadPoolExecutor(max(1, min(args.jobs, len(args.pretrain)))) as pool:
        list(pool.map(lambda spec: pretrain(*labelled(spec)), args.pretrain))

    bases = dict(labelled(b) for b in args.base)
    for label, rec in results["pretrain"].items():
        for target in (float(x) for x in args.base_gold.split(",")):
            hit = next((h for h in rec["history"] if h[GOLD] >= target), None)
            if hit is not None:
                bases[f"{label}@{hit['step']}"] = str(out / "pretrain" / label / "snapshots" / f"step_{hit['step']:06d}")
    variants = [labelled(v) for v in args.rl_variant] or [("as_is", "")]
    runs = [(f"{b}/{r.removeprefix('digits_compose_')}/{v}", path, r, ov) for b, path in bases.items() for r in args.recipe for v, ov in variants]

    def rl(name: str, path: str, recipe: str, overrides: str) -> None:
        run_dir = out / "rl" / name.replace("/", "__")
        cmd = [sys.executable, "-c", TRAIN, f"experiment={recipe}", f"model.path={path}", *args.all, *shlex.split(overrides),
               f"trainer.output_dir={run_dir}", f"trainer.threads={args.threads}", "trainer.progress=false", "trainer.wandb=disabled"]
        rc, seconds = run(cmd, out / f"rl_{name.replace('/', '__')}.log", args.threads)
        evals = []
        if (run_dir / "metrics.jsonl").is_file():
            for line in (run_dir / "metrics.jsonl").read_text().splitlines():
                r = json.loads(line)
                if r.get("kind") == "eval":
                    evals.append({"step": r["step"], "reward": r.get("eval/digits_compose"), **gold_row(r)})
        error = last_error(out / f"rl_{name.replace('/', '__')}.log") if rc else None
        results["rl"][name] = {"base": path, "recipe": recipe, "overrides": overrides, "returncode": rc, "seconds": round(seconds, 1), "evals": evals,
                               "error": error}
        save()

    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        list(pool.map(lambda a: rl(*a), runs))
    lines = ["| run | steps | overall | " + " | ".join(TASKS) + " | s |", "|---|---:|---|" + "---|" * len(TASKS) + "---:|"]
    for name, r in results["rl"].items():
        if r["returncode"]:
            lines.append(f"| {name} | – | failed (exit {r['returncode']}): {r['error']} |" + " |" * len(TASKS) + f" {r['seconds']:.0f} |")
            continue
        if len(r["evals"]) < 2:
            continue
        a, b = r["evals"][0], r["evals"][-1]
        cells = [f"{a[k]:.3f} → {b[k]:.3f}" if a.get(k) is not None and b.get(k) is not None else "–" for k in ("overall", *TASKS)]
        lines.append(f"| {name} | {b['step']} | " + " | ".join(cells) + f" | {r['seconds']:.0f} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
