"""The model-adapter protocol: everything diffrl's samplers, losses and workers need from a family.

A family is plugged in once by subclassing :class:`ModelAdapter` and registering it with
:func:`register_family`. Rollout and training both call the same :meth:`ModelAdapter.predict` on the
same ``denoiser`` module, so log-probs recorded during sampling and recomputed in training agree.

Conventions (DESIGN.md): ``sigma ∈ [0, 1]`` with 1 = pure noise, ``x_σ = (1 − σ)·x0 + σ·ε``, velocity
``v = ε − x0``; diffusers' "timestep" is ``1000·σ`` and appears only inside ``predict``.
"""

from __future__ import annotations

import abc
from typing import Callable

import torch
from tensordict import TensorDict
from torch import nn

from diffrl.schedules import shifted_sigmas

_FAMILIES: dict[str, Callable[..., "ModelAdapter"]] = {}


class ModelAdapter(abc.ABC):
    """One model family over diffusers components.

    Attributes:
        prediction_type: ``"flow"`` (velocity) or ``"epsilon"``.
        denoiser: the ``nn.Module`` that LoRA wraps and the optimizer trains.
        lora_target_modules: module-name suffixes that LoRA attaches to.
        shift: the family's default sigma-schedule shift.
    """

    prediction_type: str = "flow"
    lora_target_modules: list[str] = []
    shift: float = 1.0
    denoiser: nn.Module

    @abc.abstractmethod
    def encode_prompts(self, prompts: list[str]) -> TensorDict:
        """Text conditioning for ``prompts`` as a TensorDict with batch size ``[len(prompts)]``.

        It holds the positive embeddings and the negative (unconditional) ones used by CFG.
        """

    @abc.abstractmethod
    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """Shape of one latent (no batch dim) for an image of ``height × width`` pixels."""

    @abc.abstractmethod
    def predict(self, latents: torch.Tensor, sigma: torch.Tensor, cond: TensorDict, guidance_scale: float) -> torch.Tensor:
        """Model output for ``latents [B, …]`` at noise level ``sigma [B]``, CFG applied inside.

        With ``guidance_scale > 1`` the conditional and unconditional branches run as one batched
        forward and the unconditional output is detached; with ``guidance_scale == 1`` the
        unconditional branch is not run at all.
        """

    @abc.abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, …]`` → float images ``[B, 3, H, W]`` in [0, 1] (video families: frames
        ``[B, F, 3, H, W]``; rewards then score frames, see ``rewards.base.call_reward``)."""

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Float images ``[B, 3, H, W]`` in [0, 1] → latents (the VAE encoder's mean); offline
        preference pairs need it. Families without an image encoder raise ``ValueError``."""
        raise ValueError(f"model family {type(self).__name__} cannot encode images into latents (no image encoder)")

    def fsdp_blocks(self) -> list[nn.Module]:
        """The denoiser's repeated blocks, each its own FSDP2 unit (transformer blocks; UNet stages)."""
        d = self.denoiser
        blocks = [*getattr(d, "transformer_blocks", []), *getattr(d, "single_transformer_blocks", [])]
        if not blocks and hasattr(d, "down_blocks"):
            blocks = [*d.down_blocks, d.mid_block, *d.up_blocks]
        return blocks

    def default_prompts(self) -> list[str] | None:
        """The family's built-in prompt set (used when ``trainer.prompts`` is not given), or None."""
        return None

    def schedule(self, num_steps: int, shift: float | None = None, *, height: int | None = None, width: int | None = None) -> torch.Tensor:
        """Sigmas ``[num_steps + 1]`` from 1 to 0 with the family's shift (or ``shift``).

        ``height``/``width`` (pixels) are the image size, for families whose shift depends on it (FLUX's
        dynamic shift); a static-shift family ignores them."""
        return shifted_sigmas(num_steps, self.shift if shift is None else shift)

    @property
    def device(self) -> torch.device:
        return next(self.denoiser.parameters()).device

    @staticmethod
    def combine_guidance(output: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """``output`` is ``[uncond; cond]`` stacked on the batch dim → ``u + g·(c − u)``, u detached."""
        uncond, cond = output.chunk(2)
        uncond = uncond.detach()
        return uncond + guidance_scale * (cond - uncond)


# built-in families whose module is not ``pipelines.<family>``
_FAMILY_MODULES = {"digits_eps": "pipelines.digits.eps"}


def register_family(name: str):
    """Class decorator: make a family buildable by name from config (``model.family=<name>``)."""

    def wrap(cls):
        _FAMILIES[name] = cls
        return cls

    return wrap


def build_adapter(family: str, **kwargs) -> ModelAdapter:
    """Build the adapter of ``family`` (``path=None`` builds the family's tiny random configuration)."""
    if family not in _FAMILIES:
        # families register on import; import the built-in ones lazily so the core stays model-agnostic
        import importlib

        try:
            importlib.import_module(_FAMILY_MODULES.get(family, f"pipelines.{family}"))
        except ModuleNotFoundError:
            pass
    if family not in _FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known families: {sorted(_FAMILIES)} (set model.family=…)")
    cls = _FAMILIES[family]
    import inspect

    params = inspect.signature(cls.__init__).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(kwargs) - set(params))
        if unknown:
            valid = sorted(k for k in params if k != "self")
            raise ValueError(f"model family {family!r} takes no option(s) {unknown}; its options are {valid} (model.options.<name>=…)")
    return cls(**kwargs)
