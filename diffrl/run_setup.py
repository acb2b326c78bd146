"""A run's pieces built from its components' configs: the algorithm's :class:`~diffrl.algorithms.RunContext`, the
workers' :class:`~diffrl.distributed.workers.WorkerConfig`, and the worker group with its rollout replicas
(``distributed.*``: in this process or as Ray actors, ``diffrl.distributed``). Each builder takes the sub-configs it
reads; the trainer builds its run from these. :func:`run_context` and :func:`worker_config` take a whole config, for
``diffrl sample`` / ``eval`` / ``plan`` and the analysis helpers that read a run's config.yaml.
"""

from __future__ import annotations

from omegaconf import DictConfig

from diffrl.algorithms import Algorithm, RunContext, build_algorithm
from diffrl.config import BatchPlan, DistributedConfig, ModelConfig, RewardConfig, SamplerConfig
from diffrl.distributed import WorkerGroup, build_worker_group
from diffrl.distributed.rollout import RolloutReplicas
from diffrl.distributed.workers import ActorRolloutRefWorker, WorkerConfig
from diffrl.recipes import Config, to_config
from diffrl.run_rewards import reward_weights


def algorithm_context(seed: int, sampler: SamplerConfig, reward: RewardConfig, batch: BatchPlan) -> RunContext:
    """What the algorithm needs of the run: the seed (``trainer.seed``), the batch arithmetic (``batch``,
    :class:`~diffrl.config.BatchPlan`), the sampler and each reward's weight (``reward.*``)."""
    return RunContext(seed=int(seed), prompts_per_step=batch.prompts_per_step, group_size=batch.group_size, sampler=sampler,
                      reward_weights=reward_weights(reward), batch=batch)


def run_context(cfg: Config, batch: BatchPlan | None = None) -> RunContext:
    """:func:`algorithm_context` of a whole config (``batch``: else the plan of ``cfg``'s sizes)."""
    batch = batch or BatchPlan.of(cfg.trainer, cfg.distributed, cfg.model, cfg.algorithm)
    return algorithm_context(cfg.trainer.seed, cfg.sampler, cfg.reward, batch)


def build_worker_config(model: ModelConfig, sampler: SamplerConfig, algorithm: Algorithm, *, seed: int, steps: int) -> WorkerConfig:
    """What every worker builds its model and engine from: the model's and the sampler's configs as they are, the
    algorithm's optimizer (its ``Config``), the seed and the optimizer steps of ``steps`` RL steps."""
    return WorkerConfig(
        model=model, sampler=sampler, optim=algorithm.config, micro_batch_size=algorithm.config.micro_batch_size, seed=int(seed),
        old_policy=algorithm.needs_old_policy, total_steps=int(steps) * algorithm.optimizer_steps_per_rl_step(),
    )


def worker_config(cfg: Config | DictConfig, algorithm: Algorithm | None = None) -> WorkerConfig:
    """:func:`build_worker_config` of a whole config (``algorithm``: else the one it names, built)."""
    cfg = to_config(cfg)
    algorithm = algorithm or build_algorithm(cfg.algorithm, run_context(cfg))
    return build_worker_config(cfg.model, cfg.sampler, algorithm, seed=cfg.trainer.seed, steps=cfg.trainer.steps)


def build_workers(dist: DistributedConfig, config: WorkerConfig, *, threads: int | None = None) -> tuple[WorkerGroup, RolloutReplicas | None]:
    """The actor worker group (``distributed.backend``, ``num_workers`` and each rank's resources; ``threads``:
    ``trainer.threads``) with its model initialised, and the rollout replicas beside it (``distributed.rollout_replicas``;
    None: the actor ranks sample). A failure to start the replicas shuts the workers down before it propagates."""
    d = dist
    workers = build_worker_group(
        ActorRolloutRefWorker, config, backend=d.backend, num_workers=d.num_workers,
        **({"num_cpus_per_worker": d.num_cpus_per_worker, "num_gpus_per_worker": d.num_gpus_per_worker, "threads": threads, "address": d.ray_address,
            "rendezvous_timeout_s": d.ray_rendezvous_timeout_s, "call_timeout_s": d.ray_call_timeout_s} if d.backend == "ray" else {}),
    )
    workers.init_model()
    if not d.rollout_replicas:
        return workers, None
    try:
        replicas = RolloutReplicas(
            config, workers, replicas=int(d.rollout_replicas), bucket_bytes=int(d.weight_sync_bucket_mb * 2**20), backend=d.weight_sync_backend,
            num_cpus=d.num_cpus_per_rollout, num_gpus=d.num_gpus_per_rollout, threads=threads, rendezvous_timeout_s=d.ray_rendezvous_timeout_s,
            call_timeout_s=d.ray_call_timeout_s,
        )
    except BaseException:
        workers.shutdown()
        raise
    return workers, replicas


__all__ = ["algorithm_context", "build_worker_config", "build_workers", "run_context", "worker_config"]
