"""Activation memory of the training forward: per-block activation checkpointing at a chosen granularity.

:func:`checkpoint_blocks` wraps the forward of every ``every``-th repeated block of the denoiser (the
adapter's ``fsdp_blocks()``: transformer blocks, FLUX's single blocks too, UNet stages) in
``torch.utils.checkpoint.checkpoint`` (non-reentrant). In a grad-enabled forward such a block keeps only its
inputs; its activations are recomputed when the backward reaches it, which costs one more forward of that
block. Rollouts and reference/old-policy scoring run under ``no_grad`` and are untouched, and the recompute
is the same computation, so gradients equal those without checkpointing (bit for bit on the CPU,
``tests/test_shapes.py``).

``every=1`` checkpoints every block (the least memory: one block's activations live at a time in the
backward, plus the inputs of all blocks); ``every=2`` every other block (about half the activation memory
saved, half the recompute), and so on. ``model.activation_checkpointing`` switches it on, ``model.checkpoint_every``
picks ``every``. The wrapper sits under FSDP2's hooks (they run on the block's ``__call__``; FSDP2 unshards
a block's parameters before its backward, when the recompute runs) and is traced by ``torch.compile``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpoint_blocks(blocks: list[nn.Module], every: int = 1) -> int:
    """Checkpoint blocks ``0, every, 2·every, …`` of ``blocks`` (idempotent); returns how many are checkpointed.

    Each chosen block's class becomes a subclass whose ``forward`` runs the original one under
    ``checkpoint`` in a grad-enabled training forward, so copies of the module (``copy.deepcopy``: the
    reference or old policy of full fine-tuning) stay checkpointed with their own weights."""
    if every < 1:
        raise ValueError(f"model.checkpoint_every must be ≥ 1, got {every}")
    if not blocks:
        raise ValueError("activation checkpointing needs the denoiser's repeated blocks (the adapter's fsdp_blocks() is empty); set model.activation_checkpointing=false")
    count = 0
    for i, block in enumerate(blocks):
        if i % every:
            continue
        if not getattr(block, "_diffrl_checkpointed", False):
            block.__class__ = _checkpointed_class(type(block))
        count += 1
    return count


_CLASSES: dict[type, type] = {}


def _checkpointed_class(cls: type) -> type:
    if cls not in _CLASSES:

        def forward(self, *args, **kwargs):
            parent = super(checkpointed, self).forward
            if torch.is_grad_enabled() and self.training:
                return checkpoint(parent, *args, use_reentrant=False, **kwargs)
            return parent(*args, **kwargs)

        checkpointed = type(f"Checkpointed{cls.__name__}", (cls,), {"forward": forward, "_diffrl_checkpointed": True, "__module__": cls.__module__})
        _CLASSES[cls] = checkpointed
    return _CLASSES[cls]


def checkpointed_count(module: nn.Module) -> int:
    """How many sub-modules of ``module`` run checkpointed."""
    return sum(1 for m in module.modules() if getattr(m, "_diffrl_checkpointed", False))


__all__ = ["checkpoint_blocks", "checkpointed_count"]
