"""Ulysses sequence parallelism (DeepSpeed-Ulysses) for Wan-architecture video transformers, kept apart from the model.

``model.sequence_parallel=k`` splits each sample's video tokens over ``k`` ranks (a *sequence-parallel group*; the
world is ``dp × k`` ranks, groups of ``k`` consecutive ranks, and the ``k`` ranks of a group see the same samples):

* after the patch embedding every rank keeps its contiguous ``1/k`` of the tokens (a forward pre-hook on the first
  block), and the rotary embedding is sliced the same way (a forward hook on ``rope``);
* in each self-attention the projections, the per-token q/k RMS norm and the rotary embedding run on the rank's
  tokens; an all-to-all then trades the sequence shard for a head shard (every rank holds all tokens of ``H/k``
  heads), scaled dot-product attention runs over the whole sequence, and a second all-to-all trades back;
* cross-attention keys (the text tokens), the timestep embedding and the feed-forward run on each rank as they are
  (the text is replicated, the rest is per token);
* before the unpatchify the output projection's tokens are all-gathered, so every rank of the group returns the
  whole prediction and the samplers, losses and log-probs downstream run unchanged (and identically) on each.

The all-to-alls and the gather carry their gradients (:class:`_AllToAll`, :class:`_Gather`). The gradient a rank
computes for a parameter is its tokens' share; the sum over the group is the whole sample's gradient. FSDP2 averages
gradients over all ``dp × k`` ranks, so the engine scales each backward by ``k`` (:func:`gradient_scale`): the update is
then the data-parallel mean of the groups' sums, the gradient of ``k = 1``.

diffusers 0.42 has its own context parallelism (``enable_parallelism`` with ``ContextParallelConfig(ulysses_degree=k)``
and ``WanTransformer3DModel._cp_plan``); it resolves its device as ``rank % torch.accelerator.device_count()``, which
fails on CPU (no accelerator: a division by zero), so it cannot run on gloo, and it builds its own device mesh beside
FSDP2's. This module is torch.distributed only and works on any backend (gloo on CPU, NCCL on GPUs).

Bad input is refused before work (:func:`check_config`, run with the distributed checks,
``diffrl.distributed.checks.validate_distributed``): ``k`` must divide the world size, the number of attention heads and
the number of video tokens (no padding: a token count that ``k`` does not divide is an error naming the sizes that work).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn



class SequenceParallel:
    """This rank's sequence-parallel group: ``size`` ranks that share one sample's tokens, this one ``rank`` of them.

    Args:
        group: the torch.distributed process group of the ``size`` ranks.
        size: ranks per group (``model.sequence_parallel``).
        rank: this rank's index in the group (its token shard).
    """

    def __init__(self, group, size: int, rank: int):
        self.group, self.size, self.rank = group, int(size), int(rank)

    def __deepcopy__(self, memo):  # a process group is not copied: copies of the model (old / reference policies) share it
        return self


def new_groups(size: int) -> SequenceParallel:
    """Split the world into groups of ``size`` consecutive ranks and return this rank's (collective: every rank calls it).

    Consecutive ranks share a node (``diffrl.distributed.ray`` packs ranks node by node), so the all-to-alls stay on
    the node's fast links."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"model.sequence_parallel={size} must divide the world size {world} (ranks = data-parallel groups × sequence_parallel)")
    mine = None
    for start in range(0, world, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    return SequenceParallel(mine, size, rank % size)


# -- collectives with gradients --------------------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """``out[j] = (rank j's input)[my rank]`` along dim 0 (``size`` equal chunks); its own adjoint."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


class _Gather(torch.autograd.Function):
    """All-gather of the group's shards along ``dim``. Every rank uses the gathered tensor the same way (the loss is
    replicated over the group), so the gradient of a rank's shard is its own slice of the gradient (no sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sp: SequenceParallel, dim: int) -> torch.Tensor:
        ctx.sp, ctx.dim = sp, dim
        parts = [torch.empty_like(x) for _ in range(sp.size)]
        dist.all_gather(parts, x.contiguous(), group=sp.group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.sp.size, dim=ctx.dim)[ctx.sp.rank].contiguous(), None, None


def shard(x: torch.Tensor, sp: SequenceParallel, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous ``1/size`` of ``x`` along ``dim``."""
    n = x.shape[dim]
    if n % sp.size:
        raise ValueError(f"model.sequence_parallel={sp.size} must divide the {n} video tokens; valid: {divisors(n)}")
    return x.narrow(dim, sp.rank * (n // sp.size), n // sp.size)


def gather(x: torch.Tensor, sp: SequenceParallel, dim: int = 1) -> torch.Tensor:
    """The group's shards of ``x`` concatenated along ``dim`` (with gradients, :class:`_Gather`)."""
    return _Gather.apply(x, sp, dim)


def sequence_to_heads(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """``[B, S/k, H, D]`` (this rank's tokens, all heads) → ``[B, S, H/k, D]`` (all tokens, this rank's heads)."""
    b, s, h, d = x.shape
    k = sp.size
    x = x.reshape(b, s, k, h // k, d).permute(2, 0, 1, 3, 4)  # [k (head group → its rank), B, S/k, H/k, D]
    x = _AllToAll.apply(x, sp.group)  # [k (token shard ← its rank), B, S/k, H/k, D]
    return x.permute(1, 0, 2, 3, 4).reshape(b, k * s, h // k, d)


def heads_to_sequence(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """``[B, S, H/k, D]`` → ``[B, S/k, H, D]``, the inverse of :func:`sequence_to_heads`."""
    b, s, h, d = x.shape
    k = sp.size
    x = x.reshape(b, k, s // k, h, d).permute(1, 0, 2, 3, 4)  # [k (token shard → its rank), B, S/k, H/k, D]
    x = _AllToAll.apply(x, sp.group)  # [k (head group ← its rank), B, S/k, H/k, D]
    return x.permute(1, 2, 0, 3, 4).reshape(b, s // k, k * h, d)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# -- the Wan transformer ----------------------------------------------------------------------------------------
def _rotate(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding of ``x [B, S, H, D]`` (interleaved pairs; diffusers' ``WanAttnProcessor``)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = freqs_cos[..., 0::2], freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class UlyssesSelfAttention:
    """A Wan self-attention processor (``attn1`` of every block) over a token shard: diffusers' ``WanAttnProcessor``
    for self-attention with the two all-to-alls around scaled dot-product attention."""

    def __init__(self, sp: SequenceParallel):
        self.sp = sp

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states=None, attention_mask=None, rotary_emb=None, **kwargs):
        if encoder_hidden_states is not None or attention_mask is not None or kwargs:
            raise ValueError("sequence-parallel attention serves Wan's self-attention (no text keys, no mask)")
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query, key = _rotate(query, *rotary_emb), _rotate(key, *rotary_emb)
        query, key, value = (sequence_to_heads(x, self.sp).permute(0, 2, 1, 3) for x in (query, key, value))
        out = F.scaled_dot_product_attention(query, key, value, dropout_p=0.0, is_causal=False).permute(0, 2, 1, 3)
        out = heads_to_sequence(out, self.sp).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


class _ShardRotary:
    """Forward hook of ``rope``: this rank's tokens of ``(freqs_cos, freqs_sin)`` ``[1, S, 1, D]``."""

    def __init__(self, sp: SequenceParallel):
        self.sp = sp

    def __call__(self, module, args, output):
        return tuple(shard(f, self.sp, dim=1) for f in output)


class _ShardTokens:
    """Forward pre-hook of the first block: this rank's tokens of ``hidden_states [B, S, C]``."""

    def __init__(self, sp: SequenceParallel):
        self.sp = sp

    def __call__(self, module, args, kwargs):
        if args:
            return (shard(args[0], self.sp, dim=1), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": shard(kwargs["hidden_states"], self.sp, dim=1)}


class _GatherTokens:
    """Forward hook of ``proj_out``: the whole sequence of tokens again, before the unpatchify."""

    def __init__(self, sp: SequenceParallel):
        self.sp = sp

    def __call__(self, module, args, output):
        return gather(output, self.sp, dim=1)


class _CheckInput:
    """Forward pre-hook of the transformer: one timestep per sample (Wan2.2 TI2V's per-token timesteps would need
    their own shard) and a token count the group divides."""

    def __init__(self, sp: SequenceParallel):
        self.sp = sp

    def __call__(self, module, args, kwargs):
        latents = args[0] if args else kwargs["hidden_states"]
        timestep = args[1] if len(args) > 1 else kwargs.get("timestep")
        if timestep is not None and torch.as_tensor(timestep).ndim > 1:
            raise ValueError("model.sequence_parallel > 1 takes one timestep per sample; per-token timesteps (Wan2.2 TI2V) are not split")
        p_t, p_h, p_w = module.config.patch_size
        _, _, f, h, w = latents.shape
        tokens = (f // p_t) * (h // p_h) * (w // p_w)
        if tokens % self.sp.size:
            raise ValueError(f"model.sequence_parallel={self.sp.size} must divide the {tokens} video tokens (latents {tuple(latents.shape[2:])} "
                             f"over patches {(p_t, p_h, p_w)}); valid: {divisors(tokens)}")


def apply_wan(transformer: nn.Module, sp: SequenceParallel) -> nn.Module:
    """Make a diffusers ``WanTransformer3DModel`` run sequence-parallel over ``sp`` (in place; parameters unchanged, so
    LoRA, FSDP2 and checkpoints see the same module)."""
    heads = int(transformer.config.num_attention_heads)
    if heads % sp.size:
        raise ValueError(f"model.sequence_parallel={sp.size} must divide the transformer's {heads} attention heads; valid: {divisors(heads)}")
    for block in transformer.blocks:
        attn = block.attn1
        if getattr(attn, "fused_projections", False) or type(attn.processor).__name__ != "WanAttnProcessor":
            raise ValueError(f"sequence parallelism replaces diffusers' WanAttnProcessor of unfused projections; this block has "
                             f"{type(attn.processor).__name__} (fused: {getattr(attn, 'fused_projections', False)})")
        attn.processor = UlyssesSelfAttention(sp)
    transformer.register_forward_pre_hook(_CheckInput(sp), with_kwargs=True)
    transformer.rope.register_forward_hook(_ShardRotary(sp))
    transformer.blocks[0].register_forward_pre_hook(_ShardTokens(sp), with_kwargs=True)
    transformer.proj_out.register_forward_hook(_GatherTokens(sp))
    return transformer


def check_config(model, sampler, family: type, *, num_workers: int, backend: str) -> None:
    """Refuse ``model.sequence_parallel`` settings that cannot run, before any worker starts: a family that is not a
    video family, a local (one-process) backend, a rank count that the group size does not divide, a group size that
    does not divide the attention heads or the video tokens at ``sampler.height × width`` (read from the family's
    layout without building the model: ``sequence_layout``).

    Args:
        model: the ``ModelConfig`` (``sequence_parallel``, ``family``, ``path``, ``options``).
        sampler: the ``SamplerConfig`` (``height``, ``width``).
        family: the adapter class of ``model.family`` (``pipelines.base.family_class``).
        num_workers, backend: the ranks and where they run (``distributed.num_workers``, ``distributed.backend``).
    """
    k = int(model.sequence_parallel)
    if k == 1:
        return
    layout = getattr(family, "sequence_layout", None)
    if layout is None:
        raise ValueError(f"model.sequence_parallel={k} splits a video's tokens over ranks; model family {model.family!r} is not a video "
                         "family (sequence parallelism: wan, wan22, digits_video); set model.sequence_parallel=1")
    if backend != "ray" or num_workers % k:
        raise ValueError(f"model.sequence_parallel={k} needs ranks in groups of {k}: distributed.backend=ray with distributed.num_workers a "
                         f"multiple of {k} (ranks = data-parallel groups × {k}); got backend={backend} with {num_workers} worker(s)")
    heads, tokens = layout(int(sampler.height), int(sampler.width), **model.adapter_kwargs())  # None: not known here, checked when the model runs
    if heads is not None and heads % k:
        raise ValueError(f"model.sequence_parallel={k} must divide the transformer's {heads} attention heads; valid: {divisors(heads)}")
    if tokens is not None and tokens % k:
        raise ValueError(f"model.sequence_parallel={k} must divide the {tokens} video tokens per sample (no padding: change "
                         f"sampler.height/width or the frames); valid: {divisors(tokens)}")
