"""What a rollout worker is asked to sample, typed: one :class:`SampleRequest` travels with the batch.

A request batch is a TensorDict of the per-sample inputs (``seeds``, ``group_id``, non-tensor ``prompts``, and
optionally ``init_seeds`` and an editing model's uint8 ``source_images``) carrying one non-tensor
:class:`SampleRequest` under :data:`REQUEST_KEY`: the policy, the trained and stochastic steps of an RL rollout
(an algorithm's ``RolloutPlan``), whether to record the step means, the forward micro-batch, or, for an evaluation,
the deterministic step count. A layout whose rows differ within a prompt group (TempFlow-GRPO's branches: row ``j`` of
every group is stochastic and trained at its own steps) gives ``group_trained`` / ``group_stochastic [G, K]``;
:func:`sample_batch` turns them into the per-row tensors ``trained_rows`` / ``stochastic_rows [B, K]``, which travel
(and split across chunks and workers) with the batch. It is built by :func:`sample_batch` (the trainer's rollouts and evaluations,
``diffrl sample`` / ``diffrl eval``) and read back whole by the worker (:meth:`SampleRequest.of`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import NonTensorStack, TensorDict

from diffrl.config import SamplerConfig
from diffrl.sampling.evaluation import deterministic_settings
from diffrl.sampling.rollout import sample_trajectories

REQUEST_KEY = "sample_request"
POLICIES = ("current", "old", "ema")


@dataclass(frozen=True)
class SampleRequest:
    """How to sample a request batch.

    Attributes:
        policy: ``current`` (the trained policy), ``old`` (DiffusionNFT's sampling policy) or ``ema``.
        trained: ``[K]`` bool, the steps whose log-probs are trained (an RL rollout); None: all steps.
        stochastic: ``[K]`` bool, the steps drawn with the sampler's stochastic kind; None: ``trained``.
        record_means: also record each step's transition mean (GRPO-Guard's RatioNorm, Flow-DPPO's mask).
        micro_batch_size: samples per denoiser forward (None: the whole batch).
        eval_num_steps: a deterministic evaluation with this many steps (the model-precision policy, no trained
            steps); None: an RL rollout with the sampler's settings.
        group_trained: ``[G, K]`` bool, the trained steps of each position ``j`` in a prompt group of ``G`` rows (row
            ``j`` of every group); None: every row trains ``trained``.
        group_stochastic: ``[G, K]`` bool, the stochastic steps of each position (a superset of ``group_trained``);
            None: ``group_trained``.
    """

    policy: str = "current"
    trained: torch.Tensor | None = None
    stochastic: torch.Tensor | None = None
    record_means: bool = False
    micro_batch_size: int | None = None
    eval_num_steps: int | None = None
    group_trained: torch.Tensor | None = None
    group_stochastic: torch.Tensor | None = None

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"SampleRequest.policy must be one of {POLICIES}, got {self.policy!r}")
        if self.eval_num_steps is not None and self.eval_num_steps < 1:
            raise ValueError(f"SampleRequest.eval_num_steps must be ≥ 1 (or None for a rollout), got {self.eval_num_steps}")
        if self.group_stochastic is not None and self.group_trained is None:
            raise ValueError("SampleRequest.group_stochastic needs group_trained (the per-position trained steps)")
        if self.group_trained is not None:
            stochastic = self.group_trained if self.group_stochastic is None else self.group_stochastic
            if self.group_trained.ndim != 2 or stochastic.shape != self.group_trained.shape:
                raise ValueError(f"SampleRequest.group_trained / group_stochastic must both be [G, K], got {tuple(self.group_trained.shape)} "
                                 f"and {tuple(stochastic.shape)}")
            if bool((self.group_trained.bool() & ~stochastic.bool()).any()):
                raise ValueError("SampleRequest.group_trained marks a step as trained that group_stochastic does not draw stochastically")

    @property
    def evaluation(self) -> bool:
        return self.eval_num_steps is not None

    @classmethod
    def of(cls, batch: TensorDict) -> SampleRequest:
        """The request a batch carries (a batch without one: a rollout of the current policy with the defaults)."""
        if REQUEST_KEY not in batch.keys():
            return cls()
        request = batch.get_non_tensor(REQUEST_KEY)
        if not isinstance(request, SampleRequest):
            raise TypeError(f"{REQUEST_KEY} must be a SampleRequest, got {type(request).__name__}")
        return request


def sample_batch(prompts: list[str], seeds: list[int], request: SampleRequest, *, group_id: torch.Tensor | None = None,
                 source_images: torch.Tensor | None = None, init_seeds: list[int] | None = None) -> TensorDict:
    """The request batch of ``prompts`` (one per sample) and their ``seeds``; ``group_id`` defaults to one group per
    sample, ``source_images`` (uint8 ``[B, 3, H, W]``) go to an editing model."""
    n = len(prompts)
    if len(seeds) != n:
        raise ValueError(f"sample_batch: {n} prompts but {len(seeds)} seeds (one seed per sample)")
    td = TensorDict({"seeds": torch.as_tensor(list(seeds), dtype=torch.long),
                     "group_id": torch.arange(n) if group_id is None else group_id}, batch_size=[n])
    td["prompts"] = NonTensorStack(*prompts)
    if source_images is not None:
        td["source_images"] = source_images
    if init_seeds is not None:
        td["init_seeds"] = torch.as_tensor(list(init_seeds), dtype=torch.long)
    if request.group_trained is not None:
        position = positions_in_groups(td["group_id"], request.group_trained.shape[0])
        stochastic = request.group_trained if request.group_stochastic is None else request.group_stochastic
        td["trained_rows"], td["stochastic_rows"] = request.group_trained.bool()[position], stochastic.bool()[position]
    td.set_non_tensor(REQUEST_KEY, request)
    return td


def positions_in_groups(group_id: torch.Tensor, group_size: int) -> torch.Tensor:
    """``[B]`` each row's position in its group, in the order the rows come (0 … ``group_size`` − 1).

    Raises:
        ValueError: a group that does not hold exactly ``group_size`` rows.
    """
    position = torch.empty_like(group_id)
    seen: dict[int, int] = {}
    for row, g in enumerate(group_id.tolist()):
        position[row] = seen.get(g, 0)
        seen[g] = int(position[row]) + 1
    sizes = sorted(set(seen.values()))
    if sizes != [group_size]:
        raise ValueError(f"a per-position layout of groups of {group_size} rows got groups of {sizes} rows (group_id {group_id.tolist()})")
    return position


def run_request(adapter, settings: SamplerConfig, batch: TensorDict) -> TensorDict:
    """Sample the request batch ``batch`` with ``adapter`` (the policy already selected) and the run's sampler
    ``settings``: an evaluation request deterministically with its own step count and no trained steps, a rollout
    with the request's trained and stochastic steps. Returns the trajectory TensorDict."""
    request = SampleRequest.of(batch)
    prompts = list(batch.get("prompts").tolist()) if hasattr(batch.get("prompts"), "tolist") else list(batch.get("prompts"))
    sources = batch["source_images"] if "source_images" in batch.keys() else None  # an editing model's source images
    common = dict(seeds=batch["seeds"].tolist(), group_id=batch["group_id"], micro_batch_size=request.micro_batch_size, source_images=sources)
    if request.evaluation:
        return sample_trajectories(adapter, prompts, settings=deterministic_settings(settings, adapter.prediction_type, request.eval_num_steps), **common)
    keys = set(batch.keys())
    per_row = "trained_rows" in keys  # a layout that differs by row (SampleRequest.group_trained)
    return sample_trajectories(
        adapter, prompts, settings=settings, sde_mask=batch["trained_rows"] if per_row else request.trained,
        stochastic_mask=batch["stochastic_rows"] if per_row else request.stochastic, record_means=request.record_means,
        init_seeds=batch["init_seeds"].tolist() if "init_seeds" in keys else None, **common,
    )


__all__ = ["POLICIES", "REQUEST_KEY", "SampleRequest", "positions_in_groups", "run_request", "sample_batch"]
