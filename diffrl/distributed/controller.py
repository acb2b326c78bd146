"""Single-controller execution (verl's pattern): one driver calls typed methods on a group of workers.

``register(dispatch_mode=…)`` marks how a worker method's input is split and its outputs merged. A
:class:`WorkerGroup` is built by :func:`build_worker_group` from the worker class and an executor:
``local`` runs one worker in the driver's process (the embedded default), ``ray`` one Ray actor per rank
with torch.distributed and FSDP2 (``diffrl.distributed.ray``). The group's methods are the worker API the
trainer and the algorithms call, each dispatched as its worker method is registered.
"""

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


class WorkerLostError(RuntimeError):
    """A worker (rank) died or its process was lost; the message names the rank and its node."""


class Executor(abc.ABC):
    """Runs a method on every rank's worker."""

    world_size: int = 1

    @abc.abstractmethod
    def call_all(self, method: str, args_per_rank: list[tuple], kwargs: dict) -> list:
        """Call ``method`` on every rank with its own positional arguments; results in rank order."""

    def shutdown(self) -> None:
        """Release the workers (Ray actors); a local executor has nothing to release."""


class LocalExecutor(Executor):
    """One worker in the driver's process: no serialisation, no process group."""

    def __init__(self, worker_cls: type, config, role: str):
        self.world_size = 1
        self.worker = worker_cls(config, role=role)

    def call_all(self, method: str, args_per_rank: list[tuple], kwargs: dict) -> list:
        return [getattr(self.worker, method)(*args_per_rank[0], **kwargs)]


class WorkerGroup:
    """The worker API over all ranks: each method dispatches as the worker class registered it.

    With sequence parallelism (``model.sequence_parallel=k``) the ranks form ``world_size / k`` data-parallel groups of
    ``k`` consecutive ranks that split each sample's tokens between them: a ``DP_COMPUTE`` input is split into one chunk
    per group, every rank of a group gets its group's chunk, and the group's first rank answers for it (the ranks of a
    group compute the same outputs).

    Args:
        worker_cls: the worker class (``ActorRolloutRefWorker``); its ``@register`` modes drive the dispatch.
        executor: runs the calls (:class:`LocalExecutor` or ``diffrl.distributed.ray.RayExecutor``).
        sequence_parallel: ranks per sequence-parallel group (``model.sequence_parallel``; 1: each rank its own samples).
    """

    def __init__(self, worker_cls: type, executor: Executor, sequence_parallel: int = 1):
        self.worker_cls = worker_cls
        self.executor = executor
        self.world_size = executor.world_size
        if sequence_parallel < 1 or self.world_size % sequence_parallel:
            raise ValueError(f"model.sequence_parallel={sequence_parallel} must divide the {self.world_size} ranks")
        self.sequence_parallel = sequence_parallel
        self.dp_size = self.world_size // sequence_parallel
        """data-parallel groups: the number of ways a batch is split"""

    def _call(self, method: str, *args, **kwargs):
        mode = dispatch_mode_of(self.worker_cls, method)
        if mode is Dispatch.ONE_TO_ALL:
            return self.executor.call_all(method, [args] * self.world_size, kwargs)[0]
        data, *rest = args
        k = self.sequence_parallel
        chunks = split_for_dp(data, self.dp_size)
        outputs = self.executor.call_all(method, [(chunks[r // k], *rest) for r in range(self.world_size)], kwargs)
        return gather_dp(outputs[::k])

    # -- set-up ------------------------------------------------------------------------------------
    def init_model(self) -> None:
        self._call("init_model")

    def set_loss_fn(self, loss_fn) -> None:
        self._call("set_loss_fn", loss_fn)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        self._call("to", device, model=model, optimizer=optimizer, grad=grad)

    # -- data-parallel compute ---------------------------------------------------------------------
    def generate_sequences(self, data: TensorDict) -> TensorDict:
        return self._call("generate_sequences", data)

    def infer_ref_batch(self, data: TensorDict) -> TensorDict:
        return self._call("infer_ref_batch", data)

    def infer_actor_batch(self, data: TensorDict) -> TensorDict:
        return self._call("infer_actor_batch", data)

    def update_actor(self, data: TensorDict) -> TensorDict:
        return self._call("update_actor", data)

    # -- policies and weights ------------------------------------------------------------------------
    def copy_adapter(self, source: str = "default", target: str = "old") -> None:
        self._call("copy_adapter", source, target)

    def ema_update_adapter(self, source: str = "default", target: str = "old", decay: float = 0.0) -> None:
        self._call("ema_update_adapter", source, target, decay)

    def update_weights(self, global_steps: int | None = None) -> None:
        self._call("update_weights", global_steps)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return self._call("trainable_state")

    def save_checkpoint(self, local_path, global_step: int = 0, extra_state: dict | None = None):
        return self._call("save_checkpoint", local_path, global_step, extra_state)

    def load_checkpoint(self, local_path, hashes: bool = True) -> dict:
        return self._call("load_checkpoint", local_path, hashes=hashes)

    # -- model facts ---------------------------------------------------------------------------------
    def default_prompts(self) -> list[str] | None:
        return self._call("default_prompts")

    def encode_pairs(self, pairs: TensorDict) -> TensorDict:
        return self._call("encode_pairs", pairs)

    def flops_counter(self, peak_flops: float | None = None):
        return self._call("flops_counter", peak_flops)

    def shutdown(self) -> None:
        """Release the workers (Ray actors)."""
        self.executor.shutdown()
