"""Bad input fails loudly, names the cause, and loses nothing already written."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_engine

from diffrl.checkpoint import list_checkpoints, load_engine
from diffrl.config import MOVED_KEYS, DistributedConfig, EvalConfig, SamplerConfig
from diffrl.engine.engine import DiffusionEngine
from diffrl.logging import read_jsonl
from diffrl.recipes import ConfigError, compose, to_config
from diffrl.tools.cli import main
from pipelines.digits import DigitsAdapter
from rewards.base import Reward, RewardError, register_reward, score

pytestmark = pytest.mark.exact  # messages, files and configs: no floats from different code paths (conftest.py)

SHORT = ["trainer.steps=2", "trainer.prompts_per_step=2", "trainer.group_size=4", "eval.seeds_per_prompt=1", "eval.num_prompts=8",
         "trainer.progress=false", "algorithm.mini_batch_size=null", "sampler.num_steps=4", "sampler.eval_num_steps=4"]


def test_unknown_config_key_is_named():
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer\.stepz'.*steps"):
        compose(["trainer.stepz=3"])
    with pytest.raises(ConfigError, match=r"unknown config key 'algorithm\.klbeta'.*kl_beta"):
        compose(["+algorithm.klbeta=0.1"])


def test_misspelt_groups_and_keys_get_the_closest_names_not_hydras_internals():
    """What the user typed, the closest few names and no internal ``schema_*`` option, no Hydra search path, one line."""
    cases = [
        (["algorithm=flow-grpo"], "algorithm=flow-grpo: no such algorithm config (did you mean 'flow_grpo'"),
        (["experiment=digits_ftf"], "experiment=digits_ftf: no such experiment config (did you mean 'digits_nft'"),
        (["trainer.stepz=3"], "unknown config key 'trainer.stepz' under 'trainer' (did you mean 'steps'?)"),
    ]
    for overrides, start in cases:
        with pytest.raises(ConfigError) as info:
            compose(overrides)
        message = str(info.value)
        assert message.startswith(start), message
        assert "schema_" not in message and "search path" not in message and "\n" not in message
    with pytest.raises(ConfigError) as info:  # a long list is named by its folder once a close name is offered
        compose(["experiment=digits_ftf"])
    assert "configs/experiment/*.yaml" in str(info.value) and "sd35m_" not in str(info.value)
    with pytest.raises(ConfigError) as info:  # nothing close: the valid keys
        compose(["trainer.qqq=1"])
    assert "did you mean" not in str(info.value) and "'prompts_per_step'" in str(info.value)


def test_a_missing_prompt_file_lists_the_built_in_sets(tmp_path, capsys):
    from diffrl.prompt_sets import prompt_set_names

    assert main(["train", "trainer.prompts=nope", f"trainer.output_dir={tmp_path / 'run'}", *SHORT]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "prompt file nope does not exist (trainer.prompts)" in err[0], err
    assert all(name in err[0] for name in prompt_set_names()) and not (tmp_path / "run").exists()


def test_cli_unknown_key_exits_with_message(capsys):
    assert main(["train", "model.lora.rnk=4"]) == 2
    err = capsys.readouterr().err
    assert "model.lora.rnk" in err and "rank" in err


@pytest.mark.parametrize("old", sorted(MOVED_KEYS))
def test_a_key_trainer_config_held_before_its_split_names_its_new_place(old):
    """``TrainerConfig`` was split by concern (``eval.*``, ``distributed.*``): each old key, set, added or deleted, is
    refused by one line naming the new key, and the new key holds the value."""
    new = MOVED_KEYS[old]
    for override in (f"{old}=1", f"+{old}=1", f"~{old}"):
        with pytest.raises(ConfigError) as info:
            compose([override])
        assert str(info.value).startswith(f"{old} moved to {new}; set {new} instead") and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match=rf"^{re.escape(old)} moved to {re.escape(new)}"):  # a run's config.yaml written before the split
        to_config({"trainer": {old.split(".", 1)[1]: 1}})
    group, key = new.split(".")
    assert key in {f.name for f in dataclasses.fields({"eval": EvalConfig, "distributed": DistributedConfig}[group])}


def test_a_run_folder_written_before_the_split_stays_usable(tmp_path):
    """A run's stored config.yaml with the old trainer.* keys: diffrl eval/sample's loader and the analysis helpers
    read it with each value at its new key (its checkpoints stay usable); only a user's own overrides are refused."""
    from omegaconf import OmegaConf

    from diffrl.tools.analysis import load_run
    from diffrl.tools.commands import load_config

    stored = OmegaConf.to_container(compose([]))
    old = {"eval_every": 7, "eval_seeds_per_prompt": 3, "select_by": "eval/gold_accuracy", "num_workers": 2, "max_staleness": 1}
    for key in old:
        group, new = MOVED_KEYS[f"trainer.{key}"].split(".")
        stored[group].pop(new)
    stored["trainer"].update(old)
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(stored))
    (tmp_path / "metrics.jsonl").write_text('{"kind": "eval", "step": 0, "eval/gold_accuracy": 0.5}\n')
    cfg = load_config(["eval.seed=99"], tmp_path / "config.yaml")
    for key, value in old.items():
        group, new = MOVED_KEYS[f"trainer.{key}"].split(".")
        assert cfg[group][new] == value and key not in cfg.trainer
    assert cfg.eval.seed == 99
    assert load_run(tmp_path).config["eval"]["every"] == 7
    with pytest.raises(ConfigError, match=r"^trainer.eval_every moved to eval.every"):
        load_config(["trainer.eval_every=2"], tmp_path / "config.yaml")


