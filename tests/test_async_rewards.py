"""Rewards scored in a background thread while the next chunk of the step is sampled (``reward.async_chunks``)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from diffrl.recipes import check_sizes, compose
from diffrl.trainer import Trainer
from rewards.base import Reward, RewardError, register_reward

pytestmark = pytest.mark.usefixtures("single_thread")

SHORT = ["trainer.prompts_per_step=4", "trainer.group_size=4", "eval.seeds_per_prompt=1", "trainer.progress=false",
         "trainer.wandb=disabled", "algorithm.mini_batch_size=null", "sampler.num_steps=4", "sampler.eval_num_steps=4",
         "sampler.micro_batch_size=4", "reward.gold=null"]

CALLS: list[tuple[str, float, float, int]] = []  # (thread name, start, end, batch)


@register_reward("test_slow_brightness")
class SlowBrightness(Reward):
    """Mean pixel value in [0, 1], after ``delay`` seconds (a stand-in for a remote reward's latency)."""

    def __init__(self, delay: float = 0.3, fail_on_call: int = -1):
        self.delay, self.fail_on_call = delay, fail_on_call

    def __call__(self, images, prompts, metadata=None):
        start = time.perf_counter()
        time.sleep(self.delay)
        if len(CALLS) == self.fail_on_call:
            CALLS.append((threading.current_thread().name, start, time.perf_counter(), images.shape[0]))
            return {self.name: torch.full((images.shape[0],), float("nan"))}
        CALLS.append((threading.current_thread().name, start, time.perf_counter(), images.shape[0]))
        return {self.name: images.float().mean(dim=(1, 2, 3)) / 255.0}


def _trainer(tmp_path, name: str, *extra: str) -> Trainer:
    cfg = compose(["reward.names=[test_slow_brightness]", f"trainer.output_dir={tmp_path / name}", *SHORT, *extra])
    trainer = Trainer(cfg)
    trainer.logger = None
    return trainer


def test_chunked_async_scoring_equals_sequential_and_overlaps_sampling(tmp_path):
    sequential = _trainer(tmp_path, "seq", "+reward.options.test_slow_brightness.delay=0.0")
    times_seq: dict = {}
    traj_seq, scores_seq = sequential.rollout_and_score(0, times_seq)

    chunked = _trainer(tmp_path, "async", "reward.async_chunks=2", "+reward.options.test_slow_brightness.delay=0.3")
    generations: list[tuple[float, float]] = []
    generate = chunked.workers.generate_sequences

    def timed_generate(data):
        start = time.perf_counter()
        out = generate(data)
        generations.append((start, time.perf_counter()))
        return out

    chunked.workers.generate_sequences = timed_generate
    CALLS.clear()
    times: dict = {}
    traj, scores = chunked.rollout_and_score(0, times)

    # the same samples in the same order, the same scores
    assert torch.equal(traj["latents"], traj_seq["latents"]) and torch.equal(traj["log_probs"], traj_seq["log_probs"])
    assert list(traj.get("prompts").tolist()) == list(traj_seq.get("prompts").tolist())
    assert set(scores) == set(scores_seq)
    for key in scores:
        assert torch.equal(scores[key], scores_seq[key]), key
    # two chunks of 2 prompt groups × 4 samples, each scored off the main thread
    assert [c[3] for c in CALLS] == [8, 8] and all(c[0].startswith("diffrl-reward") for c in CALLS)
    assert len(generations) == 2
    (score0_start, score0_end), (gen1_start, gen1_end) = CALLS[0][1:3], generations[1]
    assert score0_start < gen1_end and gen1_start < score0_end  # chunk 0 was scored while chunk 1 was sampled
    assert times["time/reward"] >= 0.6 and times["time/reward_wait"] < times["time/reward"]


def test_a_failing_chunk_raises_the_reward_error_and_trains_nothing(tmp_path):
    trainer = _trainer(tmp_path, "fail", "reward.async_chunks=4", "+reward.options.test_slow_brightness.delay=0.0",
                       "+reward.options.test_slow_brightness.fail_on_call=1")
    engine = trainer.workers.executor.worker.engine
    before = {k: v.clone() for k, v in engine.trainable_state().items()}
    CALLS.clear()
    with pytest.raises(RewardError, match=r"test_slow_brightness.*sample 0"):
        trainer.train_step(0)
    assert len(CALLS) >= 2
    after = engine.trainable_state()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was trained


def test_async_chunks_must_split_whole_prompt_groups():
    with pytest.raises(ValueError, match=r"reward.async_chunks=3 must divide trainer.prompts_per_step=4.*valid: \[1, 2, 4\]"):
        check_sizes(compose(["trainer.prompts_per_step=4", "reward.async_chunks=3"]))
    with pytest.raises(ValueError, match=r"model.fsdp=false"):
        check_sizes(compose(["distributed.backend=ray", "distributed.num_workers=2", "model.fsdp=false", "trainer.prompts_per_step=4"]))
