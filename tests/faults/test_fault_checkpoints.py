"""Fault injection, checkpoints and the training loop: torn and corrupt checkpoints, a checkpoint of another
config, non-finite losses, a reward failing mid-run, and a full disk (a small tmpfs) while a checkpoint,
the metrics or the evaluation images are written. After each, the run stops with a clear message or
continues, and ``trainer.resume=auto`` reaches the same weights and metrics as an uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffrl import checkpoint
from diffrl.engine.engine import DiffusionEngine
from diffrl.recipes import compose
from diffrl.logging import RunLogger
from diffrl.resume import RunFolderError
from diffrl.trainer import RunStopped, Trainer
from rewards.base import RewardError, register_reward
from rewards.digits import DigitsReward

pytestmark = pytest.mark.exact  # a resumed run against the uninterrupted one: one code path, bit for bit: not a numerics test (conftest.py)

PROMPTS = ["a red seven", "a blue two"]


def _overrides(tmp_path: Path, out: Path, steps: int, *extra: str) -> list[str]:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return [
        "sampler.num_steps=3", "sampler.eval_num_steps=2", f"trainer.steps={steps}", "trainer.prompts_per_step=2", "trainer.group_size=2",
        "eval.seeds_per_prompt=1", "eval.every=2", "trainer.checkpoint_every=1", "trainer.threads=1", "trainer.wandb=disabled",
        "algorithm.lr_schedule=cosine", "algorithm.warmup_steps=1", f"trainer.output_dir={out}", "trainer.progress=false", f"trainer.prompts={prompts}",
        *extra,
    ]


def _run(tmp_path, out, steps, *extra) -> dict:
    return Trainer(compose(_overrides(tmp_path, out, steps, *extra))).fit()


def _train_records(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time", "perf/")) and "seconds" not in k} for r in rows if r["kind"] == "train"]


def _assert_same_run(a: Path, b: Path, step: int) -> None:
    for name in ("model.safetensors", "optimizer.safetensors"):
        x, y = load_file(str(a / "checkpoints" / f"step_{step:06d}" / name)), load_file(str(b / "checkpoints" / f"step_{step:06d}" / name))
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), (name, key)
    assert _train_records(a) == _train_records(b)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted 4-step run, and the same run crashed after step 3 (to damage and resume)."""
    tmp = tmp_path_factory.mktemp("ckpt")
    _run(tmp, tmp / "straight", 4)
    trainer = Trainer(compose(_overrides(tmp, tmp / "three", 4)))
    original = trainer.train_step

    def crash_at_step_4(step):
        if step == 3:
            raise SystemError("simulated crash")
        return original(step)

    trainer.train_step = crash_at_step_4
    with pytest.raises(SystemError):
        trainer.fit()
    return tmp


def _truncate(ckpt: Path) -> None:
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _flip_byte(ckpt: Path) -> None:
    f = ckpt / "optimizer.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF
    f.write_bytes(bytes(data))


def _drop_file(ckpt: Path) -> None:
    (ckpt / "optimizer.safetensors").unlink()


def _bad_json(ckpt: Path) -> None:
    (ckpt / "state.json").write_text('{"global_step": 3, "window": ')


DAMAGE = {"truncated": (_truncate, "bytes"), "flipped byte": (_flip_byte, "SHA-256"), "missing file": (_drop_file, "missing"), "bad json": (_bad_json, "state.json")}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_newest_checkpoint_is_skipped_and_the_resume_is_exact(runs, kind, capsys):
    damage, why = DAMAGE[kind]
    run = runs / f"damaged-{kind.replace(' ', '_')}"
    shutil.copytree(runs / "three", run)
    damage(run / "checkpoints" / "step_000003")
    assert checkpoint.verify(run / "checkpoints" / "step_000003") is not None
    trainer = Trainer(compose(_overrides(runs, run, 4, "trainer.resume=auto", "trainer.progress=true")))
    assert trainer.resume_path.name == "step_000002"
    trainer.fit()
    out = capsys.readouterr()
    assert "skipped damaged checkpoint step_000003" in out.out + out.err and why in out.out + out.err
    aside = [p.name for p in (run / "checkpoints").iterdir() if ".damaged-" in p.name]
    assert len(aside) == 1 and aside[0].startswith("step_000003.damaged-")  # kept for inspection, not deleted
    _assert_same_run(runs / "straight", run, 4)


