"""Deterministic evaluation: fixed held-out seeds, ODE sampling, rewards and the gold metric (the sampling and
scoring path is :class:`diffrl.sampling.evaluator.Evaluator`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

import torch

from diffrl.config import SamplerConfig
from diffrl.sampling.seeding import Stream, derive
from rewards.base import call_reward


def eval_prompts_and_seeds(prompts: list[str], seeds_per_prompt: int, seed: int) -> tuple[list[str], list[int]]:
    """Each prompt × ``seeds_per_prompt``; seeds of stream ``EVAL`` from ``(prompt index, sample index)``,
    disjoint from training seeds."""
    out_prompts, out_seeds = [], []
    for p_idx, prompt in enumerate(prompts):
        for s in range(seeds_per_prompt):
            out_prompts.append(prompt)
            out_seeds.append(derive(seed, Stream.EVAL, p_idx, s))
    return out_prompts, out_seeds


def deterministic_settings(settings: SamplerConfig, prediction_type: str, num_steps: int) -> SamplerConfig:
    """``settings`` turned into the evaluation sampler: the Euler ODE for flow models, DDIM with η = 0 for
    epsilon models, ``num_steps`` steps (image size, shift, guidance and clipping kept).

    With ``settings.eval_stochastic`` the evaluation keeps the rollout's stochastic step (``kind``,
    ``noise_level``) at every one of the ``num_steps`` steps: the policy that stochastic-step RL trains
    (DDPO reports the reward of its own η = 1 samples). The per-sample seeds still fix every draw, so
    repeated evaluations of the same weights give the same images."""
    if settings.eval_stochastic:
        return dataclasses.replace(settings, num_steps=num_steps)
    kind = "ode" if prediction_type == "flow" else "ddim"
    return dataclasses.replace(settings, num_steps=num_steps, kind=kind, noise_level=0.0)


def score_images(images: torch.Tensor, prompts: list[str], metrics: dict, source_images: torch.Tensor | None = None) -> dict[str, float]:
    """``{"eval/<name>": mean}`` of every metric (``name -> callable``, reward protocol) on ``images``,
    each called as it declared (:func:`rewards.base.call_reward`: batch size, uint8 or PIL input, checks),
    and ``{"eval/<name>/<group>": mean}`` for the metrics that group prompts (:func:`group_means`)."""
    scores = per_sample_scores(images, prompts, metrics, source_images)
    return {**{f"eval/{name}": float(values.mean()) for name, values in scores.items()}, **group_means(scores, prompts, metrics)}


def prompt_groups(metric, prompts: list[str]) -> list[str | None] | None:
    """The group of each prompt (e.g. GenEval's task type) as ``metric.groups(prompts)`` gives it, or None when
    the metric does not group prompts (the optional ``groups`` method of the reward protocol)."""
    fn = getattr(metric, "groups", None)
    if fn is None:
        return None
    groups = list(fn(list(prompts)))
    if len(groups) != len(prompts):
        raise ValueError(f"{type(metric).__name__}.groups returned {len(groups)} groups for {len(prompts)} prompts; it must return one group (or None) per prompt")
    return groups


def group_means(scores: dict[str, torch.Tensor], prompts: list[str], metrics: dict) -> dict[str, float]:
    """``{"eval/<name>/<group>": mean over that group's samples}`` for every metric with a ``groups`` method
    (GenEval's per-task-type table: overall = ``eval/<name>``, one row per task type), groups in first-seen
    order; samples whose group is None count in the overall mean only."""
    out: dict[str, float] = {}
    for name, values in scores.items():
        groups = prompt_groups(metrics[name], prompts)
        if groups is None:
            continue
        for group in dict.fromkeys(g for g in groups if g is not None):
            mask = torch.tensor([g == group for g in groups])
            out[f"eval/{name}/{group}"] = float(values[mask].mean())
    return out


def paired_change(before_rows: list[dict], after_rows: list[dict], metrics: list[str]) -> dict[str, dict]:
    """Per-sample change of each metric between two evaluations of the same held-out (prompt, seed) pairs.

    The evaluation seeds are fixed, so each sample after training has a twin before it (the same prompt,
    seed and, with ``sampler.eval_stochastic``, the same noise draws); the paired differences remove the
    between-sample spread that makes two means hard to compare. For each metric present in both:

    - ``mean_change``: mean of ``after − before``; ``stderr``: its standard error (sample std / √n);
    - ``t``: ``mean_change / stderr`` (paired t statistic; |t| > 2 ≈ a change beyond sampling noise);
    - ``improved_fraction`` / ``worsened_fraction``: share of pairs whose score went up / down (ties neither);
    - ``n``: number of pairs.

    Rows are the ``images/eval_step_N.jsonl`` records (``prompt``, ``seed``, one key per metric).

    Raises:
        ValueError: the two evaluations do not cover the same (prompt, seed) pairs.
    """
    def keyed(rows):  # (prompt, seed, k-th occurrence of that pair): duplicates pair up in order
        seen: dict = {}
        out = {}
        for r in rows:
            pair = (r["prompt"], int(r["seed"]))
            seen[pair] = seen.get(pair, -1) + 1
            out[(*pair, seen[pair])] = r
        return out

    a, b = keyed(before_rows), keyed(after_rows)
    if a.keys() != b.keys():
        raise ValueError(
            f"paired_change: the evaluations cover different (prompt, seed) pairs ({len(a)} vs {len(b)} rows); "
            "compare evaluations made with the same eval.seed and eval_seeds_per_prompt"
        )
    out = {}
    for name in metrics:
        if not all(name in r for r in a.values()) or not all(name in r for r in b.values()):
            continue
        d = torch.tensor([b[k][name] - a[k][name] for k in a], dtype=torch.float64)
        n = d.numel()
        stderr = float(d.std(unbiased=True) / n**0.5) if n > 1 else float("nan")
        mean = float(d.mean())
        out[name] = {
            "mean_change": mean, "stderr": stderr,
            "t": mean / stderr if stderr and stderr == stderr and stderr > 0 else float("nan"),
            "improved_fraction": float((d > 0).double().mean()), "worsened_fraction": float((d < 0).double().mean()), "n": n,
        }
    return out


def run_paired_change(run_dir, steps: int, metrics: list[str]) -> dict | None:
    """:func:`paired_change` between a run folder's step-0 and step-``steps`` evaluations
    (``images/eval_step_N.jsonl``), as ``{"steps": [0, steps], <metric>: {…}}``; None when either is missing."""
    from pathlib import Path

    files = [Path(run_dir) / "images" / f"eval_step_{s:06d}.jsonl" for s in (0, steps)]
    if steps <= 0 or not all(f.is_file() for f in files):
        return None
    return {"steps": [0, steps], **paired_change(*(read_jsonl(f) for f in files), metrics)}


def per_sample_scores(images: torch.Tensor, prompts: list[str], metrics: dict[str, Callable], source_images: torch.Tensor | None = None,
                      metadata=None) -> dict[str, torch.Tensor]:
    """``{name: float [B]}``: each eval metric (reward protocol) on every image.

    The value of metric ``name`` is its output under ``name`` (else its first output), the same choice as
    :func:`diffrl.sampling.evaluation.score_images`, whose means are ``scores[name].mean()``. An editing
    run passes ``source_images`` (uint8 ``[B, 3, H, W]``) for the metrics that declare ``needs_source``; ``metadata``
    (one row per sample, e.g. a prompt set's GenEval rows) reaches every metric as the reward protocol's ``metadata``.
    """
    return {name: main_score(name, call_reward(name, fn, images, prompts, metadata, source_images)) for name, fn in metrics.items()}


def main_score(name: str, result: dict[str, torch.Tensor]) -> torch.Tensor:
    """The value of eval metric ``name`` in its reward's output: ``result[name]``, else the first output
    (float, CPU)."""
    return result.get(name, next(iter(result.values()))).detach().float().cpu()


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a JSON-lines file (``metrics.jsonl``, ``images/eval_step_<N>.jsonl``)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
