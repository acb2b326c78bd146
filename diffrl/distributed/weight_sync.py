"""Weight sync from the actor to rollout replicas: torch.distributed broadcasts in buckets, verified by hash.

The sync group is its own process group beside the actor ranks' (the replicas are not members of the
actor's group, so FSDP2 keeps sharding over the actor ranks only): sync rank 0 is actor rank 0, sync ranks
``1 … N`` are the ``N`` rollout replicas. It is built from a ``TCPStore`` at actor rank 0's node (the address
the driver got from that actor) with the backend's own class (``ProcessGroupGloo``, or ``ProcessGroupNCCL``
on GPUs in different devices: NCCL refuses two ranks on one GPU, so a replica sharing the actor's GPU syncs
through gloo and host memory).

What moves (:func:`sync_state`): with LoRA (the base frozen) the LoRA matrices of every adapter
(``default`` and, when the algorithm keeps one, ``old``); with full fine-tuning every parameter of the
denoiser. Tensors are packed in name order into flat buckets of at most ``bucket_bytes`` (one dtype per
bucket; a tensor larger than a bucket is a bucket of its own). Under FSDP2 every actor rank gathers the
whole tensors of one bucket (a collective over the actor ranks), actor rank 0 broadcasts it, and the
replicas copy it into their parameters. Both sides then hash what they hold (:func:`state_hash`, SHA-256
of names, shapes, dtypes and bytes); the driver compares the hashes and stops on a mismatch.
"""

from __future__ import annotations

import datetime
import hashlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from diffrl.engine import lora, parallel


