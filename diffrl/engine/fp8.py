"""FP8 rollouts: the denoiser's linear layers in float8 (e4m3) for gradient-free sampling, training in the model's dtype.

Recipe (rowwise, as torchao's float8 "rowwise" and ``torch._scaled_mm``'s rowwise mode): each weight row (output
channel) and each activation row (token) gets its own scale ``s = amax(|row|) / 448`` (448 = e4m3's largest finite
value); the operand is stored as ``q = e4m3(x / s)`` (round to nearest, saturated at ±448) and the product is
``y = (q_x · s_x) @ (q_w · s_w)ᵀ + b``, accumulated in float32 and returned in the input's dtype.

Two kernels compute it: ``scaled_mm`` (``torch._scaled_mm`` with rowwise scales: FP8 tensor cores on an H100/H200, and
torch's CPU implementation) and ``emulate`` (the same quantised operands dequantised and multiplied in float32: exactly
the formula, on any device). ``auto`` takes ``scaled_mm`` on a CUDA device of compute capability ≥ 8.9, else ``emulate``.

A LoRA layer (peft's, over a linear) runs as one FP8 linear whose weight is ``W + Σ_active scale·B·A`` folded in float32
before the quantisation (the fold ``model.fuse_lora_rollout`` does in bf16, here with no bf16 copy kept: the FP8 weight
is the only copy the rollout reads), so an FP8 rollout runs no thin LoRA matmuls and needs no fused buffers.

The rollout then samples from a slightly different policy than the one trained (the FP8 one): the trainer marks the
trained policy as the proximal policy of the loss's truncated importance weights (``trainer.py``, the same correction
as stale rollout replicas), so the update stays on-policy for the model-precision policy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn

E4M3_MAX = 448.0
FP8 = torch.float8_e4m3fn
KERNELS = ("auto", "emulate", "scaled_mm")


def rowwise_scale(x: torch.Tensor) -> torch.Tensor:
    """``amax(|x|) / 448`` over the last dimension, float32 ``[..., 1]`` (a zero row gets scale 1)."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float()
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``e4m3(x / scale)``, saturated at ±448 (float8 ``[...]``)."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def fp8_linear(x: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, kernel: str) -> torch.Tensor:
    """``x @ Wᵀ + b`` with both operands in e4m3 and rowwise scales (module docstring).

    Args:
        x: ``[..., in]`` activations (any float dtype); the output has its dtype.
        weight_q: ``[out, in]`` float8 weight; weight_scale: ``[out, 1]`` float32.
        kernel: ``emulate`` or ``scaled_mm``.
    """
    rows = x.reshape(-1, x.shape[-1])
    x_scale = rowwise_scale(rows)
    x_q = quantize(rows, x_scale)
    if kernel == "scaled_mm":
        # CUDA's rowwise-scaled kernel writes bfloat16 only (accumulating in float32); torch's CPU kernel writes float32.
        # The bias goes into the kernel's epilogue (added to the float32 accumulator before the one rounding): adding it
        # afterwards is another pass over the output, which at a rollout's token counts costs most of what FP8 saves
        out_dtype = torch.bfloat16 if x_q.is_cuda else torch.float32
        out = torch._scaled_mm(x_q, weight_q.t(), scale_a=x_scale, scale_b=weight_scale.t().contiguous(),
                               bias=None if bias is None else bias.to(out_dtype), out_dtype=out_dtype)
    else:
        out = (x_q.float() * x_scale) @ (weight_q.float() * weight_scale).t()
        if bias is not None:
            out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], weight_q.shape[0])


def pick_kernel(kernel: str, device: torch.device) -> str:
    if kernel not in KERNELS:
        raise ValueError(f"model.rollout_fp8_kernel={kernel!r} is invalid: it must be one of {', '.join(KERNELS)}")
    if kernel != "auto":
        return kernel
    fast = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    return "scaled_mm" if fast else "emulate"


