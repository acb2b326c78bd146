"""One worker in the driver's process: no serialisation, no process group."""

from __future__ import annotations

from diffrl.single_controller.base import WorkerGroup
from diffrl.workers import ActorRolloutRefWorker


class LocalWorkerGroup(WorkerGroup):
    worker_cls = ActorRolloutRefWorker

    def __init__(self, config, role: str = "actor_rollout_ref"):
        self.world_size = 1
        self.worker = ActorRolloutRefWorker(config, role=role)

    def _call_all(self, method: str, args_per_rank: list[tuple], kwargs: dict) -> list:
        return [getattr(self.worker, method)(*args_per_rank[0], **kwargs)]
