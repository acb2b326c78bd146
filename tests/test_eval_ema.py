"""``eval.ema``: evaluation on an EMA of the trained LoRA (flow_grpo's ``train.ema``).

The EMA is a LoRA adapter ``ema``: a copy of the initial adapter, moved towards the trained one every ``ema_every`` RL
steps with decay ``min((1 + s)/(10 + s), ema_decay)``. Checked here: the closed form step by step from the
checkpoints, exact resume, that evaluations (the trainer's and ``diffrl eval``'s) sample it, ``export-lora --adapter``,
and the one-line errors for settings that cannot work."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import tiny_run_overrides
from safetensors.torch import load_file

from diffrl.logging import read_jsonl
from diffrl.recipes import ConfigError, compose
from diffrl.tools.cli import main
from diffrl.run_evaluation import ema_decay
from diffrl.trainer import Trainer

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = ["a red seven", "a green three", "a blue one", "a yellow zero"]


def _overrides(tmp_path, out, steps, *extra):
    return tiny_run_overrides(tmp_path, out, steps, PROMPTS, "algorithm.lr=0.01", "eval.ema=true", "eval.ema_every=1", *extra, checkpoint_every=1)


def _weights(run, step):
    return load_file(str(run / "checkpoints" / f"step_{step:06d}" / "model.safetensors"))


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ema")
    out = tmp / "straight"
    Trainer(compose(_overrides(tmp, out, 4))).fit()
    return tmp, out


def test_ema_adapter_follows_the_warm_up_schedule_in_closed_form(ema_run):
    _, run = ema_run
    assert [ema_decay(s, 0.9) for s in (1, 2, 80, 1000)] == [2 / 11, 3 / 12, 0.9, 0.9]
    records = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["ema_decay"] for r in records] == [ema_decay(s, 0.9) for s in (1, 2, 3, 4)]
    w = {s: _weights(run, s) for s in (1, 2, 3, 4)}
    ema_keys = [k for k in w[1] if ".ema." in k]
    assert ema_keys and len(ema_keys) == len([k for k in w[1] if ".default." in k])
    for k in ema_keys:
        trained = k.replace(".ema.", ".default.")
        if ".lora_B." in k:  # the EMA starts at the initial adapter, whose B is zero
            torch.testing.assert_close(w[1][k], (1 - 2 / 11) * w[1][trained], rtol=1e-6, atol=0)
        for s in (2, 3, 4):
            d = ema_decay(s, 0.9)
            torch.testing.assert_close(w[s][k], d * w[s - 1][k] + (1 - d) * w[s][trained], rtol=1e-6, atol=1e-9)
    # the EMA lags the trained weights: it is neither the initial nor the trained adapter
    b = [k for k in ema_keys if ".lora_B." in k][0]
    assert w[4][b].abs().sum() > 0 and not torch.equal(w[4][b], w[4][b.replace(".ema.", ".default.")])


@pytest.mark.exact  # two runs of one code path compared bit for bit: not in the numerics rerun (conftest.py)
def test_the_ema_leaves_training_untouched(ema_run):
    """Rollouts and updates run on the trained weights: with and without the EMA the training records are equal."""
    tmp, run = ema_run
    plain = tmp / "plain"
    Trainer(compose([o for o in _overrides(tmp, plain, 4) if not o.startswith("eval.ema")])).fit()

    def train(r, drop=("ema_decay",)):
        return [{k: v for k, v in x.items() if k not in drop and not k.startswith(("time", "perf/")) and "seconds" not in k}
                for x in read_jsonl(r / "metrics.jsonl") if x["kind"] == "train"]

    assert train(run) == train(plain) and len(train(plain)) == 4
    a, b = _weights(run, 4), _weights(plain, 4)
    assert all(torch.equal(a[k], b[k]) for k in b) and set(a) - set(b) == {k for k in a if ".ema." in k}


@pytest.mark.exact  # a resumed run against a straight one, bit for bit on the same kernels: not in the numerics rerun (conftest.py)
def test_ema_resumes_exactly(ema_run):
    tmp, straight = ema_run
    resumed = tmp / "resumed"
    Trainer(compose(_overrides(tmp, resumed, 2))).fit()
    Trainer(compose(_overrides(tmp, resumed, 4, "trainer.resume=auto"))).fit()
    a, b = _weights(straight, 4), _weights(resumed, 4)
    assert a.keys() == b.keys() and any(".ema." in k for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_turning_the_ema_on_or_off_on_resume(tmp_path):
    """On: a checkpoint without an EMA starts one from its weights. Off: the checkpoint's EMA is no longer what the run
    evaluates, so ``diffrl eval --run`` takes the trained weights."""
    on = tmp_path / "on"
    no_ema = [o for o in _overrides(tmp_path, on, 2) if not o.startswith("eval.ema")]
    Trainer(compose(no_ema)).fit()
    Trainer(compose(_overrides(tmp_path, on, 3, "trainer.resume=auto"))).fit()
    w2, w3 = _weights(on, 2), _weights(on, 3)
    assert not any(".ema." in k for k in w2)
    d = ema_decay(3, 0.9)
    for k in (k for k in w3 if ".ema." in k):
        torch.testing.assert_close(w3[k], d * w2[k.replace(".ema.", ".default.")] + (1 - d) * w3[k.replace(".ema.", ".default.")], rtol=1e-6, atol=1e-9)
    assert main(["eval", "--run", str(on), "--out", str(tmp_path / "e_on")]) == 0
    assert json.loads((tmp_path / "e_on" / "eval.json").read_text())["adapter"] == "ema"

    off = tmp_path / "off"
    Trainer(compose(_overrides(tmp_path, off, 2))).fit()
    Trainer(compose([o for o in _overrides(tmp_path, off, 3, "trainer.resume=auto") if not o.startswith("eval.ema")])).fit()
    assert any(".ema." in k for k in _weights(off, 3))  # kept, no longer updated
    assert main(["eval", "--run", str(off), "--out", str(tmp_path / "e_off")]) == 0
    assert json.loads((tmp_path / "e_off" / "eval.json").read_text())["adapter"] == "default"


def test_evaluations_sample_the_ema_and_diffrl_eval_reproduces_them(ema_run, tmp_path):
    _, run = ema_run
    last = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "eval"][-1]
    assert last["step"] == 4
    # diffrl eval of the run's newest checkpoint: the EMA by default, and exactly the trainer's final evaluation
    assert main(["eval", "--run", str(run), "--out", str(tmp_path / "auto")]) == 0
    auto = json.loads((tmp_path / "auto" / "eval.json").read_text())
    assert auto["adapter"] == "ema" and auto["step"] == 4
    assert auto["metrics"]["eval/digits"] == last["eval/digits"]
    # the trained weights give other images (the EMA lags them)
    assert main(["eval", "--run", str(run), "--adapter", "default", "--out", str(tmp_path / "default")]) == 0
    default = json.loads((tmp_path / "default" / "eval.json").read_text())
    assert default["adapter"] == "default"
    assert [s["rewards"]["digits"] for s in default["samples"]] != [s["rewards"]["digits"] for s in auto["samples"]]


def test_export_lora_takes_the_chosen_adapter(ema_run, tmp_path):
    _, run = ema_run
    w = _weights(run, 4)
    exported = {}
    for choice in ("ema", "default"):
        out = tmp_path / choice
        assert main(["export-lora", "--run", str(run), "--adapter", choice, "--out", str(out)]) == 0
        exported[choice] = load_file(str(out / "pytorch_lora_weights.safetensors"))
        assert json.loads((out / "diffrl_lora.json").read_text())["adapter"] == choice
    a_ema = next(k for k in w if ".lora_A.ema." in k)
    module = a_ema.split(".lora_A.")[0]
    key = next(k for k in exported["ema"] if k.endswith(f"{module}.lora_A.weight"))
    assert torch.equal(exported["ema"][key], w[a_ema])
    assert torch.equal(exported["default"][key], w[a_ema.replace(".ema.", ".default.")])


@pytest.mark.exact  # messages: not in the numerics rerun (conftest.py)
def test_bad_ema_settings_fail_before_any_work(tmp_path):
    out = tmp_path / "r"
    with pytest.raises(ValueError, match="eval.ema=true keeps an EMA of the LoRA"):
        Trainer(compose(_overrides(tmp_path, out, 1, "model.lora.rank=0")))
    with pytest.raises(ConfigError, match="eval.ema_decay"):
        Trainer(compose(_overrides(tmp_path, out, 1, "eval.ema_decay=1.0")))
    with pytest.raises(ConfigError, match="eval.ema_every"):
        Trainer(compose(_overrides(tmp_path, out, 1, "eval.ema_every=0")))
    assert not out.exists()
    # a run trained without the EMA has none to evaluate
    plain = tmp_path / "plain"
    Trainer(compose([o for o in _overrides(tmp_path, plain, 1) if not o.startswith("eval.ema")])).fit()
    assert main(["eval", "--run", str(plain), "--adapter", "ema", "--out", str(tmp_path / "e")]) != 0
