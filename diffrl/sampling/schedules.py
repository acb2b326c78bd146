"""Training windows: which denoising steps of an RL step are drawn with the SDE and which are trained.

(The sigma schedules themselves are the model family's: ``pipelines.base``.) The window's random
choices use the seed stream ``WINDOW`` (``diffrl.sampling.seeding``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffrl.config import SamplerConfig
from diffrl.sampling.seeding import Stream, generator

# ------------------------------------------------------------------------------------------------
# Training windows: which denoising steps are stochastic (SDE) and which of those are trained
# ------------------------------------------------------------------------------------------------

WINDOW_KINDS = ("all", "fraction", "fast", "mixgrpo", "random", "random_per_sample")


@dataclass(frozen=True)
class WindowMasks:
    """Masks ``[K]`` of one RL step: ``stochastic`` steps are drawn with the SDE (others with the ODE
    solver), ``trained`` steps (a subset) get a policy-gradient update."""

    stochastic: torch.Tensor
    trained: torch.Tensor
    per_sample: int = 0
    """> 0: each sample trains its own random ``per_sample`` of the ``trained`` steps (:func:`per_sample_trained`, drawn
    by the rollout); 0: every sample trains all of them"""


def per_sample_count(candidates: int, timestep_fraction: float) -> int:
    """Steps each sample trains out of ``candidates`` (DanceGRPO: ``int(15·0.6) = 9`` of the first 15 of 16)."""
    return max(1, int(candidates * timestep_fraction))


def per_sample_trained(candidates: torch.Tensor, count: int, seeds: list[int]) -> torch.Tensor:
    """``[B, K]`` trained steps: each sample its own ``count`` of the ``candidates [K]`` steps, uniformly without
    replacement, from a generator of its seed (stream ``WINDOW``), so a sample's steps do not depend on its batch.

    DanceGRPO's reference code draws ``randperm`` of the candidate steps per sample and trains the first ``count``.
    """
    index = candidates.nonzero().squeeze(1)
    if not 1 <= count <= len(index):
        raise ValueError(f"per-sample trained steps: count={count} must be in [1, {len(index)}] (the candidate steps)")
    out = torch.zeros(len(seeds), candidates.shape[0], dtype=torch.bool)
    for row, seed in enumerate(seeds):
        out[row, index[torch.randperm(len(index), generator=generator(int(seed), Stream.WINDOW, 0))[:count]]] = True
    return out


class TrainingWindow:
    """Selects the SDE/trained steps of each RL step; its state is saved with the checkpoint.

    Kinds:
        ``all``: every step stochastic and trained (Flow-GRPO).
        ``fraction``: every step stochastic, the first ``max(1, int(K·timestep_fraction))`` trained
            (Flow-GRPO's ``timestep_fraction``; the high-noise end).
        ``fast``: Flow-GRPO-Fast: a window of ``size`` consecutive SDE steps starting at a random step in
            ``[range_start, range_end − size]``, drawn per RL step from ``(seed, step)``; ODE elsewhere;
            the window is trained.
        ``mixgrpo``: MixGRPO (Li et al. 2025): a window of ``size`` SDE steps that starts at the
            high-noise end and moves ``shift`` steps towards low noise every ``shift_every`` RL steps,
            stopping at the last position (``frozen``: it never moves); ODE elsewhere; trained.
        ``random``: every step stochastic, a random subset of ``max(1, int(K·timestep_fraction))`` steps trained,
            drawn once per RL step from ``(seed, step)`` and shared by all samples.
        ``random_per_sample``: DanceGRPO's reference code: every step stochastic, each sample trains its own random
            ``max(1, int((K − 1)·timestep_fraction))`` of the first ``K − 1`` steps (never the last), drawn from the
            sample's seed (:func:`per_sample_trained`); ``trained`` holds the ``K − 1`` candidates.

    ``fast`` and ``random`` windows are functions of ``(seed, step)``, so a resumed run redraws them;
    the MixGRPO window's position is state (:meth:`state_dict`) advanced by :meth:`advance` once per
    RL step.
    """

    def __init__(
        self,
        kind: str,
        num_steps: int,
        *,
        seed: int = 0,
        timestep_fraction: float = 1.0,
        size: int = 2,
        range_start: int = 0,
        range_end: int | None = None,
        shift: int = 1,
        shift_every: int = 25,
        frozen: bool = False,
    ):
        if kind not in WINDOW_KINDS:
            raise ValueError(f"unknown sampler.window {kind!r}; choose one of {WINDOW_KINDS}")
        if not 0.0 < timestep_fraction <= 1.0:
            raise ValueError(f"sampler.timestep_fraction must be in (0, 1], got {timestep_fraction}")
        self.kind, self.num_steps, self.seed = kind, num_steps, seed
        self.timestep_fraction = timestep_fraction
        self.size, self.shift, self.shift_every, self.frozen = size, shift, shift_every, frozen
        self.range_start = range_start
        self.range_end = num_steps if range_end is None else range_end
        if kind in ("fast", "mixgrpo"):
            if not 1 <= size <= num_steps:
                raise ValueError(f"sampler.window_size={size} must be in [1, num_steps={num_steps}]")
            if not 0 <= self.range_start <= self.range_end - size or self.range_end > num_steps:
                raise ValueError(
                    f"window range [{self.range_start}, {self.range_end}) cannot hold a window of {size} steps out of "
                    f"{num_steps}; need 0 ≤ range_start ≤ range_end − window_size and range_end ≤ num_steps"
                )
            if kind == "mixgrpo" and (shift < 0 or shift_every < 1):
                raise ValueError(f"MixGRPO needs window_shift ≥ 0 and window_shift_every ≥ 1, got {shift} and {shift_every}")
        if kind == "random_per_sample" and num_steps < 2:
            raise ValueError(f"sampler.window=random_per_sample trains steps before the last: it needs num_steps ≥ 2, got {num_steps}")
        self.position = self.range_start
        self.count = 0

    @property
    def n_trained(self) -> int:
        return max(1, int(self.num_steps * self.timestep_fraction))

    def _generator(self, step: int) -> torch.Generator:
        return generator(self.seed, Stream.WINDOW, step)

    def masks(self, step: int) -> WindowMasks:
        """The masks of RL step ``step`` (0-based)."""
        K = self.num_steps
        stochastic = torch.zeros(K, dtype=torch.bool)
        trained = torch.zeros(K, dtype=torch.bool)
        if self.kind == "random_per_sample":
            stochastic[:] = True
            trained[: K - 1] = True
            return WindowMasks(stochastic=stochastic, trained=trained, per_sample=per_sample_count(K - 1, self.timestep_fraction))
        if self.kind == "all":
            stochastic[:] = True
            trained[:] = True
        elif self.kind == "fraction":
            stochastic[:] = True
            trained[: self.n_trained] = True
        elif self.kind == "random":
            stochastic[:] = True
            trained[torch.randperm(K, generator=self._generator(step))[: self.n_trained]] = True
        else:
            if self.kind == "fast":
                high = self.range_end - self.size
                start = self.range_start + int(torch.randint(0, high - self.range_start + 1, (1,), generator=self._generator(step)))
            else:
                start = self.position
            stochastic[start : start + self.size] = True
            trained[start : start + self.size] = True
        return WindowMasks(stochastic=stochastic, trained=trained)

    def advance(self) -> None:
        """Called once after each RL step: moves the MixGRPO window."""
        self.count += 1
        if self.kind == "mixgrpo" and not self.frozen and self.count % self.shift_every == 0:
            self.position = min(self.position + self.shift, self.range_end - self.size)

    def state_dict(self) -> dict:
        return {"kind": self.kind, "num_steps": self.num_steps, "position": self.position, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != self.kind or state.get("num_steps") != self.num_steps:
            raise ValueError(
                f"checkpoint window state is for window {state.get('kind')!r} over {state.get('num_steps')} steps, "
                f"the config asks for {self.kind!r} over {self.num_steps}; resume with the run's own sampler settings"
            )
        self.position, self.count = int(state["position"]), int(state["count"])


def build_window(s: SamplerConfig, seed: int) -> TrainingWindow:
    """A run's training window from its sampler config (``sampler.window`` and its settings), seeded by ``seed``
    (``trainer.seed``)."""
    window_range = list(s.window_range) or [0, s.num_steps]
    if len(window_range) != 2:
        raise ValueError(f"sampler.window_range must be [start, end), got {window_range}")
    return TrainingWindow(
        s.window, s.num_steps, seed=seed, timestep_fraction=s.timestep_fraction, size=s.window_size,
        range_start=window_range[0], range_end=window_range[1], shift=s.window_shift, shift_every=s.window_shift_every,
        frozen=s.window_frozen,
    )
