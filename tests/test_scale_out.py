"""Scale-out: the Ray backend with two gloo ranks and FSDP2 follows the local single worker, sizes are
checked before any work, and a run killed with SIGKILL resumes to bit-identical weights and metrics."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffrl.algorithms.base import arrange_for_data_parallel
from diffrl.recipes import compose
from diffrl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["a red seven", "a blue two"]


def _overrides(tmp_path, out, *extra):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return [
        "sampler.num_steps=3", "sampler.eval_num_steps=2", "trainer.steps=2", "trainer.prompts_per_step=2", "trainer.group_size=4",
        "eval.seeds_per_prompt=2", "eval.every=100", "trainer.checkpoint_every=100", "trainer.threads=1",
        f"trainer.output_dir={out}", "trainer.progress=false", f"trainer.prompts={prompts}",
        "algorithm.mini_batch_size=null",  # one optimizer step per RL step (the default recipe takes two since 2026-12-07)
        *extra,
    ]


def _train_records(run: Path, timing: bool = False) -> list[dict]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    if timing:
        return [r for r in lines if r["kind"] == "train"]
    return [{k: v for k, v in r.items() if "time" not in k and "seconds" not in k and not k.startswith("perf/")} for r in lines if r["kind"] == "train"]


def test_arrangement_gives_each_rank_its_slice_of_every_mini_batch():
    from tensordict import TensorDict

    td = TensorDict({"x": torch.arange(8)}, batch_size=[8])
    order = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0])
    out = arrange_for_data_parallel(td, mini_batch_size=4, world_size=2, order=order)
    # mini-batch 0 = rows 7 6 5 4 (rank 0: 7 6, rank 1: 5 4); mini-batch 1 = 3 2 1 0
    assert out["x"].tolist() == [7, 6, 3, 2, 5, 4, 1, 0]
    assert torch.equal(arrange_for_data_parallel(td, mini_batch_size=4, world_size=1, order=order)["x"], order)
    with pytest.raises(ValueError, match="divisible by the number of workers"):
        arrange_for_data_parallel(td, mini_batch_size=4, world_size=3, order=order)


def test_bad_split_fails_before_any_work_with_valid_sizes(tmp_path):
    cfg = compose(_overrides(tmp_path, tmp_path / "r", "distributed.backend=ray", "distributed.num_workers=3"))
    with pytest.raises(ValueError, match=r"distributed.num_workers=3.*valid mini_batch_size values: \[\]"):
        Trainer(cfg)
    assert not (tmp_path / "r").exists()
    cfg = compose(_overrides(tmp_path, tmp_path / "r", "distributed.backend=ray", "distributed.num_workers=2", "algorithm.mini_batch_size=3"))
    with pytest.raises(ValueError, match=r"valid sizes: \[1, 2, 4, 8\]"):
        Trainer(cfg)
    with pytest.raises(ValueError, match="distributed.backend=ray"):
        Trainer(compose(_overrides(tmp_path, tmp_path / "r", "distributed.num_workers=2")))


@pytest.mark.ray
@pytest.mark.slow  # Ray actors: the slow tier, where the Ray tests run one after another on one process
@pytest.mark.parametrize("extra", [(), pytest.param(("algorithm.mini_batch_size=4", "algorithm.kl_beta=0.05"), marks=pytest.mark.slow),
                                   # gradient accumulation: 4 micro-batches of 2 on one worker, 2 of 2 on each of two ranks
                                   pytest.param(("algorithm.mini_batch_size=8", "algorithm.micro_batch_size=2"), marks=pytest.mark.slow)])
@pytest.mark.ranks
def test_ray_two_workers_fsdp2_match_the_local_worker(tmp_path, extra, ray_local):
    """Sizes are global: the same recipe on 1 or 2 ranks computes the same update (weights and metrics)."""
    local = Trainer(compose(_overrides(tmp_path, tmp_path / "local", *extra)))
    local.fit()
    expected = local.workers.trainable_state()
    distributed = Trainer(compose(_overrides(tmp_path, tmp_path / "ray", "distributed.backend=ray", "distributed.num_workers=2", *extra)))
    try:
        distributed.fit()
        got = distributed.workers.trainable_state()
    finally:
        distributed.close()
    assert got.keys() == expected.keys() and expected
    moved = max(expected[k].abs().max().item() for k in expected if "lora_B" in k)
    assert moved > 1e-4  # the LoRA did train
    # the two runs differ only in the gradient all-reduce's summation order (~1e-7 relative); Adam divides each gradient
    # by its running RMS, so an element whose gradient is near 0 can move by a visible share of a step: allow 1 % of the
    # largest LoRA movement (a wrong split of the batch or a missing average moves elements by 50–100 % of it)
    atol = max(2e-6, 1e-2 * moved)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=atol)
    a, b = _train_records(tmp_path / "local"), _train_records(tmp_path / "ray")
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for key in ra:
            if key == "ratio_std":  # a per-rank std, averaged over ranks: not the global std
                continue
            if isinstance(ra[key], float):
                assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-6), key


def _cli(tmp_path, out, steps, *extra):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return [
        sys.executable, "-m", "diffrl.tools.cli", "train", "experiment=digits_nft", "sampler.num_steps=3", "sampler.eval_num_steps=2",
        f"trainer.steps={steps}", "trainer.prompts_per_step=2", "trainer.group_size=2", "eval.seeds_per_prompt=1",
        "eval.every=100", "trainer.checkpoint_every=1", "trainer.threads=1", "algorithm.nft_num_timesteps=2",
        "algorithm.old_schedule=constant", "algorithm.old_decay_max=0.5", "algorithm.mini_batch_size=2",
        "algorithm.lr_schedule=cosine", "algorithm.warmup_steps=2",
        f"trainer.output_dir={out}", "trainer.progress=false", f"trainer.prompts={prompts}", *extra,
    ]


@pytest.mark.slow(seconds=36)
def test_sigkill_at_a_random_point_then_resume_is_bit_identical(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    steps = 8
    straight = tmp_path / "straight"
    subprocess.run(_cli(tmp_path, straight, steps), check=True, env=env, cwd=ROOT, capture_output=True)

    # The kill lands at a random point after a random checkpoint k <= steps - 3, at most one step's time
    # later (the fastest step of the straight run), so at least one step is always left to resume, on a
    # slow laptop or a fast CI machine alike; checkpoint writes in progress are included.
    rng = random.Random()
    step_seconds = min(sum(v for key, v in r.items() if key.startswith("time/")) for r in _train_records(straight, timing=True))
    target = rng.randint(1, steps - 3)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_cli(tmp_path, killed, steps), env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None and not (killed / "checkpoints" / f"step_{target:06d}").exists():
        time.sleep(0.005)
    time.sleep(rng.uniform(0.0, step_seconds))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = len([p for p in (killed / "checkpoints").iterdir() if not p.name.count(".tmp")])
    assert target <= done_before < steps, (target, done_before, step_seconds)
    subprocess.run(_cli(tmp_path, killed, steps, "trainer.resume=auto"), check=True, env=env, cwd=ROOT, capture_output=True)

    final = f"checkpoints/step_{steps:06d}"
    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = load_file(str(straight / final / name)), load_file(str(killed / final / name))
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), (name, key)
    assert _train_records(straight) == _train_records(killed)
    evals = [{k: v for k, v in json.loads((run / "summary.json").read_text())["eval_after"].items() if "seconds" not in k} for run in (straight, killed)]
    assert evals[0] == evals[1]