@dataclass(frozen=True)
class TensorSpec:
    """One synced tensor: its parameter name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def sync_parameters(engine) -> dict[str, torch.nn.Parameter]:
    """The parameters a sync moves, in name order: LoRA matrices of every adapter (base frozen), or every
    parameter of the denoiser (full fine-tuning)."""
    module = engine.module
    if engine.uses_lora:
        params = {n: p for n, p in module.named_parameters() if "lora_A" in n or "lora_B" in n}
        if not params:
            raise RuntimeError(f"{type(module).__name__} has no LoRA parameters to sync; was the adapter attached (engine.initialize)?")
    else:
        params = dict(module.named_parameters())
    return dict(sorted(params.items()))


def specs_of(params: dict[str, torch.Tensor]) -> list[TensorSpec]:
    """Name, whole shape and dtype of each tensor (a DTensor shard reports its whole shape)."""
    return [TensorSpec(n, tuple(p.shape), p.dtype) for n, p in params.items()]


def spec_digest(specs: list[TensorSpec]) -> str:
    """SHA-256 of the names, shapes and dtypes: both ends of a sync must agree on it."""
    h = hashlib.sha256()
    for s in specs:
        h.update(f"{s.name}|{s.shape}|{s.dtype}\n".encode())
    return h.hexdigest()


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive tensors packed into buckets of at most ``bucket_bytes`` (one dtype per bucket; a tensor
    larger than ``bucket_bytes`` is a bucket of its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be > 0 bytes, got {bucket_bytes}")
    buckets: list[list[TensorSpec]] = []
    size = 0
    for s in specs:
        if buckets and buckets[-1][-1].dtype == s.dtype and size + s.nbytes <= bucket_bytes:
            buckets[-1].append(s)
            size += s.nbytes
        else:
            buckets.append([s])
            size = s.nbytes
    return buckets


def _hash_tensor(h, name: str, tensor: torch.Tensor) -> None:
    t = tensor.detach().to("cpu").contiguous()
    h.update(f"{name}|{tuple(t.shape)}|{t.dtype}\n".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def state_hash(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of every tensor's name, shape, dtype and bytes, in name order (bit-for-bit identity)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        _hash_tensor(h, name, tensors[name])
    return h.hexdigest()


def new_group(backend: str, host: str, port: int, rank: int, world_size: int, timeout_s: float):
    """A process group of its own (not the default one), rendezvous at ``host:port`` (served by rank 0).

    Returns the backend object (``ProcessGroupGloo`` / ``ProcessGroupNCCL``); collectives are its methods.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout, wait_for_workers=False)
    prefixed = dist.PrefixStore("diffrl_weight_sync", store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        raise ValueError(f"unknown weight-sync backend {backend!r}; choose gloo or nccl")
    return store, group


def _broadcast(group, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    group.broadcast([tensor], opts).wait()


def _handshake(channel: WeightSyncChannel, like: torch.Tensor) -> float:
    """A one-element broadcast: returns when both ends are in the sync (the seconds waited for the other end),
    so that the sync's own time excludes the other end's lateness."""
    start = time.perf_counter()
    _broadcast(channel.group, torch.zeros(1, dtype=like.dtype, device=channel.bucket_device(like)))
    return time.perf_counter() - start


class WeightSyncChannel:
    """One end of the sync group: actor rank 0 (``sync_rank`` 0, sends) or a replica (receives).

    Actor ranks other than 0 hold no channel but still take part in :func:`send_weights` (FSDP2 gathers).

    Args:
        backend: ``gloo`` (buckets staged in host memory) or ``nccl`` (buckets on the parameters' GPU).
        host, port: the rendezvous (actor rank 0's node and a free port there).
        sync_rank, world_size: this end's rank in the sync group of ``1 + replicas``.
        timeout_s: rendezvous and each broadcast.
    """

    def __init__(self, backend: str, host: str, port: int, sync_rank: int, world_size: int, timeout_s: float):
        self.backend = backend
        self.sync_rank = sync_rank
        self.store, self.group = new_group(backend, host, port, sync_rank, world_size, timeout_s)

    def bucket_device(self, like: torch.Tensor) -> torch.device:
        return like.device if self.backend == "nccl" else torch.device("cpu")


def send_weights(engine, channel: WeightSyncChannel | None, bucket_bytes: int) -> dict:
    """Every actor rank: gather each bucket's whole tensors; rank 0 (the one with ``channel``) broadcasts it.

    Returns (rank 0) ``{"hash", "bytes", "buckets", "seconds", "wait_seconds", "hash_seconds", "digest"}``
    (``seconds``: gathers and broadcasts, after the replicas joined); other ranks ``{}``.
    """
    params = sync_parameters(engine)
    specs = specs_of(params)
    buckets = plan_buckets(specs, bucket_bytes)
    waited = _handshake(channel, next(iter(params.values()))) if channel is not None else 0.0
    start, hashing = time.perf_counter(), 0.0
    h = hashlib.sha256()  # names are sorted and buckets consecutive: hashing bucket by bucket is state_hash's order
    for bucket in buckets:
        whole = [parallel.full_tensor(params[s.name].detach()) for s in bucket]  # a collective over the actor ranks
        if channel is None:
            continue
        flat = torch.cat([t.reshape(-1) for t in whole]).to(channel.bucket_device(whole[0]))
        _broadcast(channel.group, flat)
        begin = time.perf_counter()
        for s, t in zip(bucket, whole):
            _hash_tensor(h, s.name, t)
        hashing += time.perf_counter() - begin
    if channel is None:
        return {}
    return {"hash": h.hexdigest(), "bytes": sum(s.nbytes for s in specs), "buckets": len(buckets), "seconds": time.perf_counter() - start - hashing,
            "wait_seconds": waited, "hash_seconds": hashing, "digest": spec_digest(specs)}


def receive_weights(engine, channel: WeightSyncChannel, bucket_bytes: int) -> dict:
    """A replica: receive every bucket into its own parameters; returns ``{"hash", "bytes", "buckets", "seconds",
    "wait_seconds", "hash_seconds", "digest"}`` (``seconds``: from the actor's first bucket to the last copy).

    The replica plans the same buckets from its own parameters: both ends built the same model and adapters,
    so the plans agree (the driver also compares the two ``digest`` values of :func:`spec_digest`).
    """
    params = sync_parameters(engine)
    specs = specs_of(params)
    buckets = plan_buckets(specs, bucket_bytes)
    waited = _handshake(channel, next(iter(params.values())))
    start = time.perf_counter()
    with torch.no_grad():
        for bucket in buckets:
            first = params[bucket[0].name]
            flat = torch.empty(sum(s.numel for s in bucket), dtype=bucket[0].dtype, device=channel.bucket_device(first))
            _broadcast(channel.group, flat)
            offset = 0
            for s in bucket:
                params[s.name].copy_(flat[offset : offset + s.numel].view(s.shape))
                offset += s.numel
    seconds = time.perf_counter() - start
    begin = time.perf_counter()
    digest = state_hash(params)
    return {"hash": digest, "bytes": sum(s.nbytes for s in specs), "buckets": len(buckets), "seconds": seconds, "wait_seconds": waited,
            "hash_seconds": time.perf_counter() - begin, "digest": spec_digest(specs)}


def adapter_names(engine) -> list[str]:
    """The LoRA adapters of the engine's denoiser (empty for full fine-tuning)."""
    return sorted(getattr(engine.module, "peft_config", {})) if engine.uses_lora else []


def ensure_adapters(engine, names: list[str]) -> None:
    """Create on a replica the adapters the actor has (e.g. ``old``), as copies of ``default`` (the sync overwrites them)."""
    for name in names:
        lora.ensure_adapter(engine.module, name)
