"""The parts a run's config names, resolved once: the model family's adapter class (``model.family``, with the options
``model.*`` gives it checked) and the class or function of every reward the run builds (``reward.*``).

:func:`resolve_parts` is where ``diffrl.recipes.validate`` turns those names into objects, reading no weights and building
nothing; every later check and builder of the run (the model's and the rewards' checks, the checkpoints' check, the
distributed checks, the data, the rewards' construction) takes the resolved :class:`RunParts` instead of resolving the
names again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from diffrl.config import ConfigError, ModelConfig, RewardConfig, eval_metric_names
from pipelines.base import check_adapter_options
from rewards.base import RewardError, missing_extra, resolve_reward


def reward_keys(r: RewardConfig) -> list[tuple[str, str]]:
    """``(the key as the user sets it, reward name)`` of every reward a run builds (``reward.names=[a, b]``,
    ``reward.gold=c`` …), the evaluation's metrics in their order (``diffrl.config.eval_metric_names``), then the
    feature space."""
    out = [(f"reward.names=[{', '.join(r.names)}]", n) for n in r.names]
    out += [(f"reward.{k}={getattr(r, k)}", getattr(r, k)) for k in ("gold", "fidelity") if getattr(r, k)]
    out += [(f"reward.judges=[{', '.join(r.judges)}]", n) for n in r.judges]
    return out + [(f"reward.feature_space={r.feature_space}", r.feature_space)] * bool(r.feature_space)


@dataclass(frozen=True)
class RunParts:
    """The objects a run's config names (:func:`resolve_parts`)."""

    family_name: str
    """``model.family``"""
    family: type
    """its adapter class (``pipelines.base.ModelAdapter``): ``editing``, ``hub_components``, ``sequence_layout`` …"""
    rewards: Mapping[str, Any] = field(default_factory=dict)
    """reward name → its class or function (``rewards.base.resolve_reward``), for every reward the run builds, in the
    order of :func:`reward_keys`: the trained ones, ``reward.gold``, ``reward.fidelity``, ``reward.judges``, then
    ``reward.feature_space``"""
    metrics: tuple[str, ...] = ()
    """the names of the evaluation's metrics, each once, in order (``diffrl.config.eval_metric_names``)"""


def resolve_parts(model: ModelConfig, reward: RewardConfig) -> RunParts:
    """The model family's adapter class, its options checked (``model.options``, a published ``shape``), then every reward
    the run builds, each with its optional package installed. One line :class:`~diffrl.config.ConfigError` naming the key."""
    keys, metrics = reward_keys(reward), tuple(eval_metric_names(reward))
    try:
        family = check_adapter_options(model.family, model.adapter_kwargs())
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    rewards: dict[str, Any] = {}
    for key, name in keys:
        try:
            rewards[name] = resolve_reward(name)
        except RewardError as exc:
            raise ConfigError(f"{key}: {exc}") from None
        extra = missing_extra(name)
        if extra:
            raise ConfigError(f"{key}: {extra}")
    return RunParts(str(model.family), family, rewards, metrics)


__all__ = ["RunParts", "resolve_parts", "reward_keys"]
