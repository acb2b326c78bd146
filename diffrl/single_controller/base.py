"""Dispatch modes, the ``register`` decorator and the WorkerGroup interface."""

from __future__ import annotations

import abc
import enum
import functools

import torch
from tensordict import TensorDict


class Dispatch(enum.Enum):
    ONE_TO_ALL = "one_to_all"
    """the same arguments go to every worker; the result of rank 0 is returned"""
    DP_COMPUTE = "dp_compute"
    """the TensorDict argument is split along the batch by rank; results are concatenated (metrics averaged)"""


def register(dispatch_mode: Dispatch = Dispatch.ONE_TO_ALL):
    """Mark a worker method with how the worker group dispatches it."""

    def wrap(fn):
        fn._dispatch_mode = dispatch_mode

        @functools.wraps(fn)
        def inner(*args, **kwargs):
            return fn(*args, **kwargs)

        inner._dispatch_mode = dispatch_mode
        return inner

    return wrap


def dispatch_mode_of(cls, method: str) -> Dispatch:
    fn = getattr(cls, method, None)
    if fn is None or not callable(fn):
        raise AttributeError(f"{cls.__name__} has no method {method!r}")
    mode = getattr(fn, "_dispatch_mode", None)
    if mode is None:
        raise AttributeError(f"{cls.__name__}.{method} is not registered for dispatch (decorate it with @register)")
    return mode


def split_for_dp(data: TensorDict, world_size: int) -> list[TensorDict]:
    """Contiguous equal chunks of ``data`` along the batch, one per rank."""
    n = data.shape[0]
    if n % world_size:
        raise ValueError(f"a batch of {n} rows cannot be split evenly over {world_size} workers")
    size = n // world_size
    return [data[r * size : (r + 1) * size] for r in range(world_size)]


def _merge_metrics(parts: list[dict]) -> dict:
    """Average each metric over ranks (lists element by element, scalars directly)."""
    merged = {}
    for key, first in parts[0].items():
        values = [p[key] for p in parts if key in p]
        if isinstance(first, list):
            merged[key] = [sum(v[i] for v in values) / len(values) for i in range(len(first))]
        elif isinstance(first, (int, float)) and not isinstance(first, bool):
            merged[key] = sum(values) / len(values)
        else:
            merged[key] = first
    return merged


def gather_dp(outputs: list[TensorDict]) -> TensorDict:
    """Concatenate per-rank TensorDicts (or merge metric-only ones)."""
    metrics = [o.get_non_tensor("metrics") for o in outputs if "metrics" in o.keys()]
    for o in outputs:
        if "metrics" in o.keys():
            del o["metrics"]
    if outputs[0].batch_size == torch.Size([]):
        out = outputs[0]
    else:
        out = torch.cat(outputs, dim=0)
    if metrics:
        out.set_non_tensor("metrics", _merge_metrics(metrics))
    return out


def arrange_for_data_parallel(data: TensorDict, *, mini_batch_size: int, world_size: int, order: torch.Tensor) -> TensorDict:
    """Reorder rows so that contiguous DP chunks hold, for every mini-batch in ``order``, that mini-batch's
    slice of each rank: rank r then trains mini-batch m on rows ``order[m·M + r·M/W : m·M + (r+1)·M/W]``.

    With one worker this is ``data[order]``. Each rank's share of a mini-batch is ``mini_batch_size / world_size``.
    """
    n = data.shape[0]
    if n % mini_batch_size or mini_batch_size % world_size:
        raise ValueError(
            f"{n} rows in mini-batches of {mini_batch_size} over {world_size} workers: the mini-batch size must divide "
            f"the batch and be divisible by the number of workers"
        )
    per = mini_batch_size // world_size
    rows = []
    for r in range(world_size):
        for m in range(n // mini_batch_size):
            start = m * mini_batch_size + r * per
            rows.append(order[start : start + per])
    return data[torch.cat(rows)]


class WorkerGroup(abc.ABC):
    """Calls registered methods of its workers: ``group.generate_sequences(td)`` etc."""

    world_size: int = 1
    worker_cls: type

    @abc.abstractmethod
    def _call_all(self, method: str, args_per_rank: list[tuple], kwargs: dict) -> list:
        """Call ``method`` on every rank with its own positional arguments; results in rank order."""

    def __getattr__(self, method: str):
        if method.startswith("_"):
            raise AttributeError(method)
        mode = dispatch_mode_of(self.worker_cls, method)

        def call(*args, **kwargs):
            if mode is Dispatch.ONE_TO_ALL:
                return self._call_all(method, [args] * self.world_size, kwargs)[0]
            data, *rest = args
            chunks = split_for_dp(data, self.world_size)
            return gather_dp(self._call_all(method, [(c, *rest) for c in chunks], kwargs))

        return call

    def shutdown(self) -> None:
        """Release the workers (Ray actors); a local group has nothing to release."""


def build_worker_group(config, *, backend: str = "local", num_workers: int = 1, role: str = "actor_rollout_ref", **ray_options) -> WorkerGroup:
    """A worker group of ``ActorRolloutRefWorker`` for ``backend`` ``local`` (1 worker) or ``ray``."""
    if backend == "local":
        from diffrl.single_controller.local import LocalWorkerGroup

        if num_workers != 1:
            raise ValueError(f"trainer.backend=local runs one worker in this process; for trainer.num_workers={num_workers} use trainer.backend=ray")
        return LocalWorkerGroup(config, role=role)
    if backend == "ray":
        from diffrl.single_controller.ray import RayWorkerGroup

        return RayWorkerGroup(config, num_workers=num_workers, role=role, **ray_options)
    raise ValueError(f"unknown trainer.backend {backend!r}; choose local or ray")
