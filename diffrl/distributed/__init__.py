"""Execution across workers: the workers (``workers``: the seed's ``TrainingWorker`` /
``ActorRolloutRefWorker`` API), the typed worker group and its executors (``controller``: local; ``ray``:
one Ray actor per rank with torch.distributed and FSDP2)."""

from diffrl.distributed.controller import Dispatch, LocalExecutor, WorkerGroup, WorkerLostError, register
from diffrl.distributed.ray import RayExecutor

__all__ = ["Dispatch", "LocalExecutor", "RayExecutor", "WorkerGroup", "WorkerLostError", "build_worker_group", "register"]


def build_worker_group(worker_cls: type, config, *, backend: str = "local", num_workers: int = 1, role: str = "actor_rollout_ref", **ray_options) -> WorkerGroup:
    """A :class:`WorkerGroup` of ``worker_cls`` for ``backend`` ``local`` (1 worker, this process) or ``ray``; with
    ``config.model.sequence_parallel`` > 1 its ranks form groups that split each sample's tokens (checked before any
    work with the other distributed settings: ``diffrl.distributed.checks.validate_distributed``)."""
    k = int(config.model.sequence_parallel)
    if backend == "local":
        if num_workers != 1:
            raise ValueError(f"distributed.backend=local runs one worker in this process; for distributed.num_workers={num_workers} use distributed.backend=ray")
        return WorkerGroup(worker_cls, LocalExecutor(worker_cls, config, role))
    if backend == "ray":
        return WorkerGroup(worker_cls, RayExecutor(worker_cls, config, num_workers=num_workers, role=role, **ray_options), sequence_parallel=k)
    raise ValueError(f"unknown distributed.backend {backend!r}; choose local or ray")
