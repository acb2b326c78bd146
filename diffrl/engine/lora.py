"""LoRA policy states on one denoiser: ``"default"`` (trained), ``"old"`` (copy/EMA), reference = disabled.

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
    """Attach a peft LoRA adapter (B initialised to zero, so the model's output is unchanged)."""
    from peft import LoraConfig

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules), init_lora_weights=True)
    module.add_adapter(config, adapter_name=adapter_name)
    if not any(f".{adapter_name}." in n or n.endswith(f".{adapter_name}") for n, _ in module.named_parameters()):
        raise RuntimeError(f"LoRA attached to no module of {type(module).__name__}; target_modules={target_modules}")


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
    """``target ← decay·target + (1 − decay)·source``."""
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"EMA decay must be in [0, 1], got {decay}")
    _ensure_adapter(module, source, target)
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
        module.set_adapter(active[0] if len(active) == 1 else active)
        for p in adapter_parameters(module, target).values():
            p.requires_grad_(False)
