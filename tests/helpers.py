"""Small builders the tests share."""

from __future__ import annotations

from diffrl.config import LoraConfig, ModelConfig, OptimConfig, SamplerConfig
from diffrl.engine.engine import DiffusionEngine


def make_engine(adapter, sampler: SamplerConfig, *, lora_rank: int = 8, lora_alpha: float = 16.0, lora_target_modules=None,
                micro_batch_size: int | None = None, optim: OptimConfig | None = None, **model_options) -> DiffusionEngine:
    """A ``DiffusionEngine`` over ``adapter`` with the given LoRA and model settings (``ModelConfig`` fields)."""
    model = ModelConfig(lora=LoraConfig(rank=lora_rank, alpha=lora_alpha, target_modules=lora_target_modules), **model_options)
    return DiffusionEngine(adapter, model=model, optim=optim or OptimConfig(), sampler=sampler, micro_batch_size=micro_batch_size)
