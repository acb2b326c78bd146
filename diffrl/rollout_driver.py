"""Where an RL step's scored trajectories come from: sampled now on the actor ranks or the rollout replicas
(optionally in chunks whose rewards overlap the next chunk's sampling), or collected from requests sent ahead to
the replicas (bounded staleness); trajectories of another policy than the trained one (stale replica weights,
FP8 rollouts) get the trained policy marked as the proximal policy of the loss's truncated importance weights.
Each step's request (:func:`rollout_request`) carries its prompts, per-sample seeds and the algorithm's plan for
the training window's masks (``diffrl.sampling.schedules.build_window``, :func:`window_masks`)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch
from tensordict import TensorDict

from diffrl.algorithms import Algorithm, RunContext
from diffrl.data import sample_metadata
from diffrl.distributed import WorkerGroup
from diffrl.distributed.rollout import RolloutReplicas
from diffrl.sampling.request import sample_batch
from diffrl.sampling.schedules import TrainingWindow
from diffrl.sampling.seeding import Stream, derive
from pipelines.base import split_prompts
from rewards.base import score

T = TypeVar("T")
R = TypeVar("R")


def window_masks(window: TrainingWindow, step: int):
    """The training window's masks of RL step ``step``; a step ahead of the window (an off-policy rollout sent early)
    gets them from a copy advanced to it (the window moves deterministically)."""
    if step > window.count:
        window = copy.deepcopy(window)
        for _ in range(step - window.count):
            window.advance()
    return window.masks(step)


def rollout_request(run: RunContext, algorithm: Algorithm, step_prompts: list, masks, step: int) -> TensorDict:
    """RL step ``step``'s rollout request: per-sample seeds (stream ``ROLLOUT`` of ``run.seed``), groups of
    ``trainer.group_size`` (``run.batch``), the prompts and the algorithm's :class:`~diffrl.algorithms.RolloutPlan` (for
    the window's ``masks``) with its objective's declared ``record_means`` (``Algorithm.rollout_request``) as non-tensor
    flags; the sampler's micro-batch and initial-noise settings from ``run.sampler``."""
    prompts, sources = split_prompts(step_prompts)
    seed, G, sampler = run.seed, run.batch.group_size, run.sampler
    request = algorithm.rollout_request(masks, int(sampler.micro_batch_size) if sampler.micro_batch_size else None)
    return sample_batch(
        [p for p in prompts for _ in range(G)], [derive(seed, Stream.ROLLOUT, step, j, s) for j in range(len(prompts)) for s in range(G)], request,
        group_id=torch.arange(len(prompts)).repeat_interleave(G), source_images=None if sources is None else sources.repeat_interleave(G, dim=0),
        init_seeds=[derive(seed, Stream.INITIAL_NOISE, step, j) for j in range(len(prompts)) for _ in range(G)] if sampler.same_initial_noise else None,
    )


def low_precision_rollouts(rollout_precision: str, algorithm: Algorithm) -> bool:
    """Whether the rollouts sample another policy than the trained one (``model.rollout_precision`` other than ``model``:
    FP8) that the objective corrects by truncated importance weights (its declared ``spec.corrects_off_policy``); the
    driver then marks the trained policy as the proximal one (:meth:`RolloutDriver.mark_proximal`)."""
    return rollout_precision != "model" and algorithm.spec.corrects_off_policy


def sources_of(traj: TensorDict) -> torch.Tensor | None:
    """The trajectories' source images (an editing run), else ``None``."""
    return traj["source_images"] if "source_images" in traj.keys() else None


def sample_while_scoring(generate: Callable[[int], T], chunks: int, score_fn: Callable[[T], R]) -> tuple[list[T], list[R], float, float]:
    """Sample ``chunks`` chunks in order on this thread (``generate(c)``, the GPU's work) while one background thread
    scores each finished chunk (``score_fn(part)``: a reward on the CPU cores or a remote server), so chunk ``c``'s
    reward overlaps chunk ``c + 1``'s sampling and only the last chunk's scoring is left after sampling ends.

    Returns ``(parts, results, sampling_seconds, wait_seconds)``: the chunks and their scores in order, the seconds
    spent sampling, and the seconds waited after sampling for the scores still in flight. A scoring error surfaces
    here, after the chunks in flight finish; the ones not started are cancelled."""
    parts, futures, sampling = [], [], 0.0
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="diffrl-reward") as pool:
        try:
            for c in range(chunks):
                start = time.perf_counter()
                part = generate(c)
                sampling += time.perf_counter() - start
                parts.append(part)
                futures.append(pool.submit(score_fn, part))
            start = time.perf_counter()
            results = [f.result() for f in futures]
            wait = time.perf_counter() - start
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    return parts, results, sampling, wait


