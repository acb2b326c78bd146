"""Recipes: compose ``configs/`` with command-line overrides into the root :class:`Config`.

``configs/config.yaml`` composes the groups ``model/ algorithm/ reward/ sampler/ experiment/`` on top of
the schema registered here (hydra ConfigStore); an unknown key anywhere is an error naming the key. Each
``configs/algorithm/<name>.yaml`` starts from its algorithm class's own ``Config`` (stored as
``algorithm/schema_<registry name>`` for every registered class, ``diffrl.algorithms``) and states only what
differs from it, so a new algorithm's keys need no edit here, and another algorithm's key in a recipe is an error
that names the group it belongs to. :func:`to_config` turns the result into the components' dataclasses
(``diffrl.config`` and the algorithm's ``Config``).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from diffrl.algorithms import ALGORITHMS, algorithm_class, check_config, group_class
from diffrl.algorithms.policy_gradient import PolicyGradientConfig
from diffrl.config import (
    MOVED_KEYS, BatchPlan, Check, ConfigError, DistributedConfig, EvalConfig, ModelConfig, RewardConfig, SamplerConfig, TrainerConfig,
)
from diffrl.distributed.checks import validate_distributed
from diffrl.engine.checks import validate_model
from diffrl.hub import offline
from diffrl.run_parts import RunParts, resolve_parts
from diffrl.run_rewards import validate_rewards
from diffrl.run_weights import check_weights
from diffrl.sampling.checks import validate_sampler
from diffrl.sampling.evaluation_checks import validate_evaluation
from pipelines.base import family_class
from rewards.base import registered_names

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


@dataclass
class Config:
    """The root config of a run: one field per component."""

    experiment: str = "custom"
    """recipe name (set by experiment/*.yaml)"""
    model: ModelConfig = field(default_factory=ModelConfig)
    algorithm: Any = field(default_factory=PolicyGradientConfig)
    """the algorithm's own ``Config`` (a subclass of ``diffrl.config.AlgorithmConfig``), chosen by the algorithm group"""
    reward: RewardConfig = field(default_factory=RewardConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)


_REGISTERED: tuple = ()


def _register() -> None:
    """Store the schemas in Hydra's ConfigStore; again only when the algorithm registry changed (a plug-in registered a new
    one), since building the structured nodes took ~40 % of a composition."""
    global _REGISTERED
    from hydra.core.config_store import ConfigStore

    key = tuple((name, id(cls.Config)) for name, cls in ALGORITHMS.items())
    if key == _REGISTERED:
        return
    cs = ConfigStore.instance()
    root = OmegaConf.structured(Config)
    root.algorithm = "???"  # filled, typed, by the algorithm group's schema_<name>
    cs.store(name="diffrl_schema", node=root)
    cs.store(group="model", name="diffrl_schema", node=ModelConfig)
    for name, cls in ALGORITHMS.items():
        cs.store(group="algorithm", name=f"schema_{name}", node=cls.Config)
    cs.store(group="reward", name="diffrl_schema", node=RewardConfig)
    cs.store(group="sampler", name="diffrl_schema", node=SamplerConfig)
    _REGISTERED = key


def _asset_path(name: str) -> str:
    return str(CONFIG_DIR.parent / "assets" / name)


def _per_optimizer_step(steps: int, *, _root_) -> int:
    """``${optimizer_steps:k}``: the mini-batch that splits one RL step's trajectories (``trainer.prompts_per_step ×
    trainer.group_size``) into ``k`` optimizer steps, so a recipe states the paper's optimizer steps per RL step and keeps
    them when its sizes are changed (``+shrink=tiny``, or more prompts per step)."""
    for key in ("prompts_per_step", "group_size"):
        if int(_root_.trainer[key]) < 1:
            raise ValueError(f"trainer.{key}={_root_.trainer[key]} is invalid: it must be ≥ 1 (algorithm.mini_batch_size=${{optimizer_steps:{steps}}} "
                             "is derived from it)")
    batch = BatchPlan.of(_root_.trainer).rows
    if int(steps) < 1 or batch % int(steps):
        raise ValueError(f"algorithm.mini_batch_size=${{optimizer_steps:{steps}}}: {batch} trajectories per step "
                         f"(trainer.prompts_per_step × trainer.group_size) do not split into {steps} equal optimizer steps")
    return batch // int(steps)


def _prompts_required(what: str, *, _root_) -> str:
    """``trainer.prompts: ${prompts_required:'<what the recipe needs>'}``: a recipe that trains on the user's records (no
    built-in set stands in for them) is refused at composition, before anything is built, with one line saying what to
    give; ``trainer.prompts_if_missing`` (``+shrink=tiny``'s tiny records) is taken instead when set."""
    fallback = _root_.trainer.get("prompts_if_missing")
    if fallback:
        return str(fallback)
    raise ValueError(f"experiment={_root_.experiment} needs trainer.prompts=<{what}> (flow_grpo's datasets: diffrl prompts convert --help); "
                     "+shrink=tiny brings tiny stand-in records")


if not OmegaConf.has_resolver("prompts_required"):
    OmegaConf.register_new_resolver("prompts_required", _prompts_required)
if not OmegaConf.has_resolver("asset"):
    OmegaConf.register_new_resolver("asset", _asset_path)
if not OmegaConf.has_resolver("optimizer_steps"):
    OmegaConf.register_new_resolver("optimizer_steps", _per_optimizer_step)


def schema(trainer: str = "policy_gradient") -> DictConfig:
    """The root schema of a run whose algorithm class is ``trainer`` (its ``Config`` under ``algorithm``)."""
    root = OmegaConf.structured(Config)
    root.algorithm = OmegaConf.structured(algorithm_class(trainer).Config)
    OmegaConf.set_struct(root, True)
    OmegaConf.set_struct(root.reward.options, False)  # per-reward option dicts: +reward.options.<name>.<key>=
    OmegaConf.set_struct(root.model.options, False)  # adapter keyword arguments: +model.options.<key>=
    return root


@functools.lru_cache(maxsize=None)
def _merge_schema(trainer: str) -> DictConfig:
    """:func:`schema` built once per algorithm class, for ``OmegaConf.merge``'s first argument (which it copies)."""
    return schema(trainer)


def run_schema(node: Any) -> DictConfig:
    """The root schema that a run's stored config (``config.yaml``, a plain mapping or untyped ``DictConfig``) fits:
    its ``algorithm`` typed by the class that ``algorithm.trainer`` names (NFT's keys under ``NFTConfig``, …), the
    policy-gradient one when the run names none.

    Raises:
        ConfigError: the run names an algorithm class this diffrl does not register.
    """
    algorithm = node.get("algorithm") if isinstance(node, (DictConfig, dict)) else None
    try:
        return schema(group_class(algorithm or {}, _groups()))
    except ValueError as exc:
        raise ConfigError(f"{exc} (algorithm.trainer of the run's config)") from None


def _groups() -> list[str]:
    """The algorithm groups: ``configs/algorithm/*.yaml``."""
    return sorted(path.stem for path in (CONFIG_DIR / "algorithm").glob("*.yaml"))


def _groups_with(key: str) -> list[str]:
    """The algorithm groups (configs/algorithm/*.yaml) whose class declares ``key``."""
    owners = {name for name, cls in ALGORITHMS.items() if key in {f.name for f in dataclasses.fields(cls.Config)}}
    schemas = {g: re.search(r"^\s*-\s*schema_(\w+)", (CONFIG_DIR / "algorithm" / f"{g}.yaml").read_text(), re.M) for g in _groups()}
    return [g for g, match in schemas.items() if match and match.group(1) in owners]


def _valid_keys(dotted_parent: str) -> list[str]:
    node: Any = schema()
    for part in [p for p in dotted_parent.split(".") if p]:
        node = node.get(part) if isinstance(node, DictConfig) else None
    return sorted(node.keys()) if isinstance(node, DictConfig) else []


def _algorithm_keys(overrides: list[str], bad_key: str) -> list[str]:
    """The keys of the algorithm group the ``overrides`` select (composed again without the ones naming ``bad_key``);
    every registered algorithm's keys when that fails too."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    kept = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] != bad_key]
    try:
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cls = OmegaConf.get_type(hydra_compose(config_name="config", overrides=kept).algorithm)
        return sorted(f.name for f in dataclasses.fields(cls))
    except Exception:  # the overrides fail for another reason too: list every algorithm's keys
        return sorted({f.name for c in ALGORITHMS.values() for f in dataclasses.fields(c.Config)})


def moved_key_message(old: str) -> str:
    """The one line that refuses a key ``TrainerConfig`` held before it was split by concern (``MOVED_KEYS``)."""
    new = MOVED_KEYS[old]
    return f"{old} moved to {new}; set {new} instead (trainer.* is the loop, eval.* the evaluations, distributed.* the workers)"


def _moved_keys_in(node: Any) -> list[str]:
    """The old keys (``MOVED_KEYS``) under ``trainer`` of a config tree (a run's config.yaml written before the split)."""
    trainer = node.get("trainer") if isinstance(node, (DictConfig, dict)) else None
    return [f"trainer.{k}" for k in (trainer or {}) if f"trainer.{k}" in MOVED_KEYS]


def upgrade_run_config(node: dict) -> dict:
    """A run's stored config.yaml (a plain container) with the keys ``TrainerConfig`` held before its split moved to
    their new place (``MOVED_KEYS``), so that a run folder written before the split keeps its checkpoints usable by
    ``diffrl eval``/``sample``/``export-lora`` and the analysis helpers. A user's own overrides and recipes are refused
    instead (:func:`moved_key_message`)."""
    trainer = node.get("trainer") if isinstance(node, dict) else None
    for key in [k for k in (trainer or {}) if f"trainer.{k}" in MOVED_KEYS]:
        group, new = MOVED_KEYS[f"trainer.{key}"].split(".", 1)
        node.setdefault(group, {})[new] = trainer.pop(key)
    return node


def did_you_mean(word: str, choices: list[str], n: int = 3) -> str:
    """`` (did you mean 'a' or 'b'?)`` for the closest few of ``choices`` to ``word`` (by difflib's ratio; ``-`` and ``_``
    alike), or an empty string when none is close."""
    norm = {c.replace("-", "_").lower(): c for c in choices}
    close = [norm[c] for c in difflib.get_close_matches(word.replace("-", "_").lower(), list(norm), n=n, cutoff=0.6)]
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def _explain_group(text: str) -> str | None:
    """Hydra's "Could not find 'group/option'" as one line: the option the user typed, the closest options, and the
    group's options without the internal ``schema_*`` ones and without Hydra's search path."""
    match = re.search(r"Could not find '(\w+)/([^']*)'", text)
    if not match:
        return None
    group, option = match.groups()
    options = sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml")) if (CONFIG_DIR / group).is_dir() else []
    hint = did_you_mean(option, options)
    listed = f"choose one of: {', '.join(options)}" if len(options) <= 15 or not hint else f"the {len(options)} options are configs/{group}/*.yaml"
    if group == "reward" and option in registered_names():  # a reward's name where its config group was meant
        listed += f"; to train on the reward '{option}', set reward.names=[{option}] (reward=<group> picks a group of settings)"
    return f"{group}={option}: no such {group} config{hint}; {listed}"


def _unknown_key(full: str, where: str, valid: list[str], see: str) -> str:
    """An unknown key: the closest valid keys when some are close, else every valid key of its parent."""
    hint = did_you_mean(full.rsplit(".", 1)[-1], valid)
    listed = "" if hint else f"; valid keys{where}: {valid}"
    return f"unknown config key '{full}'{where}{hint}{listed}. Check the spelling (see {see})."


def _explain(exc: Exception, overrides: list[str] | None = None) -> str:
    """Turn hydra/omegaconf errors into one message that names the key and the valid choices."""
    text = str(exc)
    group = _explain_group(text)
    if group:
        return group
    moved = [k for k in re.findall(r"\btrainer\.\w+", f"{text} {getattr(exc, 'full_key', None) or ''}") if k in MOVED_KEYS]
    if moved:  # set, appended or deleted: the key is elsewhere now
        return moved_key_message(moved[0])
    match = re.search(r"Could not override '([^']+)'", text) or re.search(r"Key '([^']+)' (?:is )?not in", text)
    if match:
        key = match.group(1)
        full = getattr(exc, "full_key", None) or key
        parent = full.rsplit(".", 1)[0] if "." in full else ""
        where = f" under '{parent}'" if parent else ""
        if parent == "algorithm":
            owners = _groups_with(full.rsplit(".", 1)[1])
            if owners:
                return (f"config key '{full}' belongs to another algorithm (algorithm={' | '.join(owners)}), not to the one this recipe selects; "
                        f"select its group (algorithm=<name>, or 'override /algorithm: <name>' in a recipe) or drop the key")
            valid = _algorithm_keys(list(overrides or []), full)
            return _unknown_key(full, where, valid, "the algorithm's Config in diffrl/algorithms/")
        if not parent and (CONFIG_DIR / full).is_dir():  # `shrink=tiny`: an optional group is added with +
            options = sorted(p.stem for p in (CONFIG_DIR / full).glob("*.yaml"))
            typed = next((o for o in overrides or [] if o.split("=", 1)[0] == full), f"{full}=<option>")
            return f"{typed}: {full} is an optional config group, added with a +: +{typed} (options: {', '.join(options)})"
        return _unknown_key(full, where, _valid_keys(parent), "diffrl/config.py and the algorithm's module in diffrl/algorithms/")
    cause = exc.__cause__ or exc.__context__
    if "raised while resolving interpolation" in text and cause is not None:
        return " ".join(str(cause).split())
    full = f"{text}\n{cause or ''}"
    override = re.search(r"Error merging override ([^=\s]+)=(\S*)", full)
    if override:
        reason = str(cause or text).splitlines()[0].strip()
        converted = re.search(r"Value '(.*?)' of type '(\w+)' could not be converted to (\w+)", reason)
        if converted:
            reason = f"it must be {'an' if converted.group(3)[0] in 'AEIOUaeiou' else 'a'} {converted.group(3).lower()}"
        return f"{override.group(1)}={override.group(2)} has the wrong type: {reason} (see diffrl/config.py)"
    return _without_internals(" ".join((f"invalid configuration: {text}" + (f" ({cause})" if cause else "")).split()))


def _without_internals(message: str) -> str:
    """A Hydra message without its search path and the internal ``schema_*`` options (never what a user types)."""
    message = re.split(r"\s*Config search path:", message)[0]
    return re.sub(r"\s*\bschema_\w+", "", message).replace("diffrl_schema", "the schema")


def _name_from_group(cfg: DictConfig, group: str) -> None:
    """``algorithm.name`` is the algorithm group's name (``algorithm=<group>`` chooses the algorithm): a value naming
    another group, or any other word, is refused in one line rather than kept as a label over another algorithm."""
    name = cfg.algorithm.get("name")
    if name not in (None, group):
        other = f"it names another algorithm: select it with algorithm={name}" if name in _groups() else "it is not a setting"
        raise ConfigError(f"algorithm.name={name} does not match the algorithm group algorithm={group}; algorithm.name follows the group, "
                          f"{other} (run names: trainer.output_dir, trainer.wandb_run_name)")
    cfg.algorithm.name = group


# Hydra's composition of (config name, overrides), unresolved, while the config files are unchanged: Hydra reads and
# parses every YAML file of the defaults tree again at each composition (~0.15 s, most of a `compose`), and a process
# that composes often (the test suite: ~30 % of its CLI tests' time) gets a copy instead. Interpolations stay
# unresolved here, so what they read (assets, the user's files) is read at each composition as before.
_HYDRA_CACHE: dict[tuple, DictConfig] = {}
_HYDRA_CACHE_SIZE = 256


def _config_files_stamp() -> tuple:
    """Every config file's path, size and modification time: a change to any of them composes afresh."""
    return tuple(sorted((str(p), st.st_size, st.st_mtime_ns) for p in CONFIG_DIR.rglob("*.yaml") for st in [p.stat()]))


def _hydra_compose(config_name: str, overrides: list[str]) -> tuple[DictConfig, str | None]:
    """Hydra's composition without its ``hydra`` node (a copy), and the algorithm group chosen."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    key = (config_name, tuple(overrides), _config_files_stamp())
    cached = _HYDRA_CACHE.get(key)
    if cached is None:
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides), return_hydra_config=True)
        group = cfg.hydra.runtime.choices.get("algorithm")
        with open_dict(cfg):
            del cfg["hydra"]
        if len(_HYDRA_CACHE) >= _HYDRA_CACHE_SIZE:
            _HYDRA_CACHE.pop(next(iter(_HYDRA_CACHE)))
        cached = _HYDRA_CACHE[key] = (cfg, None if group is None else str(group))
    return copy.deepcopy(cached[0]), cached[1]


def compose(overrides: list[str] | None = None, config_name: str = "config") -> DictConfig:
    """Compose ``configs/<config_name>.yaml`` with command-line ``overrides`` (hydra syntax).

    Raises:
        ConfigError: naming the offending key or group option, with the valid choices where known.
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    _register()
    try:
        cfg, group = _hydra_compose(config_name, list(overrides or []))
        try:
            name = group_class(cfg.algorithm, _groups())
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if group is not None:
            _name_from_group(cfg, str(group))
        cfg_typed = OmegaConf.merge(_merge_schema(name), OmegaConf.to_container(cfg, resolve=False))
        OmegaConf.resolve(cfg_typed)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(_explain(exc, overrides)) from None
    OmegaConf.set_struct(cfg_typed, True)
    return cfg_typed


def to_config(cfg: DictConfig | Config) -> Config:
    """The composed config as the dataclasses the components consume (``OmegaConf.to_object``)."""
    if isinstance(cfg, Config):
        return cfg
    if not isinstance(cfg, DictConfig) or OmegaConf.get_type(cfg) is not Config:  # e.g. a run's config.yaml: add the schema
        node = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
        moved = _moved_keys_in(node)
        if moved:
            raise ConfigError(moved_key_message(moved[0]))
        cfg = OmegaConf.merge(run_schema(node), cfg)
    return OmegaConf.to_object(cfg)


def _checks(obj: Any) -> dict[str, Check]:
    merged: dict[str, Check] = {}
    for klass in reversed(type(obj).__mro__):
        merged.update(vars(klass).get("CHECKS") or {})
    return merged


def checked_keys(obj: Any, prefix: str = "") -> list[tuple[str, Any, Check]]:
    """``(dotted key, value, check)`` of every key with a value check in a config (dataclass) tree."""
    checks, out = _checks(obj), []
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out.extend(checked_keys(value, key + "."))
        elif f.name in checks:
            out.append((key, value, checks[f.name]))
    return out


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_sizes(cfg: Config | DictConfig, *, backend: bool = True) -> None:
    """Global sizes against workers and mini-batches, before any work: a clear error with valid sizes
    (``diffrl.distributed.checks.validate_distributed`` on the run's :class:`~diffrl.config.BatchPlan`). The backend first unless
    ``backend`` is false (``diffrl plan`` plans N Ray ranks on a machine without Ray)."""
    cfg = to_config(cfg)
    batch = BatchPlan.of(cfg.trainer, cfg.distributed, cfg.model, cfg.algorithm)
    validate_distributed(cfg.distributed, batch, cfg.model, cfg.sampler, family_class(cfg.model.family), async_chunks=int(cfg.reward.async_chunks),
                         ema=bool(cfg.eval.ema), backend=backend)


def validate(cfg: Config | DictConfig, *, hub_cache: bool = True) -> Config:
    """Check every value of a run's config before anything is built; return it as :class:`Config`
    (:func:`validate_and_resolve`, the parts it resolves left out)."""
    return validate_and_resolve(cfg, hub_cache=hub_cache)[0]


def validate_and_resolve(cfg: Config | DictConfig, *, hub_cache: bool = True) -> tuple[Config, RunParts]:
    """Check every value of a run's config before anything is built; return it as :class:`Config`, with the model family
    and the rewards it names resolved (:class:`~diffrl.run_parts.RunParts`: what the run builds them from).

    Ranges and choices come from each config class's ``CHECKS`` (``diffrl.config`` and each algorithm's
    ``Config``); then each component checks its own config, reading no weights and building nothing: the sampler
    (``diffrl.sampling.checks``), the algorithm (its ``Config``), the evaluations (``diffrl.sampling.evaluation_checks``);
    then the model family with its options and every reward are resolved (``diffrl.run_parts``), once, and checked
    against: the rewards and the prompts they score (``diffrl.run_rewards``), the model (``diffrl.engine.checks``), and
    last every checkpoint the run loads (``diffrl.run_weights``; with ``hub_cache``). The error is one line naming the
    key, the value and what is valid.
    """
    cfg = to_config(cfg)
    first = ("trainer.", "distributed.")  # the sizes others derive from (${optimizer_steps:k}) are named before what they give
    for key, value, check in sorted(checked_keys(cfg), key=lambda item: not item[0].startswith(first)):
        if value is not None and not check.ok(value):
            raise ConfigError(f"{key}={value!r} is invalid: it must be {check.describe()}")
    validate_sampler(cfg.sampler)
    betas = list(cfg.algorithm.betas)
    _require(len(betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas),
            f"algorithm.betas={betas} is invalid: it must be two numbers in [0, 1)")
    try:
        check_config(cfg.algorithm)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    validate_evaluation(cfg.eval, cfg.reward)
    parts = resolve_parts(cfg.model, cfg.reward)
    validate_rewards(cfg.reward, {"trainer.prompts": cfg.trainer.prompts, "eval.prompts": cfg.eval.prompts}, parts.rewards)
    validate_model(cfg.model, parts.family)
    if hub_cache:
        check_weights(cfg.model, cfg.reward, parts, hub=offline())
    return cfg, parts