def lora_layer_class():
    """peft's ``LoraLayer`` (``None`` without peft)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover - peft is a dependency; a bare module has no LoRA layers
        return None
    return LoraLayer


def fp8_layers(module: nn.Module) -> list[nn.Module]:
    """The layers of ``module`` that run in FP8: every peft LoRA layer over an ``nn.Linear`` (its adapters folded into
    the FP8 weight, :func:`effective_weight`) and every other ``nn.Linear`` that is neither such a layer's base nor
    LoRA's own thin ``lora_A``/``lora_B``."""
    lora_cls = lora_layer_class()
    out, bases = [], set()
    for name, layer in module.named_modules():  # a parent comes before its children
        if lora_cls is not None and isinstance(layer, lora_cls) and isinstance(layer.get_base_layer(), nn.Linear):
            out.append(layer)
            bases.add(id(layer.get_base_layer()))
        elif isinstance(layer, nn.Linear) and id(layer) not in bases and not any(p.startswith("lora_") for p in name.split(".")) \
                and layer.weight.dim() == 2:
            out.append(layer)
    return out


def effective_weight(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight, bias)`` that ``layer`` computes with: a plain linear's own; a LoRA layer's base weight plus
    ``Σ scale·B·A`` over its active adapters in float32 (none when its adapters are disabled, the reference policy,
    or already merged into the base weight, ``model.fuse_lora_rollout``)."""
    base = layer.get_base_layer() if hasattr(layer, "get_base_layer") else layer
    weight = base.weight.detach()
    if base is layer or layer.disable_adapters or layer.merged:
        return weight, base.bias
    active = [a for a in layer.active_adapters if a in layer.lora_A]
    if any(getattr(layer, "use_dora", {}).get(a, False) for a in active):
        raise ValueError("model.rollout_precision=fp8 folds LoRA adapters into the FP8 weight; DoRA adapters cannot be folded so")
    total = weight.float()
    for a in active:
        total = total.addmm(layer.lora_B[a].weight.detach().float(), layer.lora_A[a].weight.detach().float(), alpha=float(layer.scaling[a]))
    return total, base.bias


@dataclasses.dataclass(eq=False)
class Fp8Weight:
    """One layer's persistent FP8 weight: the buffers its rollout forward reads, and that forward.

    Allocated on the layer's first FP8 rollout and refilled in place on every later one (:func:`fp8_linears`), so the
    tensors' addresses and the forward function object stay the same from one rollout to the next."""

    q: torch.Tensor  # [out, in] float8 e4m3: the quantised effective weight
    scale: torch.Tensor  # [out, 1] float32: its rowwise scales
    bias: torch.Tensor | None  # the layer's (or its base layer's) own bias parameter, read at call time
    kernel: str  # ``emulate`` or ``scaled_mm``
    forward: Callable[..., torch.Tensor]  # installed as the layer's instance ``forward`` inside the context

    def fits(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str) -> bool:
        """Whether these buffers can hold ``weight`` (or its quantised copy) for ``kernel`` (same shape, device and bias;
        else reallocate)."""
        return self.q.shape == weight.shape and self.q.device == weight.device and self.bias is bias and self.kernel == kernel

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes


_WEIGHTS: weakref.WeakKeyDictionary[nn.Module, Fp8Weight] = weakref.WeakKeyDictionary()
"""layer → its :class:`Fp8Weight`, dying with the layer (kept off the module, so ``copy.deepcopy``, ``state_dict`` and
``.to()`` never see the buffers; a deep copy of the model gets buffers of its own on its own first FP8 rollout)"""


def fp8_weight(layer: nn.Module) -> Fp8Weight | None:
    """``layer``'s persistent FP8 weight (``None`` before its first FP8 rollout or after :func:`release_fp8_buffers`)."""
    return _WEIGHTS.get(layer)


def release_fp8_buffers(module: nn.Module) -> int:
    """Free the persistent FP8 weights of ``module``'s layers (outside :func:`fp8_linears` only); the next FP8 rollout
    allocates them again. Returns the bytes released."""
    freed = 0
    for layer in module.modules():
        state = _WEIGHTS.get(layer)
        if state is None:
            continue
        if layer.__dict__.get("forward") is state.forward:
            raise RuntimeError("release_fp8_buffers was called inside fp8_linears: the rollout's layers still read the FP8 buffers")
        freed += state.nbytes
        del _WEIGHTS[layer]
    return freed