def test_no_whole_checkpoint_stops_and_touches_nothing(runs):
    run = runs / "all-damaged"
    shutil.copytree(runs / "three", run)
    for ckpt in checkpoint.list_checkpoints(run / "checkpoints"):
        _truncate(ckpt)
    before = (run / "metrics.jsonl").read_bytes()
    with pytest.raises(RunFolderError, match=r"no whole checkpoint.*step_000001: model.safetensors has"):
        Trainer(compose(_overrides(runs, run, 4, "trainer.resume=auto")))
    assert (run / "metrics.jsonl").read_bytes() == before
    assert len(checkpoint.list_checkpoints(run / "checkpoints")) == 3


def test_checkpoint_of_another_config_is_refused(runs):
    run = runs / "other-config"
    shutil.copytree(runs / "three", run)
    with pytest.raises(RunFolderError, match=r"model.lora.rank: 8 in the checkpoint, 4 now"):
        Trainer(compose(_overrides(runs, run, 4, "trainer.resume=auto", "model.lora.rank=4")))


def test_a_bad_checkpoint_never_half_loads(runs):
    """Weights of another model (one extra tensor, one of another shape) are refused before any is copied."""
    src = runs / "three" / "checkpoints" / "step_000003"
    trainer = Trainer(compose(_overrides(runs, runs / "half", 4)))
    engine = trainer.workers.executor.worker.engine
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    for variant in ("extra", "shape"):
        bad = runs / f"bad-{variant}"
        shutil.copytree(src, bad)
        weights = load_file(str(bad / "model.safetensors"))
        last = sorted(weights)[-1]
        if variant == "extra":
            weights["not.a.parameter"] = torch.zeros(3)
        else:
            weights[last] = torch.zeros(*weights[last].shape[:-1], weights[last].shape[-1] + 1)
        (bad / checkpoint.MANIFEST).unlink()  # a checkpoint written by hand or another tool
        save_file(weights, str(bad / "model.safetensors"))
        with pytest.raises(checkpoint.CheckpointError, match="another"):
            checkpoint.load_engine(engine, bad)
        for n, p in engine.module.named_parameters():
            assert torch.equal(p, before[n]), n


def _inject_nan_at(monkeypatch, trainer: Trainer, step_index: int) -> None:
    original_pieces = DiffusionEngine._pieces
    state = {"on": False}

    def pieces(self, loss_fn, micro, seed):
        for loss, weight, metrics in original_pieces(self, loss_fn, micro, seed):
            yield (loss * float("nan") if state["on"] else loss), weight, metrics

    original_step = trainer.train_step

    def train_step(step):
        state["on"] = step == step_index
        return original_step(step)

    monkeypatch.setattr(DiffusionEngine, "_pieces", pieces)
    monkeypatch.setattr(trainer, "train_step", train_step)


def test_nonfinite_loss_is_skipped_and_counted_with_state_unchanged(tmp_path, monkeypatch):
    out = tmp_path / "skip"
    trainer = Trainer(compose(_overrides(tmp_path, out, 3, "algorithm.mini_batch_size=null")))  # one optimizer step per RL step
    _inject_nan_at(monkeypatch, trainer, 1)
    summary = trainer.fit()
    records = _train_records(out)
    assert [r["skipped_nonfinite"] for r in records] == [0, 1, 0] and summary["skipped_nonfinite"] == 1
    ckpts = out / "checkpoints"
    for name in ("model.safetensors", "optimizer.safetensors"):  # step 2 changed nothing: weights and Adam moments
        a, b = load_file(str(ckpts / "step_000001" / name)), load_file(str(ckpts / "step_000002" / name))
        assert all(torch.equal(a[k], b[k]) for k in a), name
        assert all(torch.isfinite(t).all() for t in b.values())
    sched = [json.loads((ckpts / f"step_00000{i}" / "optimizer.json").read_text())["scheduler"]["last_epoch"] for i in (1, 2, 3)]
    assert sched == [1, 1, 2]  # the learning-rate schedule did not advance on the skipped step


