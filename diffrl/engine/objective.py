"""The objective contract: what a loss declares about itself, read by the engine, the rollout and the run's checks.

Every algorithm's objective (``Algorithm.objective()``) is an :class:`Objective` whose :class:`ObjectiveSpec` says,
as typed fields, what it needs: which reference policy (:class:`Reference`), its loss granularity
(:class:`Granularity`: per trained SDE step, or pieces per micro-batch), whether it sees the whole batch first
(``prepares_batch``), whether and how it corrects off-policy rollouts (:class:`OffPolicy`), whether rollouts must
record each step's transition mean, whether it keeps an ``old`` policy, and which preference pairs it consumes
(:class:`Pairs`). Nothing asks an objective ``hasattr(...)``: the engine dispatches on the declared fields
(``tests/test_architecture.py`` fails on such a probe outside ``diffrl/algorithms/``).

The contract lives here, beside the engine that is its lowest reader (``diffrl.algorithms.base`` re-exports it for
the algorithms, which sit a layer above). Two kinds of objective implement it:

* :class:`StepObjective` (``Granularity.STEP``): ``objective(step, batch, k) -> (loss, metrics)`` on one trained
  step ``k`` of a micro-batch; ``step`` holds ``log_prob``, ``mean`` and ``std`` of the current policy and, when the
  spec names a reference, ``ref_mean`` and ``ref_log_prob`` of that reference (scored by the engine on the same
  recorded states; a ``teacher`` reference with its own conditioning of the batch's prompts).
* :class:`MicroBatchObjective` (``Granularity.MICRO_BATCH``): ``micro_losses(engine, micro, seed)`` yields
  ``(loss, weight, metrics)`` pieces whose weights sum to one (objectives on re-noised clean samples: NFT, AWM, DPO,
  DGPO); such an objective runs its reference through ``engine.reference_policy(spec.reference)``, conditioned on
  ``engine.reference_cond(spec.reference, micro)``.

A plain function ``(step, batch, k) -> (loss, metrics)`` (tests, benchmarks) is a step objective with no reference
(:func:`as_objective`).
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
from tensordict import TensorDict


class Granularity(str, enum.Enum):
    """What one call of an objective computes."""

    STEP = "step"
    """one trained SDE step of a micro-batch (the engine scores the step under the policy and the reference)"""
    MICRO_BATCH = "micro_batch"
    """``(loss, weight, metrics)`` pieces of one micro-batch, computed by the objective itself"""


class OffPolicy(str, enum.Enum):
    """How an objective corrects rollouts of another policy than the trained one (stale replica weights, FP8)."""

    NONE = "none"
    """it cannot train them: the run refuses off-policy rollouts"""
    TRUNCATED_IS = "truncated_is"
    """the ratio is taken against the proximal policy and each sample weighted by ``min(π_prox/μ, C)`` (truncated
    importance sampling of the behaviour log-probs, ``losses.truncated_is_weight``)"""


class Pairs(str, enum.Enum):
    """The preference pairs an objective trains on."""

    NONE = "none"
    ONLINE = "online"
    """built from each step's rollouts (best and worst of each prompt group)"""
    OFFLINE = "offline"
    """read from a file (no rollout, no source images)"""


@dataclass(frozen=True)
class Reference:
    """The policy an objective compares the trained one with (its KL anchor, DPO's reference, a distillation teacher).

    ``kind``: ``base`` (the actor with its LoRA disabled; full fine-tuning: a frozen copy of the initial weights),
    ``adapter`` (the LoRA adapter named ``adapter``: ``old`` is GARDO's adaptive reference; full fine-tuning: the
    old policy's frozen copy) or ``teacher`` (a second model of the same family loaded from ``source``, a local folder
    or a Hub id, by the family's loader: frozen, in eval mode, in the engine's compute dtype; it encodes the prompts
    with its own text encoder, so a teacher whose encoder differs from the student's still reads them right). A new
    kind is one more value here and one more branch of ``DiffusionEngine.reference_policy``; nothing else reads it.
    """

    kind: str
    adapter: str | None = None
    source: str | None = None
    """``teacher``: the teacher model's folder or Hub id"""

    KINDS: ClassVar[tuple[str, ...]] = ("base", "adapter", "teacher")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"unknown reference kind {self.kind!r}; choose one of {self.KINDS}")
        if (self.kind == "adapter") != bool(self.adapter):
            raise ValueError(f"reference kind {self.kind!r}: an adapter name is given exactly with kind 'adapter', got adapter={self.adapter!r}")
        if (self.kind == "teacher") != bool(self.source):
            raise ValueError(f"reference kind {self.kind!r}: a source (the teacher's folder or Hub id) is given exactly with kind 'teacher', "
                             f"got source={self.source!r}")
        if self.adapter in ("current", "default"):
            raise ValueError(f"reference adapter {self.adapter!r} is the trained policy itself; name another adapter")

    def __str__(self) -> str:
        if self.kind == "adapter":
            return f"adapter {self.adapter!r}"
        return f"teacher {self.source!r}" if self.kind == "teacher" else self.kind


BASE = Reference("base")
"""the actor with its LoRA disabled (full fine-tuning: the frozen initial weights)"""
OLD = Reference("adapter", "old")
"""the ``old`` adapter (GARDO's adaptive reference)"""


