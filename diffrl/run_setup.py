"""A run's pieces built from its config: the algorithm's :class:`~diffrl.algorithms.RunContext`, the workers'
:class:`~diffrl.distributed.workers.WorkerConfig`, the training rewards, and the worker group with its rollout
replicas (``distributed.*``: in this process or as Ray actors, ``diffrl.distributed``). The trainer builds its run
from these; ``diffrl sample`` / ``eval`` / ``plan`` build their workers the same way.
"""

from __future__ import annotations

from omegaconf import DictConfig

from diffrl.algorithms import Algorithm, RunContext, build_algorithm
from diffrl.config import BatchPlan
from diffrl.distributed import WorkerGroup, build_worker_group
from diffrl.distributed.rollout import RolloutReplicas
from diffrl.distributed.workers import ActorRolloutRefWorker, WorkerConfig
from diffrl.recipes import Config, to_config
from rewards.base import build_reward


def run_context(cfg: Config, batch: BatchPlan | None = None) -> RunContext:
    """What the algorithm needs of the run: the seed, the batch arithmetic (``batch``, else the plan of ``cfg``'s sizes,
    :class:`~diffrl.config.BatchPlan`), the sampler and each reward's weight."""
    names, weights = list(cfg.reward.names), list(cfg.reward.weights) or [1.0] * len(cfg.reward.names)
    if not names:
        raise ValueError("reward.names is empty: give at least one reward")
    if len(weights) != len(names):
        raise ValueError(f"reward.weights has {len(weights)} entries for {len(names)} reward.names; give one weight per reward")
    batch = batch or BatchPlan.of(cfg.trainer, cfg.distributed, cfg.model, cfg.algorithm)
    return RunContext(seed=int(cfg.trainer.seed), prompts_per_step=batch.prompts_per_step, group_size=batch.group_size, sampler=cfg.sampler,
                      reward_weights={n: float(w) for n, w in zip(names, weights)}, batch=batch)


def worker_config(cfg: Config | DictConfig, algorithm: Algorithm | None = None) -> WorkerConfig:
    """What every worker builds its model and engine from: the components' configs as they are."""
    cfg = to_config(cfg)
    algorithm = algorithm or build_algorithm(cfg.algorithm, run_context(cfg))
    return WorkerConfig(
        model=cfg.model, sampler=cfg.sampler, optim=algorithm.config, micro_batch_size=cfg.algorithm.micro_batch_size, seed=int(cfg.trainer.seed),
        old_policy=algorithm.needs_old_policy, total_steps=int(cfg.trainer.steps) * algorithm.optimizer_steps_per_rl_step(),
    )


def build_rewards(cfg: Config, run: RunContext) -> dict:
    """``name → (reward, weight)`` of the rewards the run trains on (``reward.names``, built with ``reward.options``).
    Built before the model: a reward that cannot be built (a server down) costs nothing."""
    return {name: (build_reward(name, **cfg.reward.options.get(name, {})), w) for name, w in run.reward_weights.items()}


def build_workers(cfg: Config, config: WorkerConfig) -> tuple[WorkerGroup, RolloutReplicas | None]:
    """The actor worker group (``distributed.backend``, ``num_workers`` and each rank's resources) with its model
    initialised, and the rollout replicas beside it (``distributed.rollout_replicas``; None: the actor ranks sample).
    A failure to start the replicas shuts the workers down before it propagates."""
    t, d = cfg.trainer, cfg.distributed
    workers = build_worker_group(
        ActorRolloutRefWorker, config, backend=d.backend, num_workers=d.num_workers,
        **({"num_cpus_per_worker": d.num_cpus_per_worker, "num_gpus_per_worker": d.num_gpus_per_worker, "threads": t.threads, "address": d.ray_address,
            "rendezvous_timeout_s": d.ray_rendezvous_timeout_s, "call_timeout_s": d.ray_call_timeout_s} if d.backend == "ray" else {}),
    )
    workers.init_model()
    if not d.rollout_replicas:
        return workers, None
    try:
        replicas = RolloutReplicas(
            config, workers, replicas=int(d.rollout_replicas), bucket_bytes=int(d.weight_sync_bucket_mb * 2**20), backend=d.weight_sync_backend,
            num_cpus=d.num_cpus_per_rollout, num_gpus=d.num_gpus_per_rollout, threads=t.threads, rendezvous_timeout_s=d.ray_rendezvous_timeout_s,
            call_timeout_s=d.ray_call_timeout_s,
        )
    except BaseException:
        workers.shutdown()
        raise
    return workers, replicas


__all__ = ["build_rewards", "build_workers", "run_context", "worker_config"]