def _new_state(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, kernel: str) -> Fp8Weight:
    """A layer's :class:`Fp8Weight` holding the freshly quantised ``q`` and ``scale`` themselves (no copy)."""
    mark_static = getattr(getattr(torch, "_dynamo", None), "mark_static_address", None)
    if q.is_cuda and mark_static is not None:
        # CUDA graph trees read static inputs in place (as they do parameters) instead of copying them into the graph's
        # own inputs on every replay; the addresses never change, so no graph is re-recorded either
        mark_static(q)
        mark_static(scale)

    def forward(x, *args, q=q, scale=scale, b=bias, own=kernel, **kwargs):
        return fp8_linear(x, q, scale, b, own)

    return Fp8Weight(q, scale, bias, kernel, forward)


@contextlib.contextmanager
def fp8_linears(module: nn.Module, kernel: str = "auto", keep_buffers: bool = False) -> Iterator[int]:
    """Run ``module``'s linear layers (:func:`fp8_layers`) in FP8 inside the context (gradient-free calls only); the
    weights are quantised on entry, from their current values (LoRA adapters folded in, :func:`effective_weight`),
    and every layer's own forward is restored on exit. Yields the number of layers.

    Persistent buffers (for compiled rollouts and CUDA graphs): a layer's first entry allocates its FP8 weight and
    scales (:class:`Fp8Weight`) and one forward function that reads them; every later entry quantises into the same
    buffers in place and installs the same function again. Dynamo guards the installed forward by its code object and
    takes the buffers as graph inputs (so fresh tensors every rollout recompiled nothing either); CUDA graphs
    (``model.compile_mode=reduce-overhead``) are what the fixed addresses are for: the buffers are marked static
    addresses on CUDA, so the graphs read them in place, as they do parameters, instead of copying fresh tensors into
    their own inputs on every replay or re-recording. A change of the layer's weight shape, device, bias or kernel
    reallocates its buffers.

    On exit the instance ``forward`` is removed (as before), rather than kept installed with a fallback to the
    layer's own forward: the gradient calls (training) then trace and run exactly the model's own code, with no FP8
    branch in it, and each of the two variants (the layer's own forward, the FP8 one) stays in dynamo's cache, found
    again on the next call of its kind without recompiling (checked with a counting backend, tests/test_fp8.py).

    Memory: with ``keep_buffers`` the FP8 copy, 1 byte per weight plus 4 bytes per output row, stays allocated between
    rollouts, training included (about 2.5 GB for SD3.5-Medium's 2.5 B parameters, 20 GB for Qwen-Image's 20 B: kept, it
    ran Qwen-Image's LoRA recipe out of memory on an 80 GB H100 in training); :func:`release_fp8_buffers` frees it.
    Without (the default) it is freed on every exit, as before the buffers persisted, at the cost of new addresses,
    hence re-recorded graphs, every rollout: the engine keeps them only with ``model.compile_mode=reduce-overhead``."""
    if torch.is_grad_enabled():
        raise RuntimeError("FP8 rollouts are for gradient-free calls (rollouts) only; run them under torch.no_grad()")
    layers = fp8_layers(module)
    chosen = pick_kernel(kernel, next(layers[0].parameters()).device) if layers else "emulate"
    try:
        for layer in layers:
            w, b = effective_weight(layer)
            # the FP8 tensor cores take sizes in multiples of 16; another layer gets the same formula emulated
            own = chosen if chosen == "emulate" or (w.shape[1] % 16 == 0 and w.shape[0] % 16 == 0) else "emulate"
            scale = rowwise_scale(w)
            q = quantize(w, scale)
            del w
            state = _WEIGHTS.get(layer)
            if state is None or not state.fits(q, b, own):
                state = _WEIGHTS[layer] = _new_state(q, scale, b, own)  # first entry, or freed on the last exit: no copy
            else:  # kept buffers: refilled in place (same addresses)
                state.scale.copy_(scale)
                state.q.copy_(q)
            del q, scale
            layer.forward = state.forward  # an instance attribute shadows the class's forward until it is deleted
        yield len(layers)
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
        if not keep_buffers:
            release_fp8_buffers(module)
