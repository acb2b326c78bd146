"""``diffrl plan`` of every published recipe (configs/experiment, the ones that name a Hub checkpoint) on 1, 8 and
32 H100-80GB: peak per GPU, whether it fits, the step's seconds and images/s at the H200-measured MFU, and the
cheapest change that fits when it does not (issue 35). Writes a markdown table for docs/scaling.md.

    PYTHONPATH=. python benchmarks/parity/plan_recipes.py --out benchmarks/results/plan_recipes.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from diffrl.tools.plan import plan  # noqa: E402

RECIPES = ["sd35m_pickscore_flow_grpo", "sd35m_pickscore_flow_grpo_fast", "sd35m_geneval_flow_grpo", "sd35m_ocr_flow_grpo", "sd35m_multi_reward_nft",
           "sd35m_geneval_awm", "flux_hpsv2_dance_grpo", "flux_kontext_counting_flow_grpo", "qwen_image_ocr_lora_flow_grpo", "wan21_1_3b_ocr_flow_grpo"]
# a recipe that refuses to compose without its records gets the 4 tiny ones of +shrink=tiny (32-px sources: where the
# family sizes its conditioning from the records, those rows may understate the real dataset's)
EXTRA = {"flux_kontext_counting_flow_grpo": [f"trainer.prompts={ROOT / 'assets' / 'tiny_records' / 'counting_edit'}"]}


def row(r: dict) -> str:
    rec = r.get("recommendation")
    fix = "" if r["fits"] else (f"{rec['change']}: `{' '.join(rec['overrides'])}`" + ("" if rec["gpus"] == r["gpus"] else f" on {rec['gpus']} GPUs")
                                + f" → {rec['peak_gib']:.1f} GiB" if rec else "nothing tried fits")
    return (f"| {r['recipe']} | {r['gpus']} | {r['peak_gib']:.1f} ({r['peak_phase']}) | {'yes' if r['fits'] else '**no**'} | {r['step_s']:.0f} | "
            f"{r['images_per_s']:.2f} | {fix} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--gpus", default="1,8,32")
    p.add_argument("--recipes", default=",".join(RECIPES))
    args = p.parse_args(argv)
    results = []
    lines = ["| recipe | H100s | peak GiB per GPU (phase) | fits 80 GB | s per RL step | images/s | cheapest change that fits |", "|---|---|---|---|---|---|---|"]
    for name in args.recipes.split(","):
        for n in map(int, args.gpus.split(",")):
            try:
                r = plan([f"experiment={name}", *EXTRA.get(name, [])], gpus=n, gpu="h100")
            except Exception as exc:  # noqa: BLE001 - one recipe's failure is a row, not the end of the table
                print(f"| {name} | {n} | {exc} |", flush=True)
                lines.append(f"| {name} | {n} | not planned: {exc} | | | | |")
                continue
            results.append(r)
            del r["overrides"]
            lines.append(row(r))
            print(lines[-1], flush=True)
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
