"""One evaluation path: the trainer's evaluations, ``diffrl sample`` / ``diffrl eval`` and the analysis helpers all
sample and score through :class:`Evaluator`.

An evaluation samples (prompt, seed) pairs deterministically (``sampler.eval_num_steps`` steps, the ODE or DDIM
η = 0 unless ``sampler.eval_stochastic``; :func:`~diffrl.sampling.evaluation.deterministic_settings`) and scores
every image with every metric as the reward protocol declares it (:func:`rewards.base.call_reward`). Sampling goes
through a request batch (:func:`~diffrl.sampling.request.sample_batch`) handed to a ``generate`` function: a worker
group's ``generate_sequences`` (the trainer, the CLI) or :func:`local_generate` on an adapter (the notebooks).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tensordict import TensorDict

from diffrl.config import SamplerConfig
from diffrl.sampling.distribution import FeatureSpace, distribution_metrics
from diffrl.sampling.evaluation import group_means, main_score
from diffrl.sampling.request import SampleRequest, run_request, sample_batch
from pipelines.base import split_prompts
from rewards.base import call_reward

Generate = Callable[[TensorDict], TensorDict]


@dataclass
class EvalResult:
    """One evaluation's samples and scores.

    Attributes:
        images: uint8 ``[N, 3, H, W]`` (``[N, F, 3, H, W]`` for video); prompts, seeds: one per image.
        sources: an editing model's uint8 source images, else None.
        outputs: every output of every metric per image (``{output key: [N] floats}``: the CLI's sample files).
        scores: ``{metric name: float [N]}``, each metric's main value (:func:`~diffrl.sampling.evaluation.main_score`).
        metrics: ``eval/<name>`` means, ``eval/<name>/<group>`` for metrics that group prompts, the distribution
            metrics when the evaluator computes them, and ``eval/seconds`` (sampling and scoring).
    """

    images: torch.Tensor
    prompts: list[str]
    seeds: list[int]
    sources: torch.Tensor | None
    outputs: dict[str, list[float]] = field(default_factory=dict)
    scores: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


class Evaluator:
    """Deterministic samples of (prompt, seed) pairs scored by ``metrics`` (``name → reward callable``).

    Args:
        metrics: the eval metrics (rewards, the gold metric, judges).
        eval_num_steps: deterministic sampling steps; None samples with the run's own (stochastic) sampler instead.
        micro_batch_size: samples per denoiser forward (None: the whole batch).
        distribution: also the distribution metrics (diversity, near-duplicates, Fréchet with ``feature_space``).
        feature_space: the feature space of the distribution metrics (None: pixels only).
    """

    def __init__(self, metrics: dict, *, eval_num_steps: int | None, micro_batch_size: int | None = None, distribution: bool = False,
                 feature_space: FeatureSpace | None = None):
        self.metrics = metrics
        self.eval_num_steps = None if eval_num_steps is None else int(eval_num_steps)
        self.micro_batch_size = int(micro_batch_size) if micro_batch_size else None
        self.distribution, self.feature_space = distribution, feature_space

    def request(self, records: list, seeds: list[int], policy: str = "current") -> TensorDict:
        """The request batch of ``records`` (prompt strings, or ``EditPrompt`` records whose sources go along)."""
        texts, sources = split_prompts(records)
        request = SampleRequest(policy=policy, micro_batch_size=self.micro_batch_size, eval_num_steps=self.eval_num_steps)
        return sample_batch(texts, seeds, request, source_images=sources)

    def score(self, images: torch.Tensor, records: list, seeds: list[int], metadata: list | None = None) -> EvalResult:
        """Score ``images`` (one per record) with every metric; ``metadata`` (one row per sample) reaches every metric."""
        texts, sources = split_prompts(records)
        result = EvalResult(images=images, prompts=texts, seeds=list(seeds), sources=sources)
        for name, fn in self.metrics.items():
            out = call_reward(name, fn, images, texts, metadata, sources)
            result.outputs.update({key: value.detach().float().cpu().tolist() for key, value in out.items()})
            result.scores[name] = main_score(name, out)
        result.metrics = {f"eval/{name}": float(values.mean()) for name, values in result.scores.items()}
        result.metrics.update(group_means(result.scores, texts, self.metrics))  # per task type, for rewards with groups()
        if self.distribution:
            result.metrics.update(distribution_metrics(images, texts, self.feature_space))  # diversity, near-duplicates, Fréchet
        return result

    def run(self, generate: Generate, records: list, seeds: list[int], *, policy: str = "current", metadata: list | None = None) -> EvalResult:
        """Sample ``records`` × ``seeds`` with ``generate`` (a worker group's ``generate_sequences`` or
        :func:`local_generate`) and score them."""
        start = time.perf_counter()
        images = generate(self.request(records, seeds, policy))["images"]
        result = self.score(images, records, seeds, metadata)
        result.metrics["eval/seconds"] = time.perf_counter() - start
        return result


def local_generate(adapter, settings: SamplerConfig) -> Generate:
    """A ``generate`` function sampling request batches with ``adapter`` in this process (``settings``: the run's
    sampler; an evaluation request makes it deterministic)."""

    def generate(batch: TensorDict) -> TensorDict:
        with torch.no_grad():
            return run_request(adapter, settings, batch)

    return generate


def evaluate(adapter, prompts: list, *, seeds: list[int], num_steps: int, guidance_scale: float, metrics: dict, micro_batch_size: int | None = None,
             height: int | None = None, width: int | None = None) -> tuple[dict[str, float], torch.Tensor]:
    """Sample ``prompts`` (strings, or ``EditPrompt`` records of an editing model) deterministically with ``adapter``
    at ``height × width`` (default: the sampler's) and average each metric (per group too): the
    :class:`Evaluator` on a default sampler of ``num_steps`` steps and ``guidance_scale``.

    Returns:
        ``({"eval/<name>": mean, "eval/<name>/<group>": …}, images uint8 [N, 3, H, W])``.
    """
    size = {k: v for k, v in (("height", height), ("width", width)) if v is not None}
    settings = SamplerConfig(num_steps=num_steps, guidance_scale=guidance_scale, **size)
    result = Evaluator(metrics, eval_num_steps=num_steps, micro_batch_size=micro_batch_size).run(local_generate(adapter, settings), prompts, seeds)
    return {k: v for k, v in result.metrics.items() if k != "eval/seconds"}, result.images


__all__ = ["EvalResult", "Evaluator", "evaluate", "local_generate"]
