"""What a run reports beside its metrics: each step's throughput and MFU, and the ``summary.json`` at its end."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from diffrl import checkpoint
from diffrl.algorithms import Algorithm
from diffrl.recipes import Config
from diffrl.sampling.distribution import collapse_summary, fidelity_headline
from diffrl.sampling.evaluation import run_paired_change


def throughput(cfg: Config | DictConfig, algorithm: Algorithm, flops, trained_steps: int, world_size: int, sampling_devices: int, record: dict,
               times: dict) -> dict:
    """images/s per sampling device of the rollout and, where the device's peak is known (``flops``: the workers'
    ``DiffusionFlopsCounter``, or None), MFU of the rollout and training passes (analytic FLOPs of
    ``diffrl.engine.flops``; forward-only passes count 1/3 of a training pass).

    Args:
        trained_steps: SDE steps trained per trajectory (the training window's size).
        world_size: the actor ranks (training); sampling_devices: the ranks or replicas that sample.
        record: the step's training record (the algorithm reads what it trained from it); times: its phase seconds.
    """
    s, t = cfg.sampler, cfg.trainer
    n = t.prompts_per_step * t.group_size
    out = {}
    if "time/rollout" in times:
        out["perf/images_per_second_per_worker"] = n / times["time/rollout"] / sampling_devices
    if flops is None:
        return out
    if "time/rollout" in times:
        mfu = flops.mfu(flops.rollout_flops(n, s.num_steps, s.guidance_scale), times["time/rollout"], sampling_devices)
        if mfu is not None:
            out["perf/mfu_rollout"] = mfu
    units, extra = algorithm.train_forwards(record, trained_steps)
    mfu = flops.mfu(flops.train_flops(units, 1, s.guidance_scale, extra) * algorithm.config.epochs, times["time/train"], world_size)
    if mfu is not None:
        out["perf/mfu_train"] = mfu
    return out


def run_summary(cfg: Config | DictConfig, output_dir: Path, reward_weights: dict[str, float], eval_metrics: list[str], gold_name: str | None,
                judge_names: list[str], before: dict, after: dict, wall: float, steps: int, *, selected: dict | None = None,
                stopped_early: dict | None = None, fidelity_name: str | None = None) -> dict:
    """The run's ``summary.json``: the weighted reward and gold before and after, the paired per-sample changes of every
    eval metric, what the reward misses (``collapse_summary``), the fidelity headline (``reward.fidelity``: :func:`fidelity_headline`), skipped non-finite steps, the selected checkpoint and an
    early stop."""
    reward_keys = [f"eval/{name}" for name in reward_weights]
    summary = {
        "experiment": cfg.experiment,
        "steps": steps,
        "wall_seconds": wall,
        "reward_before": sum(before[k] * w for k, w in zip(reward_keys, reward_weights.values())),
        "reward_after": sum(after[k] * w for k, w in zip(reward_keys, reward_weights.values())),
        "eval_before": before,
        "eval_after": after,
        "output_dir": str(output_dir),
        "checkpoint": str(checkpoint.list_checkpoints(output_dir / "checkpoints")[-1]),
    }
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary["skipped_nonfinite"] = sum(r.get("skipped_nonfinite", 0) for r in records if r.get("kind") == "train")
    if gold_name:
        summary["gold_accuracy_before"] = before[f"eval/{gold_name}"]
        summary["gold_accuracy_after"] = after[f"eval/{gold_name}"]
    # the same held-out (prompt, seed) pairs before and after: per-sample paired changes of every metric
    paired = run_paired_change(output_dir, steps, eval_metrics)
    if paired is not None:
        summary["paired_change"] = paired
    summary.update(collapse_summary(before, after, output_dir, steps, gold_name, judge_names))
    if fidelity_name:
        summary["fidelity"] = fidelity_headline([r for r in records if r.get("kind") == "eval"], fidelity_name)
    if selected is not None:
        summary["selected"] = selected
    if stopped_early:
        summary["stopped_early"] = stopped_early
    return summary


__all__ = ["run_summary", "throughput"]
