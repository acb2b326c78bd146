"""The reward protocol and registry.

A reward is a callable ``(images: uint8 [B, 3, H, W], prompts: list[str], metadata) -> dict[str, Tensor[B]]``
registered by name. Names resolve, in order, from this registry (built-ins register on import), the
``diffrl.rewards`` entry-point group of installed packages, or a ``"module:Class"`` path.

:func:`score` runs a weighted set of rewards and checks every output: a wrong shape, NaN or Inf raises
:class:`RewardError` naming the reward and the first bad sample.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any, Callable

import torch

_REGISTRY: dict[str, type] = {}
_BUILTIN_MODULES = ("rewards.digits", "rewards.jpeg", "rewards.ocr", "rewards.clip_models", "rewards.remote", "rewards.vlm_judge")


class RewardError(RuntimeError):
    """A reward produced unusable output (wrong shape, NaN, Inf) or could not be built."""


class Reward:
    """Base class of rewards (subclassing is optional: any callable with the signature works).

    Attributes:
        name: the registry name; also the key of its output.
        unit: what the number means (e.g. ``"probability in [0, 1]"``).
        device: where the reward model runs.
    """

    name: str = "reward"
    unit: str = "unspecified"
    device: str = "cpu"

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: Any = None) -> dict[str, torch.Tensor]:
        raise TypeError(f"{type(self).__name__} must define __call__(images, prompts, metadata)")


def register_reward(name: str) -> Callable[[type], type]:
    """Class decorator registering a reward under ``name`` (sets ``cls.name``)."""

    def wrap(cls: type) -> type:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def resolve_reward(name: str) -> type:
    """The reward class for ``name`` (registry, entry point, or ``module:Class``)."""
    if name not in _REGISTRY:
        for module in _BUILTIN_MODULES:
            importlib.import_module(module)
    if name in _REGISTRY:
        return _REGISTRY[name]
    for ep in entry_points(group="diffrl.rewards"):
        if ep.name == name:
            return ep.load()
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            raise RewardError(f"reward {name!r}: cannot import module {module_name!r} ({exc})") from exc
        if not hasattr(module, attr):
            raise RewardError(f"reward {name!r}: module {module_name!r} has no attribute {attr!r}")
        return getattr(module, attr)
    raise RewardError(
        f"unknown reward {name!r}; registered: {sorted(_REGISTRY)}; or give an entry point of group "
        "'diffrl.rewards' or a 'module:Class' path"
    )


def build_reward(name: str, **kwargs) -> Callable:
    cls = resolve_reward(name)
    reward = cls(**kwargs)
    if not getattr(reward, "name", None) or reward.name == Reward.name:
        reward.name = name
    return reward


def check_output(name: str, value: Any, batch_size: int) -> torch.Tensor:
    """Validate one reward output: a float tensor of shape ``[B]`` with no NaN/Inf."""
    if not isinstance(value, torch.Tensor):
        raise RewardError(f"reward {name!r} returned {type(value).__name__}, expected a tensor of shape [{batch_size}]")
    if value.shape != (batch_size,):
        raise RewardError(f"reward {name!r} returned shape {tuple(value.shape)}, expected [{batch_size}]")
    value = value.detach().float().cpu()
    bad = ~torch.isfinite(value)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise RewardError(
            f"reward {name!r} returned {value[i].item()} for sample {i} ({int(bad.sum())} non-finite of {batch_size}); "
            "fix the reward so that it returns finite scores"
        )
    return value


def score(rewards: dict[str, tuple[Callable, float]], images: torch.Tensor, prompts: list[str], metadata: Any = None) -> dict[str, torch.Tensor]:
    """Run every reward and return ``{"reward/<name>": [B], …, "rewards": Σ weight·reward}``.

    Args:
        rewards: ``name -> (callable, weight)``.
        images: uint8 ``[B, 3, H, W]``.
        prompts: ``B`` prompts.
    """
    batch_size = images.shape[0]
    if len(prompts) != batch_size:
        raise ValueError(f"got {len(prompts)} prompts for {batch_size} images")
    out: dict[str, torch.Tensor] = {}
    total = torch.zeros(batch_size)
    for name, (fn, weight) in rewards.items():
        result = fn(images, prompts, metadata)
        if not isinstance(result, dict) or not result:
            raise RewardError(f"reward {name!r} returned {type(result).__name__}; expected a dict of name -> tensor [B]")
        for key, value in result.items():
            out[f"reward/{key}"] = check_output(key, value, batch_size)
        main = result.get(name, next(iter(result.values())))
        total = total + weight * check_output(name, main, batch_size)
    out["rewards"] = total
    return out
