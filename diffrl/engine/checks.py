"""The model's config checks (``model.*``: the LoRA experts against the family's adapter options, the device), run by
``diffrl.recipes.validate`` before anything is built."""

from __future__ import annotations

import torch

from diffrl.config import ConfigError, ModelConfig
from diffrl.engine.lora import check_lora_experts
from pipelines.base import check_adapter_options


def validate_model(m: ModelConfig) -> None:
    """Raise a one-line :class:`~diffrl.config.ConfigError` naming the ``model.*`` key, its value and what is valid."""
    try:
        check_lora_experts(m.lora.experts, check_adapter_options(m.family, m.adapter_kwargs()), m.family)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        device = torch.device(m.device)
    except RuntimeError as exc:
        raise ConfigError(f"model.device={m.device!r} is invalid: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"model.device={m.device!r} is invalid: torch sees no CUDA device here (use model.device=cpu)")


__all__ = ["validate_model"]
