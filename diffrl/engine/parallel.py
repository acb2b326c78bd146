"""torch.distributed set-up and FSDP2 sharding of a denoiser, kept apart from the model code.

The model adapter names its repeated blocks (``fsdp_blocks()``); :func:`apply_fsdp` shards each block and
then the root with ``fully_shard`` (FSDP2). Parameters become ``DTensor`` shards; :func:`full_tensor` and
:func:`load_full` move whole tensors in and out of them (checkpoints hold whole tensors).
"""

from __future__ import annotations

import datetime
import os

import torch
from torch import nn


def is_distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def rank() -> int:
    return torch.distributed.get_rank() if is_distributed() else 0


def world_size() -> int:
    return torch.distributed.get_world_size() if is_distributed() else 1


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, backend: str | None = None, timeout_s: float | None = None) -> str:
    """Join the process group (NCCL on GPU, gloo on CPU unless ``backend`` says otherwise); ``timeout_s`` bounds
    the rendezvous and every collective (torch's default when None)."""
    if is_distributed():
        return torch.distributed.get_backend()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared hosts
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
    torch.distributed.init_process_group(backend=backend, rank=rank, world_size=world_size, **kwargs)
    return backend


def apply_fsdp(module: nn.Module, blocks: list[nn.Module], *, param_offload: bool = False, reshard_after_forward: bool = True) -> nn.Module:
    """Shard every block, then the root, with FSDP2 over all ranks (frozen and trainable parameters mix)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    offload = CPUOffloadPolicy() if param_offload else OffloadPolicy()
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, offload_policy=offload)
    fully_shard(module, reshard_after_forward=reshard_after_forward, offload_policy=offload)
    return module


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a DTensor shard (a collective: every rank must call it); plain tensors pass."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def load_full(target: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a whole tensor into ``target`` (its local shard when ``target`` is a DTensor)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if isinstance(target, DTensor):
            target.copy_(distribute_tensor(value.to(target.dtype), target.device_mesh, target.placements))
        else:
            target.copy_(value)


def barrier() -> None:
    if is_distributed():
        torch.distributed.barrier()
