"""The config groups state each default once: a group yaml holds only what differs from its schema (the component's
dataclass, or the algorithm class's own ``Config``), every algorithm group starts from a registered class's schema,
and another algorithm's key is refused with the group it belongs to."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from diffrl.algorithms import ALGORITHMS
from diffrl.config import ModelConfig, RewardConfig, SamplerConfig
from diffrl.recipes import CONFIG_DIR, ConfigError, compose, to_config, validate
from diffrl.tools.cli import main

pytestmark = pytest.mark.exact  # messages, files and configs: no floats from different code paths (conftest.py)

GROUP_SCHEMAS = {"model": ModelConfig, "sampler": SamplerConfig, "reward": RewardConfig}


def _schema_of(group: str, path: Path) -> type:
    if group != "algorithm":
        return GROUP_SCHEMAS[group]
    match = re.search(r"^\s*-\s*schema_(\w+)\s*$", path.read_text(), re.M)
    assert match and match.group(1) in ALGORITHMS, f"{path} must start from a registered algorithm's schema (defaults: [schema_<name>])"
    return ALGORITHMS[match.group(1)].Config


def _restated(values: dict, defaults: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in values.items():
        if key == "defaults" or key not in defaults:
            continue
        if isinstance(value, dict) and isinstance(defaults[key], dict):
            out.extend(_restated(value, defaults[key], f"{prefix}{key}."))
        elif value == defaults[key]:
            out.append(f"{prefix}{key}: {value!r}")
    return out


@pytest.mark.parametrize("group", ["algorithm", "model", "sampler", "reward"])
def test_group_yaml_states_only_what_differs_from_its_schema(group):
    files = sorted((CONFIG_DIR / group).glob("*.yaml"))
    assert files
    restated = {}
    for path in files:
        values = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        defaults = OmegaConf.to_container(OmegaConf.structured(_schema_of(group, path)), resolve=False)
        if found := _restated(values, defaults):
            restated[path.name] = found
    assert not restated, f"these values repeat their dataclass default (state each default once, in the dataclass): {restated}"


def test_every_algorithm_group_composes_into_its_own_config_class():
    for path in sorted((CONFIG_DIR / "algorithm").glob("*.yaml")):
        cfg = validate(compose([f"algorithm={path.stem}"]))
        assert type(cfg.algorithm) is _schema_of("algorithm", path), path.name
        values = OmegaConf.load(path)
        assert cfg.algorithm.name == values.get("name", type(cfg.algorithm)().name)
    # the group decides the class: NFT's keys exist only under algorithm=nft, with NFTConfig's own defaults
    nft = validate(compose(["algorithm=nft"])).algorithm
    assert (nft.trainer, nft.nft_beta, nft.nft_adaptive_weight) == ("nft", 1.0, True) and not hasattr(nft, "clip_range")
    # a run's config.yaml (a plain dict) comes back as the same class
    assert type(to_config(OmegaConf.create(OmegaConf.to_container(compose(["experiment=digits_awm"]))))).__name__ == "Config"
    assert type(to_config(OmegaConf.create(OmegaConf.to_container(compose(["experiment=digits_awm"])))).algorithm).__name__ == "AWMConfig"


def test_another_algorithms_key_is_a_one_line_error_naming_its_group(capsys, tmp_path):
    with pytest.raises(ConfigError, match=r"'algorithm.nft_beta' belongs to another algorithm \(algorithm=nft\)"):
        compose(["experiment=digits_flow_grpo", "algorithm.nft_beta=2"])
    with pytest.raises(ConfigError, match=r"'algorithm.clip_range' belongs to another algorithm \(algorithm=.*flow_grpo"):
        compose(["experiment=digits_nft", "algorithm.clip_range=0.1"])
    with pytest.raises(ConfigError, match=r"algorithm.trainer=nft does not match the algorithm group.*algorithm=<name>"):
        compose(["algorithm.trainer=nft"])
    assert main(["train", "experiment=digits_dpo", "algorithm.awm_weighting=uniform", f"trainer.output_dir={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "algorithm=awm" in err and not (tmp_path / "r").exists()


def test_recipes_select_their_algorithm_by_group():
    expected = {"digits_nft": "NFTConfig", "digits_awm": "AWMConfig", "digits_dpo": "PreferenceConfig", "digits_ddpo": "PolicyGradientConfig"}
    for experiment, cls in expected.items():
        assert type(validate(compose([f"experiment={experiment}"])).algorithm).__name__ == cls
    ddpo = validate(compose(["experiment=digits_ddpo"])).algorithm
    assert (ddpo.loss, ddpo.clip_range, ddpo.adv_stat_tracker, ddpo.lr) == ("ddpo", 1e-4, True, 3e-3)
    assert {f.name for f in dataclasses.fields(type(ddpo))} >= {"loss", "clip_range", "rollout_is_cap"}


def test_function_defaults_agree_with_the_config():
    """Every default is stated once: an algorithm's objective takes its hyper-parameters from the Config (no defaults
    of its own), and a registered loss's keyword defaults, where they name a Config field, equal the Config's."""
    import inspect

    from diffrl.algorithms import RunContext
    from diffrl.algorithms.losses import LOSSES
    from diffrl.config import SamplerConfig

    run = RunContext(seed=0, prompts_per_step=2, group_size=2, sampler=SamplerConfig(), reward_weights={"digits": 1.0})
    for name, cls in ALGORITHMS.items():
        objective = cls(cls.Config(), run).objective()
        if inspect.isclass(type(objective)) and type(objective).__init__ is not object.__init__ and not callable(getattr(objective, "__wrapped__", None)):
            params = inspect.signature(type(objective).__init__).parameters.values()
            with_default = [p.name for p in params if p.name != "self" and p.default is not inspect.Parameter.empty]
            assert not with_default, f"{type(objective).__name__} ({name}) repeats defaults of {cls.Config.__name__}: {with_default}"
    config_defaults = {}
    for cls in ALGORITHMS.values():
        config_defaults.update({f.name: f.default for f in dataclasses.fields(cls.Config) if f.default is not dataclasses.MISSING})
    disagree = []
    for loss_name, fn in LOSSES.items():
        for p in inspect.signature(fn).parameters.values():
            if p.name in config_defaults and p.default is not inspect.Parameter.empty and p.default != config_defaults[p.name]:
                disagree.append((loss_name, p.name, p.default, config_defaults[p.name]))
    assert not disagree, disagree


def test_composition_is_cached_until_a_config_file_changes(tmp_path, monkeypatch):
    """``compose`` keeps Hydra's composition of the same overrides while no config file changes: equal results, each
    caller's copy its own (a change to one is not in the next), interpolations resolved afresh, and a changed or added
    file composes again."""
    import shutil

    import diffrl.recipes as recipes

    root = tmp_path / "configs"
    shutil.copytree(CONFIG_DIR, root)
    monkeypatch.setattr(recipes, "CONFIG_DIR", root)
    overrides = ["experiment=digits_nft", "trainer.steps=3"]
    first = compose(overrides)
    assert [k[1] for k in recipes._HYDRA_CACHE if k[0] == "config" and k[1] == tuple(overrides)] == [tuple(overrides)]
    first.trainer.steps = 99
    second = compose(overrides)
    assert second.trainer.steps == 3 and OmegaConf.to_container(second) == OmegaConf.to_container(compose(overrides))
    assert second.algorithm.name == "nft" and OmegaConf.get_type(second.algorithm).__name__ == type(to_config(second).algorithm).__name__
    # a recipe edited on disk is read again
    recipe = root / "experiment" / "digits_nft.yaml"
    recipe.write_text(recipe.read_text().replace("experiment: digits_nft", "experiment: digits_nft_edited"))
    assert compose(overrides).experiment == "digits_nft_edited"
    # interpolations resolve at each composition (what they read, e.g. the user's files, is read again)
    calls = []
    OmegaConf.register_new_resolver("composition_count", lambda: calls.append(1) or str(len(calls)), replace=True)
    (root / "experiment" / "counted.yaml").write_text("# @package _global_\nexperiment: run${composition_count:}\n")
    assert [compose(["experiment=counted"]).experiment for _ in range(2)] == ["run1", "run2"]
