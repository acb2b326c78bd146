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


def apply_fsdp(module: nn.Module, blocks: list[nn.Module], *, param_offload: bool = False, reshard_after_forward: bool = True,
               reduce_dtype: torch.dtype | None = None) -> nn.Module:
    """Shard every block, then the root, with FSDP2 over all ranks (frozen and trainable parameters mix).

    ``reduce_dtype`` (bf16 full fine-tuning: float32) reduce-scatters the gradients in that dtype
    (``MixedPrecisionPolicy(param_dtype=None, reduce_dtype=…)``): the parameters are gathered and computed in their own
    dtype, as without a policy, and each rank's fp32 master (:mod:`diffrl.engine.precision`) receives the fp32 sum
    rounded once to the shard's dtype. No ``param_dtype`` is set on purpose: FSDP2 would then cast every floating input
    of every sharded module to it (SD3's fp32 ``timestep = 1000·σ``, FLUX's rotary tables), which the unsharded bf16
    model does not do."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    offload = CPUOffloadPolicy() if param_offload else OffloadPolicy()
    kwargs = {"mp_policy": MixedPrecisionPolicy(reduce_dtype=reduce_dtype)} if reduce_dtype is not None else {}
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, offload_policy=offload, **kwargs)
    fully_shard(module, reshard_after_forward=reshard_after_forward, offload_policy=offload, **kwargs)
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
