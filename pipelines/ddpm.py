"""DDPM noise schedules for epsilon-prediction families (SD1.5, the digits epsilon UNet).

The convention for epsilon models (docs/architecture.md): ``sigma = √(1 − ᾱ_t)`` in [0, 1] with ``x_t = √(1 − σ²)·x0 + σ·ε``.
Samplers see noise levels only; the diffusers timestep ``t`` is looked up from ``sigma`` inside the
adapter's ``predict`` (:meth:`DDPMSchedule.timestep`).
"""

from __future__ import annotations

import torch


def alphas_cumprod(config: dict) -> torch.Tensor:
    """ᾱ_t of the DDPM schedule in ``config`` (``scaled_linear`` or ``linear`` betas), fp64.

    ``linear``: β_t evenly spaced in [beta_start, beta_end] (DDPM, Ho et al. 2020); ``scaled_linear``: √β
    evenly spaced (Stable Diffusion); ``ᾱ_t = Π_{s≤t} (1 − β_s)``.
    """
    n, b0, b1 = config["num_train_timesteps"], config["beta_start"], config["beta_end"]
    if config.get("beta_schedule", "linear") == "scaled_linear":
        betas = torch.linspace(b0**0.5, b1**0.5, n, dtype=torch.float64) ** 2
    elif config["beta_schedule"] == "linear":
        betas = torch.linspace(b0, b1, n, dtype=torch.float64)
    else:
        raise ValueError(f"unsupported beta_schedule {config['beta_schedule']!r} (scaled_linear or linear)")
    return torch.cumprod(1 - betas, 0)


class DDPMSchedule:
    """Mixin: DDIM sampling schedule and timestep lookup on a DDPM ᾱ table (diffusers' DDIMScheduler).

    Call :meth:`_init_schedule` with a diffusers scheduler config dict (``num_train_timesteps``,
    ``beta_start``, ``beta_end``, ``beta_schedule``, ``steps_offset``, ``set_alpha_to_one``).
    """

    scheduler_config: dict

    def _init_schedule(self, config: dict) -> None:
        self.scheduler_config = dict(config)
        self._abar = alphas_cumprod(self.scheduler_config)
        self._sigma_table = torch.sqrt(1 - self._abar).float()  # σ of each training timestep, increasing in t

    def schedule(self, num_steps: int, shift: float | None = None, *, height: int | None = None, width: int | None = None) -> torch.Tensor:
        """DDIM's ``leading`` timesteps ``t_i = i·(T/K) + offset`` as noise levels, then the final level
        (``√(1 − ᾱ_0)``, or 0 with ``set_alpha_to_one``): ``[num_steps + 1]`` decreasing. The DDPM
        schedule does not depend on the image size (``height``/``width`` are ignored)."""
        if shift not in (None, 1.0):
            raise ValueError(f"{type(self).__name__} samples on its DDPM schedule; sampler.shift must be null")
        T = self.scheduler_config["num_train_timesteps"]
        if not 1 <= num_steps <= T:
            raise ValueError(f"num_steps must be in [1, {T}], got {num_steps}")
        offset = self.scheduler_config.get("steps_offset", 0)
        timesteps = (torch.arange(num_steps - 1, -1, -1) * (T // num_steps) + offset).clamp(max=T - 1)
        final = torch.tensor([1.0]) if self.scheduler_config.get("set_alpha_to_one", False) else self._abar[:1].float()
        return torch.cat([self._sigma_table[timesteps], torch.sqrt(1 - final).float()])

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """The training timestep whose noise level is nearest to ``sigma`` ``[B]``."""
        table = self._sigma_table.to(sigma.device)
        return (table[None, :] - sigma.float()[:, None]).abs().argmin(dim=1)
