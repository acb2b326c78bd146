"""Wan2.2's two experts as one denoiser module.

Wan2.2-A14B splits denoising by noise level between two transformers of one architecture: ``transformer`` (the
high-noise expert) runs every step whose diffusers timestep ``t ≥ boundary_ratio · num_train_timesteps`` and
``transformer_2`` (the low-noise expert) every other step (``WanPipeline.__call__``). :class:`TwoExperts` holds both
as ``high`` and ``low`` and sends **each sample** to its expert by its own timestep, so one module serves a rollout
(every sample at the step's timestep) and a training batch whose samples sit at different noise levels (DPO, NFT,
AWM draw a timestep per sample).

The rest of diffrl sees one ``nn.Module``: the engine's optimizer, FSDP2 (the blocks of both experts), checkpoints
(parameters named ``high.…`` and ``low.…``) and LoRA. LoRA goes through peft like the diffusers models' own
``add_adapter``; the module carries the few adapter calls the engine makes (``add_adapter``, ``set_adapter``,
``disable_adapters``, ``enable_adapters``, ``active_adapters``), so targets may name one expert's modules only
(``model.lora.experts``: full module names such as ``low.blocks.0.attn1.to_q``).

Sharded over ranks (FSDP2), every rank must run the same expert at the same time (the blocks' all-gathers are
collectives): a rollout and a per-step loss do (one timestep per step); timesteps drawn per sample may not (not yet run
on several GPUs).
"""

from __future__ import annotations

import torch
from torch import nn

EXPERTS = ("high", "low")
"""the expert names, in WanPipeline's order: ``high`` = ``transformer``, ``low`` = ``transformer_2``"""


class TwoExperts(nn.Module):
    """The high- and low-noise experts of a Wan2.2 model, dispatched per sample by timestep.

    Args:
        high: the high-noise expert (a ``WanTransformer3DModel``: WanPipeline's ``transformer``).
        low: the low-noise expert (WanPipeline's ``transformer_2``), of the same latent layout.
        boundary_timestep: ``boundary_ratio · num_train_timesteps``; a sample at timestep ``t ≥`` it goes to ``high``.
    """

    _hf_peft_config_loaded = False

    def __init__(self, high: nn.Module, low: nn.Module, boundary_timestep: float):
        super().__init__()
        for key in ("patch_size", "in_channels", "out_channels"):
            a, b = high.config.get(key), low.config.get(key)
            if (list(a) if isinstance(a, (list, tuple)) else a) != (list(b) if isinstance(b, (list, tuple)) else b):
                raise ValueError(f"Wan2.2 experts differ in {key} ({a} vs {b}): transformer and transformer_2 must share the latent layout")
        self.high = high
        self.low = low
        self.boundary_timestep = float(boundary_timestep)

    @property
    def config(self):
        """The high-noise expert's config (patch size, channels: the experts share them)."""
        return self.high.config

    def is_high(self, timestep: torch.Tensor) -> torch.Tensor:
        """Per sample: does the high-noise expert run at ``timestep`` (``t ≥ boundary``, WanPipeline's test)?"""
        return timestep >= self.boundary_timestep

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor, return_dict: bool = True, **kwargs):
        """``WanTransformer3DModel.forward`` of each sample's expert: the whole batch through one expert when every
        timestep falls on one side of the boundary, else each side as its own batch, rows put back in order.

        Args:
            hidden_states: latents ``[B, C, F, h, w]``.
            timestep: diffusers timesteps ``[B]`` (or a scalar for the whole batch).
            encoder_hidden_states: text embeddings ``[B, L, text_dim]``; other keyword arguments pass through (tensors
                with a leading batch dimension are split with the rows).
        """
        batch = hidden_states.shape[0]
        timestep = torch.as_tensor(timestep, device=hidden_states.device)
        if timestep.ndim == 0:
            timestep = timestep.expand(batch)
        if timestep.ndim != 1:
            raise ValueError(f"Wan2.2 experts take one timestep per sample ([B]), got shape {tuple(timestep.shape)}")
        high = self.is_high(timestep)
        if bool(high.all()) or not bool(high.any()):
            expert = self.high if bool(high.all()) else self.low
            return expert(hidden_states=hidden_states, timestep=timestep, encoder_hidden_states=encoder_hidden_states, return_dict=return_dict, **kwargs)
        rows = [high.nonzero().squeeze(1), (~high).nonzero().squeeze(1)]
        outs = []
        for expert, r in zip((self.high, self.low), rows):
            extra = {k: v[r] if torch.is_tensor(v) and v.ndim and v.shape[0] == batch else v for k, v in kwargs.items()}
            outs.append(expert(hidden_states=hidden_states[r], timestep=timestep[r], encoder_hidden_states=encoder_hidden_states[r],
                               return_dict=False, **extra)[0])
        sample = torch.cat(outs)[torch.argsort(torch.cat(rows))]
        if not return_dict:
            return (sample,)
        from diffusers.models.modeling_outputs import Transformer2DModelOutput

        return Transformer2DModelOutput(sample=sample)

    # -- the peft adapter calls of the engine (diffusers' PeftAdapterMixin names) ----------------------------------
    def _tuner_layers(self) -> list[nn.Module]:
        from peft.tuners.tuners_utils import BaseTunerLayer

        return [m for m in self.modules() if isinstance(m, BaseTunerLayer)]

    def _check_loaded(self) -> None:
        if not self._hf_peft_config_loaded:
            raise ValueError("the Wan2.2 experts carry no LoRA adapter; attach one first (add_adapter)")

    def add_adapter(self, adapter_config, adapter_name: str = "default") -> None:
        """Inject a peft adapter into the modules ``adapter_config.target_modules`` names (suffixes match in both
        experts; full names such as ``low.blocks.0.attn1.to_q`` in one) and make it the active one."""
        from peft import inject_adapter_in_model

        if self._hf_peft_config_loaded and adapter_name in self.peft_config:
            raise ValueError(f"adapter {adapter_name!r} already exists on the Wan2.2 experts")
        inject_adapter_in_model(adapter_config, self, adapter_name)
        self._hf_peft_config_loaded = True
        self.set_adapter(adapter_name)

    def set_adapter(self, adapter_name: str | list[str]) -> None:
        self._check_loaded()
        names = [adapter_name] if isinstance(adapter_name, str) else list(adapter_name)
        missing = sorted(set(names) - set(self.peft_config))
        if missing:
            raise ValueError(f"adapter(s) {missing} do not exist on the Wan2.2 experts; adapters: {sorted(self.peft_config)}")
        for layer in self._tuner_layers():
            layer.set_adapter(names)

    def disable_adapters(self) -> None:
        self._check_loaded()
        for layer in self._tuner_layers():
            layer.enable_adapters(enabled=False)

    def enable_adapters(self) -> None:
        self._check_loaded()
        for layer in self._tuner_layers():
            layer.enable_adapters(enabled=True)

    def active_adapters(self) -> list[str]:
        self._check_loaded()
        layers = self._tuner_layers()
        return list(layers[0].active_adapters) if layers else []


__all__ = ["EXPERTS", "TwoExperts"]
