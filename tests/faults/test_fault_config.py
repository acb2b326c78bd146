"""Fault injection, config values: every key with a value check is tried with the values it must reject
(zero, negative, just out of range, non-integer, wrong type, unknown choice), plus the registry-backed
keys and wrong types through the command line. Each answer is a one-line ``ConfigError`` that names the
key, given by ``Trainer`` before any model is built; zero where it means "never" is honoured."""

from __future__ import annotations

import copy
import json
from collections import Counter

import pytest

import diffrl.run_setup as run_setup
from diffrl.recipes import ConfigError, checked_keys, compose, to_config, validate
from diffrl.tools.cli import main
from diffrl.trainer import Trainer

# through the command line (hydra parsing and the registries): (override, the key the error must name)
pytestmark = pytest.mark.exact  # messages, files and configs: no floats from different code paths (conftest.py)

COMMAND_LINE_CASES = [
    ("trainer.steps=abc", "trainer.steps"), ("trainer.group_size=1.5", "trainer.group_size"), ("sampler.noise_level=x", "sampler.noise_level"),
    ("trainer.progress=maybe", "trainer.progress"), ("sampler.window_range=7", "sampler.window_range"), ("reward.weights=[a]", "reward.weights"),
    ("algorithm.lr=fast", "algorithm.lr"), ("model.lora.rank=two", "model.lora.rank"), ("trainer.stepz=3", "trainer.stepz"),
    ("sampler.kind=euler_x", "sampler.kind"), ("sampler.ode_solver=rk4", "sampler.ode_solver"), ("sampler.window=sliding", "sampler.window"),
    ("sampler.window_range=[5,2]", "sampler.window_range"), ("sampler.window_range=[0,99]", "sampler.window_range"),
    ("experiment=digits_flow_grpo_fast sampler.window_size=20", "sampler.window_size"), ("model.family=sdxl", "model family"),
    ("model.device=gpu", "model.device"), ("+model.options.bogus=1", "bogus"), ("reward.names=[nope]", "nope"), ("reward.gold=nope", "nope"),
    ("reward.weights=[1,2]", "reward.weights"), ("reward.names=[]", "reward.names"), ("algorithm.trainer=ppo", "algorithm.trainer"),
    ("algorithm.betas=[0.9]", "algorithm.betas"), ("algorithm.betas=[0.9,1.0]", "algorithm.betas"), ("reward.weights=[.inf]", "reward.weights"),
]


@pytest.fixture(scope="module")
def base():
    return to_config(compose([]))


@pytest.fixture
def no_model(monkeypatch):
    """Building the workers (the model) fails the test: every error must come before it."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built for an invalid config")

    monkeypatch.setattr(run_setup, "build_worker_group", refuse)


def _set(cfg, key: str, value) -> None:
    *path, name = key.split(".")
    obj = cfg
    for part in path:
        obj = getattr(obj, part)
    setattr(obj, name, value)


def _one_line_naming(exc: BaseException, key: str) -> str:
    text = str(exc)
    assert "\n" not in text, text
    assert key in text, (key, text)
    return text


def test_every_checked_key_rejects_its_bad_values_before_any_model(base, no_model):
    keys = checked_keys(base)
    assert len(keys) >= 60, len(keys)
    outcomes: Counter = Counter()
    for key, _, check in keys:
        bad = check.rejected_examples()
        assert len(bad) >= 2, (key, bad)
        for value in bad:
            cfg = copy.deepcopy(base)
            _set(cfg, key, value)
            with pytest.raises(ConfigError) as info:
                Trainer(cfg)
            text = _one_line_naming(info.value, f"{key}=")
            assert check.describe() in text, text  # the valid range or choices are stated
            outcomes["clean error"] += 1
    assert outcomes["clean error"] >= 250, outcomes  # ≥ 60 keys × their bad values, all caught
    # the defaults themselves pass, and the boundary values that mean "never" are valid
    for key in ("eval.every", "trainer.checkpoint_every", "sampler.noise_level", "algorithm.kl_beta", "model.lora.rank"):
        cfg = copy.deepcopy(base)
        _set(cfg, key, 0)
        validate(cfg)


@pytest.mark.parametrize("overrides,key", COMMAND_LINE_CASES, ids=[c[0] for c in COMMAND_LINE_CASES])
def test_command_line_bad_values_are_one_line_errors(overrides, key, no_model):
    with pytest.raises((ConfigError, ValueError)) as info:
        Trainer(compose(overrides.split()))
    _one_line_naming(info.value, key)


def test_cli_prints_one_line_and_exits_2(capsys, tmp_path):
    out = tmp_path / "run"
    assert main(["train", "trainer.steps=0", f"trainer.output_dir={out}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["diffrl: error: trainer.steps=0 is invalid: it must be an integer ≥ 1"]
    assert not out.exists()  # nothing was written


def test_zero_intervals_mean_only_at_the_ends(tmp_path):
    out = tmp_path / "run"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red seven\na blue two\n")
    Trainer(compose([
        "sampler.num_steps=3", "sampler.eval_num_steps=2", "trainer.steps=3", "trainer.prompts_per_step=2", "trainer.group_size=2",
        "eval.seeds_per_prompt=1", "eval.every=0", "trainer.checkpoint_every=0", "trainer.threads=1", "trainer.wandb=disabled",
        f"trainer.output_dir={out}", "trainer.progress=false", f"trainer.prompts={prompts}",
    ])).fit()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 3]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000003"]
