"""LoRA policy states on one denoiser: ``"default"`` (trained), ``"old"`` (copy/EMA), ``"ema"`` (the evaluated EMA,
``eval.ema``), reference = disabled.

The reference policy is the same module with every adapter disabled, so no second copy of the model
exists. ``copy_adapter`` and ``ema_update_adapter`` keep a second adapter (DiffusionNFT's old policy).
Adapters are peft LoRA layers attached through diffusers' ``add_adapter``.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

import torch
from torch import nn


def attach_lora(module: nn.Module, *, rank: int, alpha: float, dropout: float, target_modules: list[str], adapter_name: str = "default") -> None:
    """Attach a peft LoRA adapter (B initialised to zero, so the model's output is unchanged), in fp32 whatever the
    base's dtype (:func:`adapter_to_float32`)."""
    from peft import LoraConfig

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules), init_lora_weights=True)
    module.add_adapter(config, adapter_name=adapter_name)
    if not any(f".{adapter_name}." in n or n.endswith(f".{adapter_name}") for n, _ in module.named_parameters()):
        raise RuntimeError(f"LoRA attached to no module of {type(module).__name__}; target_modules={target_modules}")
    adapter_to_float32(module, adapter_name)


def adapter_to_float32(module: nn.Module, adapter_name: str) -> None:
    """Upcast the LoRA parameters of ``adapter_name`` to fp32 (exact). peft creates an adapter in its base weight's dtype
    and upcasts it only when asked (``autocast_adapter_dtype``, which diffusers' ``add_adapter`` does not pass), so on a
    bf16 base the adapters, their AdamW steps and EMAs would be bf16, and a small update would round away. peft's layers
    cast the input to the adapter's dtype and the sum back to the base's, so the base's compute stays bf16."""
    for p in adapter_parameters(module, adapter_name).values():
        if p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.float()


def check_lora_experts(experts, adapter_class: type, family: str | None = None) -> None:
    """``model.lora.experts`` against the family's experts (``adapter_class.experts``: the names a family of several
    experts declares, e.g. wan22's ``("high", "low")``): ``None`` always passes; for a family without experts, an empty
    list or an unknown name, a one-line ``ValueError`` names the key and the valid values."""
    if experts is None:
        return
    name = repr(family) if family else adapter_class.__name__
    valid = list(getattr(adapter_class, "experts", ()) or ())
    if not valid:
        raise ValueError(f"model.lora.experts={list(experts)} is invalid: model family {name} has one denoiser, no experts "
                         "(two-expert families: wan22); set model.lora.experts=null")
    unknown = [e for e in experts if e not in valid]
    if unknown or not list(experts):
        raise ValueError(f"model.lora.experts={list(experts)} is invalid: the experts of model family {name} are {valid}; "
                         "give some of them, or null for all")


def lora_targets(adapter, target_modules: list[str] | None = None, experts: list[str] | None = None) -> list[str]:
    """The peft ``target_modules`` of a LoRA on ``adapter.denoiser``: ``target_modules`` (null: the family's
    ``lora_target_modules``); with ``experts`` (``model.lora.experts``) only the named experts' modules, as the
    family resolves them (``adapter.expert_lora_targets(targets, experts)``: full module names)."""
    targets = list(target_modules or adapter.lora_target_modules)
    if experts is None:
        return targets
    check_lora_experts(experts, type(adapter))
    return list(adapter.expert_lora_targets(targets, list(experts)))


def has_lora(module: nn.Module) -> bool:
    return getattr(module, "_hf_peft_config_loaded", False) or hasattr(module, "peft_config")


def adapter_parameters(module: nn.Module, adapter_name: str) -> dict[str, nn.Parameter]:
    """The LoRA parameters of ``adapter_name``, keyed by their module name."""
    key = f".{adapter_name}."
    return {n: p for n, p in module.named_parameters() if ("lora_A" in n or "lora_B" in n) and key in n + "."}


@contextlib.contextmanager
def adapters_disabled(module: nn.Module) -> Iterator[None]:
    """Run ``module`` as the base model (every LoRA adapter off), then restore the active adapter."""
    if not has_lora(module):
        yield
        return
    module.disable_adapters()
    try:
        yield
    finally:
        module.enable_adapters()


@contextlib.contextmanager
def adapter_active(module: nn.Module, name: str, restore: str = "default") -> Iterator[None]:
    """Run ``module`` with LoRA adapter ``name`` active (e.g. DiffusionNFT's ``"old"`` policy), then
    re-activate ``restore``. peft makes the active adapter's parameters trainable, so ``restore``'s
    ``requires_grad`` flags come back with it."""
    configs = getattr(module, "peft_config", {})
    if name not in configs:
        raise ValueError(f"adapter {name!r} does not exist; adapters: {sorted(configs)} (call copy_adapter first)")
    module.set_adapter(name)
    try:
        yield
    finally:
        module.set_adapter(restore)
        for n, p in module.named_parameters():
            if "lora_" in n and f".{restore}." not in n + ".":
                p.requires_grad_(False)


