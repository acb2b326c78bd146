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
from collections.abc import Iterator

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


@contextlib.contextmanager
def fp8_linears(module: nn.Module, kernel: str = "auto") -> Iterator[int]:
    """Run ``module``'s linear layers (:func:`fp8_layers`) in FP8 inside the context (gradient-free calls only); the
    weights are quantised on entry, from their current values (LoRA adapters folded in, :func:`effective_weight`),
    and every layer's own forward is restored on exit. Yields the number of layers."""
    if torch.is_grad_enabled():
        raise RuntimeError("FP8 rollouts are for gradient-free calls (rollouts) only; run them under torch.no_grad()")
    layers = fp8_layers(module)
    chosen = pick_kernel(kernel, next(layers[0].parameters()).device) if layers else "emulate"
    try:
        for layer in layers:
            w, b = effective_weight(layer)
            scale = rowwise_scale(w)
            q = quantize(w, scale)
            del w
            # the FP8 tensor cores take sizes in multiples of 16; another layer gets the same formula emulated
            own = chosen if chosen == "emulate" or (q.shape[1] % 16 == 0 and q.shape[0] % 16 == 0) else "emulate"

            def forward(x, *args, q=q, scale=scale, b=b, own=own, **kwargs):
                return fp8_linear(x, q, scale, b, own)

            layer.forward = forward  # an instance attribute shadows the class's forward until it is deleted
        yield len(layers)
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
