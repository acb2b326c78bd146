"""The sampler's config checks (``sampler.*``), run by ``diffrl.recipes.validate`` before anything is built: the step
kind, the ODE solver and the training window (its kind, range and size) against what ``diffrl.sampling`` registers."""

from __future__ import annotations

from diffrl.config import ConfigError, SamplerConfig
from diffrl.sampling.schedules import WINDOW_KINDS
from diffrl.sampling.sde import ODE_SOLVERS, STEP_KINDS


def validate_sampler(s: SamplerConfig) -> None:
    """Raise a one-line :class:`~diffrl.config.ConfigError` naming the ``sampler.*`` key, its value and what is valid."""
    if s.kind not in STEP_KINDS:
        raise ConfigError(f"sampler.kind={s.kind!r} is invalid: it must be one of {', '.join(sorted(STEP_KINDS))}")
    if s.ode_solver not in ODE_SOLVERS:
        raise ConfigError(f"sampler.ode_solver={s.ode_solver!r} is invalid: it must be one of {', '.join(ODE_SOLVERS)}")
    if s.window not in WINDOW_KINDS:
        raise ConfigError(f"sampler.window={s.window!r} is invalid: it must be one of {', '.join(WINDOW_KINDS)}")
    wr = list(s.window_range)
    if wr and not (len(wr) == 2 and all(isinstance(v, int) for v in wr) and 0 <= wr[0] < wr[1] <= s.num_steps):
        raise ConfigError(f"sampler.window_range={wr} is invalid: it must be [] or [start, end) with 0 ≤ start < end ≤ sampler.num_steps={s.num_steps}")
    span = (wr[1] - wr[0]) if wr else s.num_steps
    if s.window in ("fast", "mixgrpo") and s.window_size > span:
        raise ConfigError(f"sampler.window_size={s.window_size} is invalid: the {s.window} window must fit in its range of {span} steps "
                          "(sampler.window_range / num_steps)")


__all__ = ["validate_sampler"]
