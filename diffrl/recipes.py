"""Recipes: compose ``configs/`` with command-line overrides into the root :class:`Config`.

``configs/config.yaml`` composes the groups ``model/ algorithm/ reward/ sampler/ experiment/`` on top of
the schema registered here (hydra ConfigStore); an unknown key anywhere is an error naming the key. The
``algorithm`` schema is the union of the registered algorithms' configs (``diffrl.algorithms``), so a new
algorithm's keys are valid without an edit here. :func:`to_config` turns the result into the components'
dataclasses (``diffrl.config``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from diffrl.algorithms import config_schema
from diffrl.config import ModelConfig, RewardConfig, SamplerConfig, TrainerConfig

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


AlgorithmSchema = config_schema()
"""The ``algorithm`` group's schema: the fields of every registered algorithm's ``Config``."""


@dataclass
class Config:
    """The root config of a run: one field per component."""

    experiment: str = "custom"
    """recipe name (set by experiment/*.yaml)"""
    model: ModelConfig = field(default_factory=ModelConfig)
    algorithm: AlgorithmSchema = field(default_factory=AlgorithmSchema)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


class ConfigError(ValueError):
    """A config that cannot be composed (unknown key, bad value, unknown group option)."""


def _register() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="diffrl_schema", node=Config)
    cs.store(group="model", name="diffrl_schema", node=ModelConfig)
    cs.store(group="algorithm", name="diffrl_schema", node=AlgorithmSchema)
    cs.store(group="reward", name="diffrl_schema", node=RewardConfig)
    cs.store(group="sampler", name="diffrl_schema", node=SamplerConfig)


def _asset_path(name: str) -> str:
    return str(CONFIG_DIR.parent / "assets" / name)


if not OmegaConf.has_resolver("asset"):
    OmegaConf.register_new_resolver("asset", _asset_path)


def _valid_keys(dotted_parent: str) -> list[str]:
    node: Any = OmegaConf.structured(Config)
    for part in [p for p in dotted_parent.split(".") if p]:
        node = node.get(part) if isinstance(node, DictConfig) else None
    return sorted(node.keys()) if isinstance(node, DictConfig) else []


def _explain(exc: Exception) -> str:
    """Turn hydra/omegaconf errors into one message that names the key and the valid choices."""
    text = str(exc)
    match = re.search(r"Could not override '([^']+)'", text) or re.search(r"Key '([^']+)' (?:is )?not in", text)
    if match:
        key = match.group(1)
        full = getattr(exc, "full_key", None) or key
        parent = full.rsplit(".", 1)[0] if "." in full else ""
        valid = _valid_keys(parent)
        where = f" under '{parent}'" if parent else ""
        return f"unknown config key '{full}'{where}; valid keys{where}: {valid}. Check the spelling (see diffrl/config.py and the algorithm's module in diffrl/algorithms/)."
    cause = exc.__cause__ or exc.__context__
    return f"invalid configuration: {text}" + (f" ({cause})" if cause else "")


def compose(overrides: list[str] | None = None, config_name: str = "config") -> DictConfig:
    """Compose ``configs/<config_name>.yaml`` with command-line ``overrides`` (hydra syntax).

    Raises:
        ConfigError: naming the offending key or group option, with the valid choices where known.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    _register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides or []))
        schema = OmegaConf.structured(Config)
        OmegaConf.set_struct(schema, True)
        OmegaConf.set_struct(schema.reward.options, False)  # per-reward option dicts: +reward.options.<name>.<key>=
        OmegaConf.set_struct(schema.model.options, False)  # adapter keyword arguments: +model.options.<key>=
        cfg_typed = OmegaConf.merge(schema, OmegaConf.to_container(cfg, resolve=False))
        OmegaConf.resolve(cfg_typed)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(_explain(exc)) from None
    OmegaConf.set_struct(cfg_typed, True)
    return cfg_typed


def to_config(cfg: DictConfig | Config) -> Config:
    """The composed config as the dataclasses the components consume (``OmegaConf.to_object``)."""
    if isinstance(cfg, Config):
        return cfg
    if not isinstance(cfg, DictConfig) or OmegaConf.get_type(cfg) is not Config:  # e.g. a run's config.yaml: add the schema
        schema = OmegaConf.structured(Config)
        OmegaConf.set_struct(schema.reward.options, False)
        OmegaConf.set_struct(schema.model.options, False)
        cfg = OmegaConf.merge(schema, cfg)
    return OmegaConf.to_object(cfg)