class RolloutDriver:
    """The trainer's source of scored trajectories.

    Args:
        algorithm: the run's algorithm (which steps need a rollout, optimizer steps per RL step, its objective's spec).
        workers: the actor worker group; replicas: the rollout replicas (None: the actor ranks sample).
        rewards: ``name → (reward, weight)``; prompt_metadata: the prompt set's per-prompt rows.
        request_fn: RL step → its rollout request (``Trainer.rollout_request``).
        steps: ``trainer.steps``; max_staleness: ``distributed.max_staleness``; async_chunks: ``reward.async_chunks``.
        rollout_precision: ``model.rollout_precision``: other than ``model`` (FP8), the rollouts sample another policy,
            which the objective corrects (``spec.corrects_off_policy``; ``distributed.checks.check_objective`` refuses one that does not).
    """

    def __init__(self, algorithm: Algorithm, workers: WorkerGroup, replicas: RolloutReplicas | None, rewards: dict, prompt_metadata,
                 request_fn: Callable[[int], TensorDict], *, steps: int, max_staleness: int, async_chunks: int, rollout_precision: str):
        self.algorithm, self.workers, self.replicas = algorithm, workers, replicas
        self.rewards, self.prompt_metadata, self.request_fn = rewards, prompt_metadata, request_fn
        self.steps, self.max_staleness, self.async_chunks = steps, max_staleness, async_chunks
        self.low_precision_rollouts = low_precision_rollouts(rollout_precision, algorithm)
        self.start(0)

    def start(self, step: int) -> None:
        """Begin (or resume) at RL step ``step`` with no request in flight."""
        self._rollout_queue: dict = {}
        self._next_rollout = step

    def rollouts(self, step: int, times: dict) -> tuple[TensorDict, dict[str, torch.Tensor], dict]:
        """Step ``step``'s trajectories, their scores and the record's rollout entries (rewards' means, the behaviour
        weights' version and staleness with replicas)."""
        if self.replicas is not None and self.max_staleness:
            traj, scores = self.off_policy_rollout(step, times)
        else:
            traj, scores = self.rollout_and_score(step, times)
        rewards = scores["rewards"]
        record = {"reward_mean": rewards.mean().item(), "reward_std": rewards.std(unbiased=False).item()}
        for key, value in scores.items():
            if key.startswith("reward/"):
                record[f"{key}_mean"] = value.mean().item()
        if self.replicas is not None:
            record.update(self.behaviour_versions(traj, step, times))
        elif self.low_precision_rollouts:
            self.mark_proximal(traj, times)  # FP8 rollouts: the behaviour policy is the FP8 one
        return traj, scores, record

    def rollout_and_score(self, step: int, times: dict) -> tuple[TensorDict, dict[str, torch.Tensor]]:
        """Sample the step's rollouts and score them: ``(trajectories, scores)`` (``rewards.base.score``).

        With ``reward.async_chunks = C > 1`` the request is cut into ``C`` chunks of whole prompt groups; each
        chunk's images are scored in a background thread while the next chunk is sampled, so reward time
        (a remote server, a reward model) hides behind sampling. Samples are seeded per sample and scores are
        per sample, so the result equals ``C = 1`` (bit for bit when ``sampler.micro_batch_size`` divides the
        chunk). A reward error surfaces here, after the chunks in flight finish; nothing is trained.

        Sets ``time/rollout`` (sampling), ``time/reward`` (scoring, summed over chunks) and
        ``time/reward_wait`` (sampling done, waiting for the last scores) in ``times``.
        """
        request = self.request_fn(step)
        chunks = self.async_chunks
        metadata = {"step": step}

        def timed_score(traj: TensorDict) -> tuple[dict, float]:
            begin = time.perf_counter()
            texts = list(traj.get("prompts").tolist())
            result = score(self.rewards, traj["images"], texts, sample_metadata(texts, self.prompt_metadata, **metadata), sources_of(traj))
            return result, time.perf_counter() - begin

        generate = self.replicas.generate_sequences if self.replicas is not None else self.workers.generate_sequences
        if chunks == 1:
            start = time.perf_counter()
            traj = generate(request)
            times["time/rollout"] = time.perf_counter() - start
            scores, times["time/reward"] = timed_score(traj)
            return traj, scores
        size = request.batch_size[0] // chunks
        parts, results, sampling, wait = sample_while_scoring(lambda c: generate(request[c * size : (c + 1) * size]), chunks, timed_score)
        times["time/reward_wait"] = wait
        times["time/rollout"] = sampling
        times["time/reward"] = sum(seconds for _, seconds in results)
        traj = torch.cat(parts, dim=0)
        scores = {key: torch.cat([r[key] for r, _ in results]) for key in results[0][0]}
        return traj, scores

    def off_policy_rollout(self, step: int, times: dict) -> tuple[TensorDict, dict[str, torch.Tensor]]:
        """Step ``step``'s trajectories from the queue of requests running ahead on the replicas, scored.

        Requests for steps up to ``step + distributed.max_staleness`` are sent (each replica runs them in order,
        with the weights it holds when it reaches them: the sync after step ``s`` reaches a replica after the
        requests sent before it). So step ``s + k``'s request, sent at step ``s``, is sampled with the weights
        of version ``s`` while the actor trains step ``s``: staleness ``k`` in the steady state (``j < k`` for
        the first steps ``j``). Sets ``time/rollout`` (the replicas' sampling), ``time/rollout_wait`` (the
        driver waiting for it) and ``time/reward``.
        """
        while self._next_rollout <= min(step + self.max_staleness, self.steps - 1):
            if self.algorithm.needs_rollout(self._next_rollout):
                self._rollout_queue[self._next_rollout] = self.replicas.submit(self.request_fn(self._next_rollout))
            self._next_rollout += 1
        start = time.perf_counter()
        traj = self.replicas.collect(self._rollout_queue.pop(step))
        times["time/rollout_wait"] = time.perf_counter() - start
        times["time/rollout"] = float(traj.get_non_tensor("metrics")["rollout_seconds"])
        start = time.perf_counter()
        texts = list(traj.get("prompts").tolist())
        scores = score(self.rewards, traj["images"], texts, sample_metadata(texts, self.prompt_metadata, step=step), sources_of(traj))
        times["time/reward"] = time.perf_counter() - start
        return traj, scores

    def behaviour_versions(self, traj: TensorDict, step: int, times: dict) -> dict:
        """Take the replicas' ``weights_version [B]`` off ``traj``; when older than the actor's weights (version
        ``step``), mark the proximal policy of the loss's truncated importance weights
        (``diffrl.algorithms.losses.make_step_loss``): an update of one optimizer step scores with the weights it
        starts from, so its own forward is the proximal policy (``proximal_is_current``); several optimizer
        steps need the actor's log-probs before the first one (``prox_log_probs``, one more forward pass).
        Returns the record's ``weights_version`` (oldest row) and ``staleness``."""
        versions = traj.pop("weights_version")
        oldest = int(versions.min())
        if oldest > step:
            raise RuntimeError(f"step {step + 1}'s trajectories carry weights version {oldest}, newer than the actor's {step}")
        if oldest < step or self.low_precision_rollouts:
            self.mark_proximal(traj, times)
        return {"weights_version": oldest, "staleness": float(step - versions.float().mean())}

    def mark_proximal(self, traj: TensorDict, times: dict) -> None:
        """The trajectories come from another policy than the trained one (stale replica weights, FP8 rollouts): mark the
        trained policy as the proximal policy of the loss's truncated importance weights. An update of one optimizer step
        scores with the weights it starts from (``proximal_is_current``); several need the actor's log-probs before the
        first one (``prox_log_probs``, one more forward pass)."""
        if self.algorithm.optimizer_steps_per_rl_step() == 1:
            traj["proximal_is_current"] = torch.ones(traj.shape[0], dtype=torch.bool)
            return
        start = time.perf_counter()
        traj["prox_log_probs"] = self.workers.infer_actor_batch(traj.exclude("metrics"))["log_probs"]
        times["time/proximal"] = time.perf_counter() - start


__all__ = ["RolloutDriver", "low_precision_rollouts", "rollout_request", "sources_of", "window_masks"]
