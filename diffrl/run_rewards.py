"""A run's rewards (``reward.*``): their checks before anything is built, and the rewards, judges and feature space
built once for the whole run.

:func:`validate_rewards` is ``reward.*``'s share of ``diffrl.recipes.validate``: the names resolve (registry, entry
point or ``module:Class``) and their optional packages are installed, one weight per reward, and the run's prompts
carry what each reward needs (``Reward.check_prompts``: GenEval needs each prompt's row). :func:`build_rewards`
builds, before the model (a reward that cannot be built, e.g. a server that is down, costs nothing), the rewards the
run trains on with their weights, every evaluation metric beside them (``reward.gold``, ``reward.fidelity``,
``reward.judges``) and the feature space of ``reward.feature_space``: the trainer's rollouts score with
:attr:`RunRewards.trained`, its evaluations (``diffrl.run_evaluation``) with :attr:`RunRewards.metrics`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from collections.abc import Mapping

from diffrl.config import ConfigError, RewardConfig
from diffrl.data import prompt_texts
from diffrl.run_parts import RunParts
from diffrl.sampling.distribution import feature_space_of
from rewards.base import RewardError, build_reward, instantiate_reward


def reward_weights(r: RewardConfig) -> dict[str, float]:
    """``reward name → weight`` of the rewards the run trains on (``reward.weights``, 1.0 each when empty)."""
    names, weights = list(r.names), list(r.weights) or [1.0] * len(r.names)
    if not names:
        raise ValueError("reward.names is empty: give at least one reward")
    if len(weights) != len(names):
        raise ValueError(f"reward.weights has {len(weights)} entries for {len(names)} reward.names; give one weight per reward")
    return {n: float(w) for n, w in zip(names, weights)}


def validate_rewards(r: RewardConfig, prompts: dict[str, str | None], resolved: Mapping[str, Any]) -> None:
    """Raise a one-line :class:`~diffrl.config.ConfigError` naming the ``reward.*`` key (or the prompts' key), its value
    and what is valid, reading no image and building nothing.

    Args:
        r: the run's ``RewardConfig``.
        resolved: reward name → its class or function (``diffrl.run_parts.RunParts.rewards``: the names resolved, their
            optional packages installed).
        prompts: ``config key → prompt spec`` of the run's prompts (``trainer.prompts``, ``eval.prompts``; None: the
            model family's built-in prompts), each checked against every reward's needs (``Reward.check_prompts``).
    """
    try:
        reward_weights(r)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    weights = list(r.weights)
    if not all(isinstance(w, (int, float)) and math.isfinite(w) for w in weights):
        raise ConfigError(f"reward.weights={weights} is invalid: each must be a finite number")
    for key, spec in prompts.items():
        if not spec:
            continue
        texts, table = prompt_texts(spec)  # texts and metadata rows only: no image
        rows = [table.get(t) for t in texts]
        for target in resolved.values():
            check = getattr(target, "check_prompts", None)
            try:
                if callable(check):
                    check(texts, rows)
            except (RewardError, ValueError) as exc:
                raise ConfigError(f"{key}={prompts[key]}: {exc} (records carry it as GenEval rows or a metadata field; flow_grpo's "
                                  "datasets: diffrl prompts convert --help)") from None


@dataclass
class RunRewards:
    """The rewards of one run, each built once."""

    trained: dict[str, tuple[Any, float]]
    """``name → (reward, weight)`` of the rewards the run trains on (``reward.names``, built with ``reward.options``)"""
    metrics: dict[str, Any] = field(default_factory=dict)
    """``name → reward`` of every evaluation metric: the trained rewards, then ``reward.gold``, ``reward.fidelity`` and
    ``reward.judges`` (each once)"""
    feature_space: Any = None
    """the reward of ``reward.feature_space`` (``diffrl.sampling.distribution.FeatureSpace``); None: none"""
    gold_name: str | None = None
    """``reward.gold``"""
    judge_names: list[str] = field(default_factory=list)
    """``reward.judges`` besides the gold metric"""
    fidelity_name: str | None = None
    """``reward.fidelity``"""

    @property
    def weights(self) -> dict[str, float]:
        """``name → weight`` of the trained rewards."""
        return {name: w for name, (_, w) in self.trained.items()}


def build_trained_rewards(r: RewardConfig) -> dict[str, tuple[Any, float]]:
    """``name → (reward, weight)`` of the rewards the run trains on (``reward.names``, built with ``reward.options``)."""
    weights = reward_weights(r)
    return {name: (build_reward(name, **r.options.get(name, {})), w) for name, w in weights.items()}


def build_rewards(r: RewardConfig, parts: RunParts) -> RunRewards:
    """The run's rewards (:class:`RunRewards`), each built once from the class or function ``parts`` resolved
    (``diffrl.run_parts.RunParts``) with its ``reward.options``: the trained ones, then each other evaluation metric, then
    the feature space."""
    weights, resolved = reward_weights(r), parts.rewards
    built: dict[str, Any] = {}
    for name in dict.fromkeys([*weights, *parts.metrics]):  # the trained rewards first
        built[name] = instantiate_reward(name, resolved[name], r.options.get(name, {}))
    fs = r.feature_space  # an instance of its own, also where it is an evaluation metric
    space = instantiate_reward(fs, resolved[fs], r.options.get(fs, {})) if fs else None
    space = feature_space_of(space, fs) if fs else None
    return RunRewards({name: (built[name], w) for name, w in weights.items()}, built, space, gold_name=r.gold,
                      judge_names=[n for n in r.judges if n != r.gold], fidelity_name=r.fidelity)


__all__ = ["RunRewards", "build_rewards", "build_trained_rewards", "reward_weights", "validate_rewards"]