def test_cli_refuses_a_moved_key_with_one_line_and_exit_2(capsys, monkeypatch):
    monkeypatch.delenv("DIFFRL_TRACEBACK", raising=False)
    assert main(["train", "trainer.eval_every=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("diffrl: error: trainer.eval_every moved to eval.every; set eval.every instead "
                   "(trainer.* is the loop, eval.* the evaluations, distributed.* the workers)"), err


def test_model_and_reward_options_reach_the_adapter_and_reward(capsys):
    from diffrl.run_setup import worker_config
    from pipelines import build_adapter

    cfg = compose(["model=sd3_tiny", "+model.options.decode_chunk=3", "+model.options.max_sequence_length=16",
                   "+reward.options.jpeg_compressibility.quality=50"])
    kwargs = worker_config(cfg).model.adapter_kwargs()
    assert kwargs["decode_chunk"] == 3 and kwargs["max_sequence_length"] == 16 and kwargs["path"] is None
    adapter = build_adapter("sd3", **kwargs)
    assert adapter.decode_chunk == 3 and adapter.max_sequence_length == 16
    assert cfg.reward.options.jpeg_compressibility.quality == 50
    with pytest.raises(ValueError, match=r"takes no option\(s\) \['decode_chonk'\].*decode_chunk"):
        build_adapter("sd3", **{**kwargs, "decode_chonk": 2})
    assert main(["train", "model=sd3_tiny", "+model.options.decode_chonk=2", "trainer.wandb=disabled"]) == 2
    assert "decode_chonk" in capsys.readouterr().err


def test_lora_target_modules_from_config():
    from diffrl.run_setup import worker_config

    cfg = compose(["model.lora.target_modules=[to_q,to_v]"])
    config = worker_config(cfg)
    assert config.model.lora.target_modules == ["to_q", "to_v"]
    engine = DiffusionEngine(DigitsAdapter(path=None), model=config.model, optim=config.optim, sampler=SamplerConfig(num_steps=2))
    engine.initialize()
    wrapped = {n.rsplit(".lora_A", 1)[0].rsplit(".", 1)[-1] for n, _ in engine.module.named_parameters() if ".lora_A." in n}
    assert wrapped == {"to_q", "to_v"}
    assert worker_config(compose([])).model.lora.target_modules is None  # the family's default


def test_missing_asset_path_is_named(tmp_path, capsys):
    missing = tmp_path / "no_such_model"
    assert main(["train", f"model.path={missing}", f"trainer.output_dir={tmp_path / 'run'}", *SHORT]) == 2
    assert str(missing) in capsys.readouterr().err
    partial = tmp_path / "partial"
    (partial / "transformer").mkdir(parents=True)
    (partial / "transformer" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="diffusion_pytorch_model.safetensors"):
        DigitsAdapter(path=str(partial))


def test_reward_output_checked_names_reward_and_sample():
    images = torch.zeros(3, 3, 16, 16, dtype=torch.uint8)
    prompts = ["a red one"] * 3

    def nan_at_one(images, prompts, metadata):
        return {"nanny": torch.tensor([0.5, float("nan"), 0.1])}

    with pytest.raises(RewardError, match=r"reward 'nanny' returned nan for sample 1"):
        score({"nanny": (nan_at_one, 1.0)}, images, prompts)
    with pytest.raises(RewardError, match=r"reward 'short'.*shape \(2,\)"):
        score({"short": (lambda i, p, m: {"short": torch.zeros(2)}, 1.0)}, images, prompts)


@register_reward("test_nan_after_first_call")
class NanAfterFirstCall(Reward):
    """Finite on its first call, NaN afterwards: a reward that breaks mid-run."""

    calls = 0

    def __call__(self, images, prompts, metadata=None):
        type(self).calls += 1
        value = torch.full((images.shape[0],), 0.5) if type(self).calls <= 2 else torch.full((images.shape[0],), float("nan"))
        return {self.name: value + torch.arange(images.shape[0]) * 0.01}


def test_nan_reward_mid_run_keeps_what_was_written(tmp_path, capsys):
    """Call 1 is the evaluation before training, call 2 step 1, call 3 (step 2) is NaN."""
    out = tmp_path / "run"
    code = main(["train", f"trainer.output_dir={out}", "reward.names=[test_nan_after_first_call]", "reward.gold=null",
                 "trainer.checkpoint_every=1", *SHORT])
    assert code == 3  # a run stopped on a fault
    err = capsys.readouterr().err
    assert "test_nan_after_first_call" in err and "sample 0" in err and "step_000001 holds the 1 steps done" in err
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["kind"] for r in records] == ["eval", "train"]  # everything finished before the failure is kept
    ckpts = list_checkpoints(out / "checkpoints")
    assert [p.name for p in ckpts] == ["step_000001"]
    engine = make_engine(DigitsAdapter(path=str(Path(__file__).resolve().parents[1] / "assets" / "digits")), SamplerConfig(num_steps=4))
    state = load_engine(engine, ckpts[0])  # the checkpoint written before the failure is complete and loads
    assert state["global_step"] == 1
    assert not (out / "summary.json").exists()
    # a second run into the same folder refuses instead of overwriting
    assert main(["train", f"trainer.output_dir={out}", *SHORT]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert len(read_jsonl(out / "metrics.jsonl")) == 2


def test_console_script_entry_point_runs():
    """`python -m diffrl.tools.cli` (what the `diffrl` script calls) reports a bad key and exits 2."""
    proc = subprocess.run([sys.executable, "-m", "diffrl.tools.cli", "train", "trainer.nope=1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "trainer.nope" in proc.stderr
