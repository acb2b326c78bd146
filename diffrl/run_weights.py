"""The checkpoints a run loads (``model.path`` and each reward's weights): listed, and checked to be there before
anything is built (the last of ``diffrl.recipes.validate``'s checks).

A local path must exist; a Hugging Face Hub reference must be in the cache when the run is offline
(``HF_HUB_OFFLINE=1``, ``diffrl.hub``). Every missing piece is collected, the model before its rewards, so that one
error names them all, each with the ``hf download`` command that fetches it.
"""

from __future__ import annotations

import re
from pathlib import Path

from diffrl.config import ConfigError, ModelConfig, RewardConfig
from diffrl.hub import HubError, cache_dir, is_hub_ref, offline, resolve_model_folder, resolve_weights
from diffrl.run_parts import RunParts


def hub_weights(model: ModelConfig, reward: RewardConfig, parts: RunParts, *, local: bool = False) -> list[tuple[str, str, str]]:
    """``(config key, reference, kind)`` of every checkpoint the run loads: ``model.path`` first, then each reward's
    weights (given in ``reward.options`` or the reward's published default, ``Reward.hub_weights``; the rewards as
    ``parts`` resolved them). Hub references only, unless ``local`` (then local paths too)."""
    r, rewards = reward, []
    for name, target in parts.rewards.items():  # the evaluation's metrics in order, then the feature space
        refs = getattr(target, "weight_refs", None)
        options = dict(r.options.get(name, {}) or {})
        for option, weights in (refs(options) if callable(refs) else {}).items():
            if local or is_hub_ref(weights.ref):
                rewards.append((f"+reward.options.{name}.{option}", weights.ref, weights.kind))
    loads_model = model.path is not None and (local or is_hub_ref(model.path))
    return [("model.path", str(model.path), "family")] * loads_model + rewards


def _fetch_line(message: str) -> str:
    """The ``hf download …`` command of a :class:`HubError`'s message, else the message itself."""
    match = re.search(r"(hf download .*?)(?: \(HF_HOME=[^)]*\))?$", message)
    return match.group(1) if match else message


def check_weights(model: ModelConfig, reward: RewardConfig, parts: RunParts, *, hub: bool = True) -> None:
    """Every checkpoint of the run is there before anything is built: local paths exist, and (``hub``: with
    ``HF_HUB_OFFLINE=1``) every Hub reference is in the Hugging Face cache. All missing pieces are collected, the
    model before its rewards: one of them is one line naming the repository, the revision and the command that fetches
    it; several are one error with one ``hf download`` line each (``parts``: the model family and rewards resolved,
    ``diffrl.run_parts``)."""
    missing: list[tuple[str, str]] = []  # (key, the whole message)
    for key, ref, kind in hub_weights(model, reward, parts, local=True):
        if not is_hub_ref(ref):
            if not Path(ref).expanduser().exists():
                what = "a local diffusers folder or a Hub id (org/name)" if kind == "family" else "a local path or a Hub id"
                missing.append((key, f"{key}={ref}: no such file or folder; give {what}"))
            continue
        if not hub:
            continue
        try:
            if kind != "family":
                resolve_weights(ref, kind, key=key)
            else:
                resolve_model_folder(ref, parts.family.hub_components, model.revision)
        except HubError as exc:
            missing.append((key, str(exc)))
    if len(missing) == 1:
        raise ConfigError(missing[0][1])
    if missing:
        lines = "\n".join(f"  {key}: {_fetch_line(message)}" if "hf download" in message else f"  {message}" for key, message in missing)
        where = f"from the Hugging Face cache {cache_dir()} (HF_HUB_OFFLINE=1) or the disk" if offline() else "from the disk"
        raise ConfigError(f"{len(missing)} checkpoints of this run are missing {where}; fetch or fix each, then run again:\n{lines}")


__all__ = ["check_weights", "hub_weights"]
