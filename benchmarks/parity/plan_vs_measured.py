"""``diffrl plan`` against the landed H200 measurements (issue 35): for every ``benchmarks/results/gpu_scale_*_h200.json``
that records a training run, plan the same configuration on a CPU and compare the peak memory (±15 % asked)
and the step time given the MFU measured in that run (±20 % asked).

The configuration of a ``gpu_scale.py`` run (its ``settings``: shape, images, group, micro-batch, steps, CFG,
SDE window, LoRA rank/targets, activation checkpointing, CFG mode, decode chunk, Qwen-Image prompt length) is
written as recipe overrides (:func:`overrides_of`); the planner then composes and steps it as ``diffrl train``
would. The measured step is ``rollout_s + train_s`` of the same variant; its MFU is the one the plan is given. The runs
held 2-layer stand-in text encoders (dropped after caching the prompts), so the comparison plans those
(:func:`stand_in_text`); a run with the published encoders (``pipelines.shapes.TEXT_ENCODERS``) is still to be measured.

    PYTHONPATH=. python benchmarks/parity/plan_vs_measured.py --out benchmarks/results/plan_vs_measured.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import glob
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "speed"))

import gpu_scale  # noqa: E402  (benchmarks/speed/gpu_scale.py: the measured shapes' settings)

from diffrl.engine.trace import shape_trace  # noqa: E402
from diffrl.tools.plan import GiB, per_rank, plan_config, trace_recipe  # noqa: E402
from pipelines import build_adapter  # noqa: E402
from pipelines.base import family_class, known_families  # noqa: E402
from pipelines.shapes import PARENT_SHAPES, SHAPES  # noqa: E402

MODEL_GROUP = {"sd3": "sd3_tiny", "flux": "flux_tiny", "qwen_image": "qwen_image_tiny", "wan": "wan_tiny"}


def measurements(pattern: str = str(ROOT / "benchmarks/results/gpu_scale_*_h200.json"), variants: tuple[str, ...] = ()) -> list[dict]:
    """One row per file with a training measurement: its first variant without fused or CUDA-graph rollouts
    (eager when measured), the settings, the peak and the step's seconds and MFUs. With ``variants``: a row for each
    named variant the file measured with training (FP8 rollouts and full fine-tuning included, see :func:`variant_overrides`)."""
    rows = []
    for path in sorted(glob.glob(pattern)):
        d = json.loads(Path(path).read_text())
        s = d["settings"]
        if s.get("rollout_only"):
            continue
        for label in sorted(d["variants"], key=lambda v: v != "eager"):
            v = d["variants"][label]
            if variants:
                if label not in variants or "train_s" not in v:
                    continue
            elif "fuse" in label or "graphs" in label or "train_s" not in v or "cudagraphs" in Path(path).name:
                continue
            rows.append({"file": Path(path).name, "variant": label, "settings": s, "shape": d["shape"], "peak_gib": v["peak_gb"],
                         "step_s": v["rollout_s"] + v["train_s"], "rollout_s": v["rollout_s"], "train_s": v["train_s"],
                         "rollout_mfu": v["rollout_mfu_executed"], "train_mfu": v["train_mfu_executed"], "peak_tflops": d["peak_tflops"]})
            if not variants:
                break
    return rows


def variant_overrides(label: str) -> list[str]:
    """What a ``gpu_scale.py`` variant label changes in the recipe: ``fp8`` samples with FP8 linears
    (``model.rollout_precision=fp8``), ``fuse`` folds LoRA for the rollout, ``full`` trains every weight (LoRA rank 0,
    fp32 master weights)."""
    out = []
    if "fp8" in label:
        out.append("model.rollout_precision=fp8")
    elif "fuse" in label:
        out.append("model.fuse_lora_rollout=true")
    if "full" in label:
        out.append("model.lora.rank=0")
    return out


def overrides_of(s: dict, prompts_file: str | None) -> list[str]:
    """A ``gpu_scale.py`` run's settings as recipe overrides."""
    setting = gpu_scale.SETTINGS[s["shape"]]
    family = setting["family"]
    out = [
        f"model={MODEL_GROUP[family]}", f"+model.options.shape={s['shape']}", "model.dtype=bfloat16", "+model.options.drop_text_encoders=true",
        f"+model.options.decode_chunk={s['decode_chunk']}", f"model.lora.rank={s['rank']}", f"model.lora.alpha={s['alpha']}",
        f"model.activation_checkpointing={'true' if s['ckpt_every'] else 'false'}", f"model.checkpoint_every={max(1, s['ckpt_every'])}",
        f"sampler.num_steps={s['steps']}", f"sampler.guidance_scale={s['cfg']}", f"sampler.height={setting['height']}", f"sampler.width={setting['width']}",
        "sampler.noise_level=0.7", f"sampler.window={'fast' if s['window'] else 'all'}", f"sampler.window_size={s['window'] or 2}",
        f"sampler.window_range=[{s['window_range'][0]},{s['window_range'][1]}]", "algorithm=flow_grpo", f"algorithm.micro_batch_size={s['micro_batch']}",
        f"trainer.prompts_per_step={s['batch'] // s['group']}", f"trainer.group_size={s['group']}", "reward=digits",
    ]
    lora_targets = _family_targets(family) + (list(setting["mlp"]) if s.get("mlp") else [])
    out.append(f"model.lora.target_modules=[{','.join(lora_targets)}]")
    if family != "flux":
        out.append(f"+model.options.cfg_mode={s.get('cfg_mode') or 'split'}")
    if "frames" in setting:
        out.append(f"+model.options.num_frames={s.get('frames') or setting['frames']}")
    if s.get("rollout_micro"):
        out.append(f"sampler.micro_batch_size={s['rollout_micro']}")
    if prompts_file:
        out.append(f"trainer.prompts={prompts_file}")
    return out