def test_nonfinite_stop_keeps_the_last_good_checkpoint_and_resumes_exactly(runs, tmp_path, monkeypatch):
    out = tmp_path / "stop"
    trainer = Trainer(compose(_overrides(runs, out, 4, "algorithm.nonfinite=stop")))
    _inject_nan_at(monkeypatch, trainer, 2)
    with pytest.raises(RunStopped, match=r"step 3: non-finite loss .*newest checkpoint step_000002 is intact"):
        trainer.fit()
    assert [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")] == ["step_000001", "step_000002"]
    monkeypatch.undo()
    Trainer(compose(_overrides(runs, out, 4, "algorithm.nonfinite=stop", "trainer.resume=auto"))).fit()
    _assert_same_run(runs / "straight", out, 4)


@register_reward("test_flaky_digits")
class FlakyDigits(DigitsReward):
    """The digits reward, raising on call ``fail_on`` (class attribute) as a remote reward does after its retries."""

    calls = 0
    fail_on = None

    def __call__(self, images, prompts, metadata=None):
        type(self).calls += 1
        if type(self).calls == type(self).fail_on:
            raise RewardError("reward 'test_flaky_digits': server http://127.0.0.1:9/score did not answer after 3 retries")
        return super().__call__(images, prompts, metadata)


@pytest.mark.parametrize("fail_on,where", [(5, "step 3"), (4, "evaluation at step 2")])
def test_reward_failure_stops_with_a_checkpoint_and_resumes_exactly(runs, tmp_path, fail_on, where):
    out = tmp_path / "flaky"
    FlakyDigits.calls, FlakyDigits.fail_on = 0, fail_on  # calls: eval 0, steps 1 and 2, eval 2, step 3, …
    extra = ("reward.names=[test_flaky_digits]", "trainer.checkpoint_every=100")
    with pytest.raises(RunStopped, match=rf"{where}: reward 'test_flaky_digits'.*checkpoint step_000002 holds the 2 steps done"):
        _run(runs, out, 4, *extra)
    FlakyDigits.fail_on = None
    _run(runs, out, 4, *extra, "trainer.resume=auto")
    straight = tmp_path / "flaky-straight"
    _run(runs, straight, 4, *extra)
    a, b = load_file(str(straight / "checkpoints" / "step_000004" / "model.safetensors")), load_file(str(out / "checkpoints" / "step_000004" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _train_records(straight) == _train_records(out)
    evals = [[{k: v for k, v in json.loads(line).items() if "seconds" not in k} for line in (run / "metrics.jsonl").read_text().splitlines()
              if json.loads(line)["kind"] == "eval"] for run in (straight, out)]
    assert evals[0] == evals[1] and [e["step"] for e in evals[1]] == [0, 2, 4]


@pytest.fixture
def small_disk(tmp_path):
    """A 24 MiB tmpfs: a real file system that runs out of space."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.fail("the disk-full tests mount a tmpfs and need root (as on CI and the developers' machines)")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(disk: Path) -> Path:
    filler = disk / f"filler-{uuid.uuid4().hex}"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError:
            pass
    return filler


WHERE = ["checkpoint", "metrics", "images"]


@pytest.mark.parametrize("where", WHERE)
def test_disk_full_stops_cleanly_and_resumes_exactly(runs, small_disk, monkeypatch, where):
    out = small_disk / "run"
    trainer = Trainer(compose(_overrides(runs, out, 4)))
    fillers: list[Path] = []
    owner, name = {"checkpoint": (trainer.workers, "save_checkpoint"), "metrics": (RunLogger, "log"), "images": (RunLogger, "log_eval_samples")}[where]
    original = getattr(owner, name)

    def fill_at_step_2(step) -> None:
        if step == 2 and not fillers:
            fillers.append(_fill(small_disk))

    if where == "checkpoint":
        def wrapped(*args, **kwargs):
            fill_at_step_2(kwargs["global_step"])
            return original(*args, **kwargs)
    else:
        def wrapped(self, first, *args, **kwargs):
            fill_at_step_2(first["step"] if name == "log" else first)
            return original(self, first, *args, **kwargs)

    monkeypatch.setattr(owner, name, wrapped)
    with pytest.raises((RunStopped, checkpoint.CheckpointError)) as info:
        trainer.fit()
    message = str(info.value)
    assert "\n" not in message and ("No space left" in message or "no space left" in message), message
    assert "resume=auto" in message
    kept = checkpoint.list_checkpoints(out / "checkpoints")
    assert kept and all(checkpoint.verify(p) is None for p in kept)  # the checkpoints there are whole
    assert not list((out / "checkpoints").glob("*.tmp-*"))  # nothing partial was left
    monkeypatch.undo()
    for f in fillers:
        f.unlink()
    Trainer(compose(_overrides(runs, out, 4, "trainer.resume=auto"))).fit()
    _assert_same_run(runs / "straight", out, 4)
