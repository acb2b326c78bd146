"""One Ray actor per rank: each joins a torch.distributed group (NCCL on GPU, gloo on CPU) and shards
the denoiser with FSDP2; the driver dispatches registered methods to all of them."""

from __future__ import annotations

import os
import socket

import torch

from diffrl.distributed.controller import Executor
from diffrl.engine import parallel


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankWorker:
    """The Ray actor body: a process-group member holding one worker of ``worker_cls``."""

    def __init__(self, worker_cls: type, config, role: str, rank: int, world_size: int, master_addr: str, master_port: int, threads: int | None, backend: str | None):
        if threads:
            torch.set_num_threads(threads)
        self.backend = parallel.init_distributed(rank, world_size, master_addr, master_port, backend)
        self.worker = worker_cls(config, role=role)

    def execute(self, method: str, args: tuple, kwargs: dict):
        return getattr(self.worker, method)(*args, **kwargs)

    def ready(self) -> str:
        return self.backend


class RayExecutor(Executor):
    """``num_workers`` Ray actors, ranks 0…N−1 of one process group.

    Args:
        worker_cls: the worker class every rank instantiates.
        config: the ``WorkerConfig`` every rank builds its worker from.
        num_workers: ranks (one GPU each when ``num_gpus_per_worker`` > 0).
        num_cpus_per_worker, num_gpus_per_worker: Ray resources of each actor.
        threads: torch CPU threads of each actor.
        backend: torch.distributed backend (default NCCL with GPUs, else gloo).
        ray_init: keyword arguments of ``ray.init`` when Ray is not running yet.
    """

    def __init__(self, worker_cls: type, config, *, num_workers: int, role: str = "actor_rollout_ref", num_cpus_per_worker: float = 1, num_gpus_per_worker: float = 0,
                 threads: int | None = None, backend: str | None = None, ray_init: dict | None = None):
        import ray

        if num_workers < 1:
            raise ValueError(f"trainer.num_workers must be ≥ 1, got {num_workers}")
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            env = {"env_vars": {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}}
            ray.init(**{"include_dashboard": False, "log_to_driver": True, "runtime_env": env, **(ray_init or {})})
        self.world_size = num_workers
        port = _free_port()
        actor = ray.remote(num_cpus=num_cpus_per_worker, num_gpus=num_gpus_per_worker)(RankWorker)
        self.actors = [actor.remote(worker_cls, config, role, r, num_workers, "127.0.0.1", port, threads, backend) for r in range(num_workers)]
        ray.get([a.ready.remote() for a in self.actors])

    def call_all(self, method: str, args_per_rank: list[tuple], kwargs: dict) -> list:
        import ray

        return ray.get([a.execute.remote(method, args, kwargs) for a, args in zip(self.actors, args_per_rank)])

    def shutdown(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)
        self.actors = []
        if self._owns_ray:
            ray.shutdown()
