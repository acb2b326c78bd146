"""The algorithm interface and its registry.

An algorithm decides what one RL step does between the rollout request and the weight sync: which policy
samples and which steps are stochastic / trained (:meth:`Algorithm.rollout_plan`), what objective the
workers train (:meth:`Algorithm.objective`), and how rewards become an update (:meth:`Algorithm.update`,
through the typed worker group).

The objective declares what it needs as a type, not as attributes to probe: an :class:`Objective`
(:class:`StepObjective` per trained step, or :class:`MicroBatchObjective` in pieces per micro-batch) carrying a frozen
:class:`ObjectiveSpec` (its reference policy, granularity, whole-batch preparation, off-policy correction, recorded step
means, old policy, preference pairs). The engine, the rollout request and the run's checks read those fields
(:attr:`Algorithm.spec`); the contract is defined beside the engine (``diffrl.engine.objective``, the lowest layer
that reads it) and re-exported here. Each algorithm owns a ``Config`` dataclass (extending
``diffrl.config.AlgorithmConfig``, with ``name`` and ``trainer`` defaulting to its own): it is the schema of its yaml
group ``configs/algorithm/<name>.yaml`` (``defaults: [schema_<registry name>]`` and only the values that differ), so
an algorithm's keys need no edit anywhere else and another algorithm's keys are refused.

The registry maps ``algorithm.trainer`` names to classes (``@register_algorithm("nft")``). Nothing outside
the registry and the class itself tests an algorithm's name: the trainer asks the class.

Adding an algorithm: one module under ``diffrl/algorithms/`` (its ``Config``, its objective with its spec, its
``update``; the package imports every module of it, so it registers without another edit), its yaml group
``configs/algorithm/<name>.yaml``, a recipe ``configs/experiment/digits_<name>.yaml`` and a test
(``docs/algorithms.md``, "Adding an algorithm").
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import torch
from omegaconf import OmegaConf
from tensordict import TensorDict

from diffrl.config import AlgorithmConfig, BatchPlan, SamplerConfig
from diffrl.engine.objective import (
    BASE,
    OLD,
    Granularity,
    MicroBatchObjective,
    Objective,
    ObjectiveSpec,
    OffPolicy,
    Pairs,
    Reference,
    StepObjective,
)
from diffrl.sampling.request import SampleRequest
from diffrl.sampling.schedules import WindowMasks
from diffrl.sampling.sde import is_deterministic
from diffrl.sampling.seeding import Stream, derive, generator


@dataclass(frozen=True)
class RolloutPlan:
    """What an RL step asks of the rollout.

    Whether the rollout records each step's transition mean is the objective's (``ObjectiveSpec.record_means``),
    given to :meth:`request`.

    Attributes:
        policy: ``current`` (the trained policy) or ``old`` (DiffusionNFT's sampling policy).
        trained: ``[K]`` steps whose log-probs are trained (a subset of ``stochastic``).
        stochastic: ``[K]`` steps drawn with the sampler's stochastic kind (others with the ODE solver).
    """

    policy: str
    trained: torch.Tensor
    stochastic: torch.Tensor

    def request(self, micro_batch_size: int | None = None, *, record_means: bool = False) -> SampleRequest:
        """The worker's typed :class:`~diffrl.sampling.request.SampleRequest` of this plan (``record_means``: the
        objective's ``spec.record_means``)."""
        return SampleRequest(policy=self.policy, trained=self.trained, stochastic=self.stochastic, record_means=record_means,
                             micro_batch_size=micro_batch_size)


class Workers(Protocol):
    """What an algorithm calls on the worker group (``diffrl.distributed.WorkerGroup``)."""

    world_size: int
    dp_size: int
    """data-parallel groups (ranks / ``model.sequence_parallel``): the ways each mini-batch is split"""

    def update_actor(self, data: TensorDict) -> TensorDict: ...

    def ema_update_adapter(self, source: str = "default", target: str = "old", decay: float = 0.0) -> None: ...

    def encode_pairs(self, pairs: TensorDict) -> TensorDict: ...


@dataclass(frozen=True)
class RunContext:
    """The run-level facts an algorithm needs besides its own config."""

    seed: int
    """trainer.seed"""
    prompts_per_step: int
    group_size: int
    sampler: SamplerConfig
    reward_weights: dict[str, float]
    """reward name → weight in the sum"""
    batch: BatchPlan | None = None
    """the run's batch arithmetic (rows per step, data-parallel groups, mini-batch), built once with the run
    (``diffrl.run_setup.run_context``); left out, the plan of ``prompts_per_step × group_size`` on one rank"""

    def __post_init__(self) -> None:
        if self.batch is None:
            object.__setattr__(self, "batch", BatchPlan(self.prompts_per_step, self.group_size))
        elif (self.batch.prompts_per_step, self.batch.group_size) != (self.prompts_per_step, self.group_size):
            raise ValueError(f"RunContext: prompts_per_step={self.prompts_per_step}, group_size={self.group_size} differ from its batch plan {self.batch}")


@dataclass
class StepResult:
    """What :meth:`Algorithm.update` returns: per-optimizer-step metric lists and scalars for the step's record."""

    metrics: dict[str, list] = dataclasses.field(default_factory=dict)
    record: dict[str, Any] = dataclasses.field(default_factory=dict)


class Algorithm(abc.ABC):
    """One algorithm family. Subclasses set ``name``, ``Config`` and implement :meth:`objective` and :meth:`update`."""

    name: ClassVar[str]
    Config: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig
    tiny_overrides: ClassVar[tuple[str, ...]] = ()
    """overrides that fit this algorithm's own sizes to a seconds-long run of 2 prompts × 2 samples (the user-surface
    tests), where its recipe ties a size to its own keys (TempFlow-GRPO's group is branch steps × branches)"""

    def __init__(self, config: AlgorithmConfig, run: RunContext):
        self.config = config
        self.run = run

    # -- what the algorithm asks of the rest ---------------------------------------------------------
    @abc.abstractmethod
    def objective(self) -> Objective:
        """The loss the workers train (``diffrl.engine.DiffusionEngine.train_batch``'s ``loss_fn``), declaring its
        :class:`ObjectiveSpec`."""

    @property
    def spec(self) -> ObjectiveSpec:
        """What this algorithm's objective declares (built from the config: the same for every call)."""
        return self.objective().spec

    @property
    def needs_old_policy(self) -> bool:
        """The engine keeps an ``old`` policy (a second adapter / frozen copy) from the start (``spec.old_policy``)."""
        return self.spec.old_policy

    def validate(self, num_workers: int) -> None:
        """Raise a one-line ValueError for settings this algorithm cannot run with, before any work."""

    def needs_rollout(self, step: int) -> bool:
        """Whether RL step ``step`` samples and scores rollouts (offline DPO does not)."""
        return True

    def rollout_plan(self, masks: WindowMasks) -> RolloutPlan:
        """Which policy samples and which steps are stochastic / trained, given the window's masks."""
        return RolloutPlan("current", masks.trained, masks.stochastic)

    def rollout_request(self, masks: WindowMasks, micro_batch_size: int | None = None) -> SampleRequest:
        """The typed request of :meth:`rollout_plan` for the window's ``masks``, recording the step means when the
        objective declares it (``spec.record_means``)."""
        return self.rollout_plan(masks).request(micro_batch_size, record_means=self.spec.record_means)

    def rows_per_step(self) -> int:
        """Rows of one RL step's update (trajectories, or pairs for preference learning)."""
        return self.run.batch.rows

    def optimizer_steps_per_rl_step(self) -> int:
        rows = self.rows_per_step()
        return max(1, rows // int(self.config.mini_batch_size or rows)) * int(self.config.epochs)

    def train_forwards(self, record: dict, trained_steps: int) -> tuple[int, int]:
        """``(units, extra_forwards)`` of one RL step's training for the FLOPs counter: ``units``
        sample-steps trained with backward, each with ``extra_forwards`` no-grad forwards beside it."""
        return self.run.batch.rows * trained_steps, int(self.config.kl_beta > 0)

    # -- the update ----------------------------------------------------------------------------------
    def setup(self, workers: Workers) -> None:
        """Once, after the workers are built (load data the update needs)."""

    @abc.abstractmethod
    def update(self, workers: Workers, traj: TensorDict | None, scores: dict | None, step: int) -> StepResult:
        """Train on RL step ``step``'s trajectories (None when :meth:`needs_rollout` is false)."""

    def state_dict(self) -> dict:
        """JSON state a resume needs (e.g. a stat tracker)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    # -- the one mini-batch × epoch loop ---------------------------------------------------------------
    def train_epochs(self, workers: Workers, td: TensorDict, full_batch: int, step: int) -> dict[str, list]:
        """``epochs`` passes of optimizer steps over ``td``.

        The mini-batches are drawn here (a seeded permutation per epoch when there are several mini-batches
        or epochs, stream ``MINI_BATCH_SHUFFLE``) and laid out so that each worker trains its slice of every
        mini-batch (:func:`arrange_for_data_parallel`): the update is the same for any number of workers.
        The number of mini-batches is that of a full batch (``full_batch / mini_batch_size``); rows that do
        not fill equal mini-batches divisible by the workers are left out (``rows_unused``). Each optimizer
        step gets its own seed (stream ``UPDATE``) for the objective's noise.
        """
        a, W = self.config, workers.dp_size
        n = td.shape[0]
        num_mini = max(1, min(n, full_batch // int(a.mini_batch_size or full_batch)))
        per_mini = (n // num_mini) // W * W
        if per_mini == 0:
            return {"rows_unused": [float(n)]}
        used = per_mini * num_mini
        collected: dict[str, list] = {}
        shuffle = a.epochs > 1 or num_mini > 1
        for epoch in range(int(a.epochs)):
            order = torch.randperm(n, generator=generator(self.run.seed, Stream.MINI_BATCH_SHUFFLE, step, epoch)) if shuffle else torch.arange(n)
            batch = arrange_for_data_parallel(td, mini_batch_size=per_mini, world_size=W, order=order[:used])
            batch.set_non_tensor("mini_batch_size", per_mini // W)
            batch.set_non_tensor("update_seeds", [derive(self.run.seed, Stream.UPDATE, step, epoch, m) for m in range(num_mini)])
            out = workers.update_actor(batch).get_non_tensor("metrics")
            for key, values in out.items():
                collected.setdefault(key, []).extend(values)
        collected["rows_unused"] = [float(n - used)]
        collected["optimizer_steps"] = [float(len(collected.get("lr", [])))]  # the engine reports one lr per optimizer step
        return collected


def arrange_for_data_parallel(data: TensorDict, *, mini_batch_size: int, world_size: int, order: torch.Tensor) -> TensorDict:
    """Reorder rows so that contiguous DP chunks hold, for every mini-batch in ``order``, that mini-batch's
    slice of each rank: rank r then trains mini-batch m on rows ``order[m·M + r·M/W : m·M + (r+1)·M/W]``.

    With one worker this is ``data[order]``. Each rank's share of a mini-batch is ``mini_batch_size / world_size``.
    """
    n = data.shape[0]
    if n % mini_batch_size or mini_batch_size % world_size:
        raise ValueError(
            f"{n} rows in mini-batches of {mini_batch_size} over {world_size} workers: the mini-batch size must divide "
            f"the batch and be divisible by the number of workers"
        )
    per = mini_batch_size // world_size
    rows = []
    for r in range(world_size):
        for m in range(n // mini_batch_size):
            start = m * mini_batch_size + r * per
            rows.append(order[start : start + per])
    return data[torch.cat(rows)]


def sample_only_plan(sampler, masks: WindowMasks, policy: str) -> RolloutPlan:
    """A rollout that trains no step (objectives on clean samples): stochastic where the window says so
    unless the sampler's kind is deterministic."""
    none_trained = torch.zeros_like(masks.trained)
    stochastic = none_trained if is_deterministic(sampler.kind, sampler.noise_level) else masks.stochastic
    return RolloutPlan(policy, none_trained, stochastic)


ALGORITHMS: dict[str, type[Algorithm]] = {}


def register_algorithm(name: str):
    """Class decorator: register an :class:`Algorithm` under ``algorithm.trainer=<name>``."""

    def wrap(cls: type[Algorithm]) -> type[Algorithm]:
        if name in ALGORITHMS and ALGORITHMS[name] is not cls:
            raise ValueError(f"algorithm {name!r} is registered twice ({ALGORITHMS[name].__name__} and {cls.__name__})")
        if not (isinstance(cls.Config, type) and issubclass(cls.Config, AlgorithmConfig)):
            raise TypeError(f"{cls.__name__}.Config must extend diffrl.config.AlgorithmConfig")
        cls.name = name
        ALGORITHMS[name] = cls
        return cls

    return wrap


def algorithm_class(name: str) -> type[Algorithm]:
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm.trainer {name!r}; choose one of {sorted(ALGORITHMS)}")
    return ALGORITHMS[name]


def group_class(config, groups: list[str]) -> str:
    """The registry name of the algorithm class whose ``Config`` an ``algorithm`` config group holds (``config``: the
    composed node, typed by the group's ``schema_<name>``, or a plain mapping such as a run's ``config.yaml``).

    Raises:
        ValueError: ``config.trainer`` names another class than the group's (``algorithm.trainer=nft`` on the
            flow_grpo group): the algorithm is chosen by its group, ``algorithm=<name>`` (one of ``groups``).
    """
    trainer = config.get("trainer") if hasattr(config, "get") else getattr(config, "trainer", None)
    typed = OmegaConf.get_type(config) if OmegaConf.is_config(config) else None
    names = [name for name, cls in ALGORITHMS.items() if cls.Config is typed]
    if not names:  # an untyped mapping: its trainer names the class
        return str(trainer or "policy_gradient")
    if trainer is not None and trainer != names[0]:
        raise ValueError(f"algorithm.trainer={trainer} does not match the algorithm group, whose class is {names[0]}; "
                         f"select the algorithm by its group (algorithm=<name>: {', '.join(groups)})")
    return names[0]


def registered_where(predicate: Callable[[ObjectiveSpec], bool], run: RunContext) -> list[str]:
    """``"<registry name> (loss <objective name>)"`` of every registered algorithm whose objective, at its ``Config``'s
    defaults, satisfies ``predicate`` (for messages that name what would work, from the registry)."""
    out = []
    for name, cls in sorted(ALGORITHMS.items()):
        spec = cls(cls.Config(), run).spec
        if predicate(spec):
            out.append(name if spec.name == name else f"{name} (loss {spec.name})")
    return out


def check_config(config) -> None:
    """Raise a clear error when the ``algorithm`` config names no registered algorithm class."""
    algorithm_class(config.trainer)


def build_algorithm(config, run: RunContext) -> Algorithm:
    """The registered algorithm of ``config.trainer``, given its own ``Config`` (the fields it declares)."""
    cls = algorithm_class(config.trainer)
    own = cls.Config(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls.Config)})
    return cls(own, run)


__all__ = [
    "ALGORITHMS", "BASE", "OLD", "Algorithm", "Granularity", "MicroBatchObjective", "Objective", "ObjectiveSpec", "OffPolicy", "Pairs",
    "Reference", "RolloutPlan", "RunContext", "StepObjective", "StepResult", "Workers", "algorithm_class", "arrange_for_data_parallel",
    "build_algorithm", "check_config", "group_class", "register_algorithm", "registered_where", "sample_only_plan",
]
