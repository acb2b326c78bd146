"""The model's config checks (``model.*``: the LoRA experts against the family's, the device), run by
``diffrl.recipes.validate`` before anything is built, on the family's adapter class that ``diffrl.run_parts`` resolved
(with the options ``model.*`` gives it checked)."""

from __future__ import annotations

import torch

from diffrl.config import ConfigError, ModelConfig
from diffrl.engine.lora import check_lora_experts


def validate_model(m: ModelConfig, family: type) -> None:
    """Raise a one-line :class:`~diffrl.config.ConfigError` naming the ``model.*`` key, its value and what is valid
    (``family``: the adapter class of ``model.family``, ``diffrl.run_parts.RunParts.family``)."""
    try:
        check_lora_experts(m.lora.experts, family, m.family)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        device = torch.device(m.device)
    except RuntimeError as exc:
        raise ConfigError(f"model.device={m.device!r} is invalid: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"model.device={m.device!r} is invalid: torch sees no CUDA device here (use model.device=cpu)")


__all__ = ["validate_model"]