def _family_targets(family: str) -> list[str]:
    return list(family_class(family).lora_target_modules)


def prompts_for(s: dict, folder: Path) -> str | None:
    """Qwen-Image runs used prompts of exactly ``n_text`` tokens: write the same prompts to a file."""
    if not s.get("n_text"):
        return None
    family = gpu_scale.SETTINGS[s["shape"]]["family"]
    with shape_trace():
        adapter = build_adapter(family, shape=s["shape"], dtype="bfloat16", device="cpu", drop_text_encoders=True)
        prompts = gpu_scale.prompts_of_length(adapter, s["batch"] // s["group"], s["n_text"])
    path = folder / f"{s['shape']}_{s['n_text']}.txt"
    path.write_text("\n".join(prompts) + "\n")
    return str(path)


@contextlib.contextmanager
def stand_in_text(shape: str):
    """The landed H200 runs built their published shapes with 2-layer stand-in text encoders (before issue 56): plan what
    they held (``Shape.stand_in_text``; an editing shape builds through its parent's)."""
    known_families()
    names = {shape, PARENT_SHAPES.get(shape, shape)}
    saved = {n: SHAPES[n] for n in names}
    try:
        for n in names:
            SHAPES[n] = dataclasses.replace(saved[n], stand_in_text=True)
        yield
    finally:
        SHAPES.update(saved)


def compare(row: dict, folder: Path, published_text: bool = False) -> dict:
    """Plan ``row``'s configuration (with its variant's overrides) and compare; ``published_text``: the run held the
    published text encoders (runs from 2026-12-07 on), else the 2-layer stand-ins of the earlier runs."""
    s = row["settings"]
    start = time.perf_counter()
    with contextlib.nullcontext() if published_text else stand_in_text(s["shape"]):
        cfg, shape = plan_config(overrides_of(s, prompts_for(s, folder)) + variant_overrides(row["variant"]), 1)
        tr = trace_recipe(cfg, 1)
    rank = per_rank(tr, cfg, 1)
    peak = row["peak_tflops"] * 1e12
    rollout_s = tr.rollout_flops / (row["rollout_mfu"] * peak)
    train_s = tr.train_flops / (row["train_mfu"] * peak)
    plan_peak = rank["peak_bytes"] / GiB
    return {
        "file": row["file"], "variant": row["variant"], "shape": shape, "measured_peak_gib": row["peak_gib"], "plan_peak_gib": round(plan_peak, 2),
        "peak_error": plan_peak / row["peak_gib"] - 1, "measured_step_s": row["step_s"], "plan_step_s": rollout_s + train_s,
        "step_error": (rollout_s + train_s) / row["step_s"] - 1, "plan_phases_gib": {k: round(v / GiB, 2) for k, v in rank["phases"].items()},
        "plan_seconds": time.perf_counter() - start,
    }


def table(results: list[dict]) -> str:
    lines = ["| run (H200 JSON, variant) | measured peak GiB | plan GiB | error | measured rollout+train s | plan s (same MFU) | error |", "|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['file']} ({r['variant']}) | {r['measured_peak_gib']:.2f} | {r['plan_peak_gib']:.2f} | {r['peak_error']:+.1%} | "
                     f"{r['measured_step_s']:.2f} | {r['plan_step_s']:.2f} | {r['step_error']:+.1%} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--files", default=None, help="a glob of gpu_scale JSONs (default: every landed H200 run)")
    p.add_argument("--variants", default="", help="comma list of variant labels to compare (default: each file's first plain variant)")
    p.add_argument("--published-text", action="store_true", help="the runs held the published text encoders (from 2026-12-07 on)")
    args = p.parse_args(argv)
    results = []
    rows = measurements(*([args.files] if args.files else []), variants=tuple(filter(None, args.variants.split(","))))
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            results.append(compare(row, Path(tmp), published_text=args.published_text))
            print(json.dumps(results[-1]), flush=True)
    print(table(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
