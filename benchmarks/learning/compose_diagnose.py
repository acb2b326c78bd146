"""Why a digits-compose run fails where it fails: the judge's failure reasons, object counts and how often the
training reward reads the same digit and colour as the judge, per task type, before and after each run.

    python benchmarks/learning/compose_diagnose.py --run nft=outputs/compose_nft --run flow_grpo=outputs/compose_flow_grpo \\
        --run flow_grpo_fast=outputs/compose_fast --out benchmarks/results/digits_compose

Reads each run folder's first and last evaluation grids back as images (``Run.grid_images``: exact, the first
held-out seed of each of the 60 prompts, so 10 canvases per task type) and, for every canvas:

- the judge's detections and GenEval's verdict with its reasons (``rewards.geneval.check``), sorted into
  *missing digit*, *too many* (counting's exclude clause), *wrong colour* and *wrong position*;
- the number of objects the judge finds, and whether all four slots are filled;
- **reading agreement**: for every object the judge finds whose box centre lies in a slot, whether the reward's
  classifier (``digits_compose``, reading that slot) gives it the same digit and the same colour.

Writes ``diagnosis.md`` and ``diagnosis.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch

from diffrl.tools.analysis import load_run
from rewards.digits.compose import SLOT, TASKS, DigitsComposeReward, parse, slot_crops
from rewards.digits.compose_judge import DigitsComposeGold, detect
from rewards.digits.data import COLOUR_NAMES, DIGIT_WORDS
from rewards.geneval import check

KINDS = ("missing", "too_many", "wrong_colour", "wrong_position")
"""failure kinds of :func:`reason_kinds`, in the table's order"""


def reason_kinds(reasons: list[str]) -> set[str]:
    """GenEval's failure reasons → :data:`KINDS` (``"expected two < 3, found 4"`` → ``too_many``)."""
    kinds = set()
    for r in reasons:
        if "found colours" in r:
            kinds.add("wrong_colour")
        elif "its target" in r or "no target" in r:
            kinds.add("wrong_position")
        elif " < " in r:
            kinds.add("too_many")
        else:
            kinds.add("missing")
    return kinds


@torch.no_grad()
def diagnose(images: torch.Tensor, prompts: list[str], judge: DigitsComposeGold, reward: DigitsComposeReward) -> dict:
    """Per task type: canvases, gold, mean objects, four-filled share, failure kinds, reading agreement."""
    x = images.float() / 255.0
    d_logits, c_logits = reward.model(slot_crops(x).flatten(0, 1))
    digit, colour = d_logits.argmax(-1).view(-1, 4), c_logits.argmax(-1).view(-1, 4)
    out: dict = {t: {"canvases": 0, "gold": 0, "objects": 0, "four_filled": 0, "failures": Counter(), "read": 0, "same_digit": 0, "same_colour": 0} for t in TASKS}
    for i, prompt in enumerate(prompts):
        meta = parse(prompt)
        row = out[meta["tag"]]
        found = detect(judge.model, x[i])
        _, ok, reasons = check(found, meta)
        objects = [(name, o) for name, objs in found.items() for o in objs]
        row["canvases"] += 1
        row["gold"] += int(ok)
        row["objects"] += len(objects)
        row["four_filled"] += int(len(objects) >= 4)
        row["failures"].update(reason_kinds(reasons) if not ok else [])
        for name, o in objects:
            cx, cy = (o["box"][0] + o["box"][2]) / 2, (o["box"][1] + o["box"][3]) / 2
            slot = 2 * int(cy >= SLOT) + int(cx >= SLOT)
            row["read"] += 1
            row["same_digit"] += int(DIGIT_WORDS[int(digit[i, slot])] == name)
            row["same_colour"] += int(COLOUR_NAMES[int(colour[i, slot])] == o["color"])
    return {t: {**r, "failures": dict(r["failures"])} for t, r in out.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, help="NAME=RUN_DIR (repeatable)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    judge, reward = DigitsComposeGold(), DigitsComposeReward(rule="soft")
    results = {}
    for spec in args.run:
        name, _, path = spec.partition("=")
        run = load_run(path)
        steps = run.eval_steps()
        if "base" not in results:
            images, rows = run.grid_images(steps[0])
            results["base"] = {"step": steps[0], "types": diagnose(images, rows["prompt"].tolist(), judge, reward)}
        images, rows = run.grid_images(steps[-1])
        results[name] = {"step": steps[-1], "types": diagnose(images, rows["prompt"].tolist(), judge, reward)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diagnosis.json").write_text(json.dumps(results, indent=1))
    lines = ["| model | task type | gold | objects / canvas | four slots filled | failures (missing, too many, wrong colour, wrong position) | reward reads the judge's digit | … and colour |",
             "|---|---|---:|---:|---:|---|---:|---:|"]
    for model, res in results.items():
        for t, r in res["types"].items():
            n, f = r["canvases"], r["failures"]
            fails = ", ".join(str(f.get(k, 0)) for k in KINDS)
            lines.append(f"| {model} | {t} | {r['gold']}/{n} | {r['objects'] / n:.1f} | {r['four_filled']}/{n} | {fails} | "
                         f"{r['same_digit'] / max(r['read'], 1):.0%} | {r['same_colour'] / max(r['read'], 1):.0%} |")
    (out / "diagnosis.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