@dataclass(frozen=True, kw_only=True)
class ObjectiveSpec:
    """What an objective declares (module docstring). Frozen: an objective's needs are fixed when it is built."""

    name: str
    """the loss's name in messages (``flow_grpo``, ``grpo_guard``, ``dpo``, …)"""
    granularity: Granularity
    """per trained step, or pieces per micro-batch"""
    reference: Reference | None = None
    """the reference policy it compares with (None: none); a step objective gets its ``ref_mean``/``ref_log_prob``"""
    prepares_batch: bool = False
    """the engine calls ``prepare_batch(engine, batch, seed)`` on the whole batch, gradient-free, before any
    micro-batch (DGPO's group weights need every member of a group)"""
    off_policy: OffPolicy = OffPolicy.NONE
    """how it corrects rollouts of another policy than the trained one"""
    record_means: bool = False
    """rollouts record each step's transition mean ``means [B, K, …]`` (GRPO-Guard's RatioNorm, Flow-DPPO's mask)"""
    old_policy: bool = False
    """it reads the ``old`` policy (NFT's sampling policy, AWM's EMA anchor, GARDO's reference): the engine keeps one
    from the start"""
    pairs: Pairs = Pairs.NONE
    """the preference pairs it trains on"""

    def __post_init__(self):
        object.__setattr__(self, "granularity", Granularity(self.granularity))
        object.__setattr__(self, "off_policy", OffPolicy(self.off_policy))
        object.__setattr__(self, "pairs", Pairs(self.pairs))
        if self.reference is not None and not isinstance(self.reference, Reference):
            raise TypeError(f"{self.name}: ObjectiveSpec.reference must be a Reference or None, got {self.reference!r}")
        if self.reference == OLD and not self.old_policy:
            raise ValueError(f"{self.name}: a reference on the old adapter needs old_policy=True (the engine keeps it from the start)")
        if self.off_policy is not OffPolicy.NONE and self.granularity is not Granularity.STEP:
            raise ValueError(f"{self.name}: off-policy correction weights per-step log-probs; a {self.granularity.value} objective has none")

    @property
    def corrects_off_policy(self) -> bool:
        return self.off_policy is not OffPolicy.NONE


class Objective(abc.ABC):
    """The loss the workers train (the engine's ``loss_fn``): a :class:`StepObjective` or a
    :class:`MicroBatchObjective`, declaring its :class:`ObjectiveSpec` as ``spec``."""

    GRANULARITY: ClassVar[Granularity]

    def __init__(self, spec: ObjectiveSpec):
        if spec.granularity is not self.GRANULARITY:
            raise TypeError(f"{type(self).__name__} is a {self.GRANULARITY.value} objective, its spec says {spec.granularity.value}")
        overrides = type(self).prepare_batch is not Objective.prepare_batch
        if spec.prepares_batch != overrides:
            raise TypeError(f"{type(self).__name__}: spec.prepares_batch={spec.prepares_batch} but the class "
                            f"{'defines' if overrides else 'does not define'} prepare_batch")
        self.spec = spec

    def prepare_batch(self, engine, batch: TensorDict, seed: int) -> TensorDict:
        """The whole batch, gradient-free, before its micro-batches (only with ``spec.prepares_batch``)."""
        return batch


class StepObjective(Objective):
    """A loss on one trained SDE step: ``self(step, batch, k) -> (loss, metrics)`` (module docstring)."""

    GRANULARITY = Granularity.STEP

    @abc.abstractmethod
    def __call__(self, step: dict, batch: TensorDict, k: int) -> tuple[torch.Tensor, dict[str, float]]:
        """``(loss, metrics)`` of step ``k`` of ``batch`` (a micro-batch), given the engine's scoring ``step``."""


class MicroBatchObjective(Objective):
    """A loss computed by the objective on each micro-batch, in weighted pieces (module docstring)."""

    GRANULARITY = Granularity.MICRO_BATCH

    @abc.abstractmethod
    def micro_losses(self, engine, micro: TensorDict, seed: int) -> Iterator[tuple[torch.Tensor, float, dict[str, float]]]:
        """``(loss, weight, metrics)`` pieces of ``micro`` (weights summing to one); ``seed`` seeds the objective's noise."""


class StepFunction(StepObjective):
    """A plain per-step function ``fn(step, batch, k) -> (loss, metrics)`` as a step objective with no reference."""

    def __init__(self, fn: Callable):
        super().__init__(ObjectiveSpec(name=getattr(fn, "__name__", type(fn).__name__), granularity=Granularity.STEP))
        self.fn = fn

    def __call__(self, step: dict, batch: TensorDict, k: int):
        return self.fn(step, batch, k)


def as_objective(loss_fn) -> Objective:
    """``loss_fn`` itself when it is an :class:`Objective`, else a plain per-step function wrapped as one."""
    if isinstance(loss_fn, Objective):
        return loss_fn
    if not callable(loss_fn):
        raise TypeError(f"a loss function must be an Objective or a callable (step, batch, k) -> (loss, metrics), got {type(loss_fn).__name__}")
    return StepFunction(loss_fn)


__all__ = ["BASE", "OLD", "Granularity", "MicroBatchObjective", "Objective", "ObjectiveSpec", "OffPolicy", "Pairs", "Reference",
           "StepFunction", "StepObjective", "as_objective"]