def ensure_adapter(module: nn.Module, name: str, source: str = "default") -> None:
    """Create adapter ``name`` as a frozen copy of ``source`` unless it exists."""
    if name not in getattr(module, "peft_config", {}):
        copy_adapter(module, source, name)


def copy_adapter(module: nn.Module, source: str = "default", target: str = "old") -> None:
    """``target ← source`` (creates ``target`` with the source's LoRA config if missing; frozen)."""
    _ensure_adapter(module, source, target)
    src, dst = adapter_parameters(module, source), adapter_parameters(module, target)
    with torch.no_grad():
        for name, p in src.items():
            dst[name.replace(f".{source}.", f".{target}.")].copy_(p)


def ema_update_adapter(module: nn.Module, source: str = "default", target: str = "old", decay: float = 0.0) -> None:
    """``target ← decay·target + (1 − decay)·source``; a missing ``target`` is created as a copy of ``source``
    (a fresh adapter's random ``lora_A`` must not enter the average)."""
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"EMA decay must be in [0, 1], got {decay}")
    if target not in getattr(module, "peft_config", {}):
        copy_adapter(module, source, target)
        return
    src, dst = adapter_parameters(module, source), adapter_parameters(module, target)
    with torch.no_grad():
        for name, p in src.items():
            dst[name.replace(f".{source}.", f".{target}.")].mul_(decay).add_(p, alpha=1.0 - decay)


def _ensure_adapter(module: nn.Module, source: str, target: str) -> None:
    configs = getattr(module, "peft_config", {})
    if source not in configs:
        raise ValueError(f"adapter {source!r} does not exist; adapters: {sorted(configs)}")
    if target not in configs:
        active = list(module.active_adapters()) if hasattr(module, "active_adapters") else [source]
        with warnings.catch_warnings():  # peft warns that a second adapter is being added: that is the point
            warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
            module.add_adapter(configs[source], adapter_name=target)
        adapter_to_float32(module, target)
        module.set_adapter(active[0] if len(active) == 1 else active)
        for p in adapter_parameters(module, target).values():
            p.requires_grad_(False)


class FusedWeights:
    """The active LoRA adapter folded into the base weights, for gradient-free calls (rollouts): each LoRA
    layer then runs one matmul with ``W + scale·B·A`` instead of the base matmul plus the two thin LoRA
    matmuls and the add (diffusers' ``fuse_lora`` for inference, undone exactly after).

    :meth:`fused` fills persistent buffers (one per LoRA layer, the size of its base weight, allocated on the
    first call) with ``W + Σ_active scale·B·A`` computed in float32 and rounded once to the weight's dtype,
    points each base weight at its buffer, and marks the layer merged so that peft's forward skips the LoRA
    path. On exit every base weight points at its own, untouched tensor again: nothing is subtracted, so the
    base weights never drift. The buffers keep their addresses across calls, so CUDA graphs recorded on them
    stay valid. The cost is memory: one copy of every LoRA-targeted weight.

    Output differs from the unfused path by the rounding of the fused weight (a bf16 model's rollout
    log-probs then differ from the training pass's; ``benchmarks/speed/gpu_scale.py --fuse-lora`` measures it).
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.buffers: dict[int, torch.Tensor] = {}

    def layers(self) -> list[nn.Module]:
        from peft.tuners.lora import LoraLayer

        return [m for m in self.module.modules() if isinstance(m, LoraLayer) and isinstance(m.get_base_layer(), nn.Linear)]

    @contextlib.contextmanager
    def fused(self) -> Iterator[None]:
        if torch.is_grad_enabled():
            raise RuntimeError("LoRA weights are fused for gradient-free calls only (rollouts); run them under torch.no_grad()")
        touched = []
        try:
            for layer in self.layers():
                if layer.disable_adapters or layer.merged:
                    continue
                active = [a for a in layer.active_adapters if a in layer.lora_A]
                if not active:
                    continue
                weight = layer.get_base_layer().weight
                if type(weight.data) is not torch.Tensor:
                    raise ValueError("model.fuse_lora_rollout needs whole weights; it cannot fuse sharded (FSDP2) parameters, turn it off with distributed.num_workers > 1")
                buf = self.buffers.get(id(layer))
                if buf is None:
                    buf = self.buffers[id(layer)] = torch.empty_like(weight.data)
                total = weight.data.float()
                for a in active:
                    total = total.addmm(layer.lora_B[a].weight.float(), layer.lora_A[a].weight.float(), alpha=float(layer.scaling[a]))
                buf.copy_(total)
                touched.append((layer, weight, weight.data))
                weight.data = buf
                layer.merged_adapters = list(active)
            yield
        finally:
            for layer, weight, original in touched:
                weight.data = original
                layer.merged_adapters = []
