"""Fault injection, Ray: a rank's process killed with SIGKILL in the middle of a run (two gloo ranks, FSDP2).
With ``trainer.max_restarts=1`` the driver restarts the workers from the newest checkpoint and goes on with the
weights of an uninterrupted run; once the restarts are spent it stops with a one-line error naming the rank."""

from __future__ import annotations

import json
import os
import signal

import pytest
import ray
import torch
from safetensors.torch import load_file

from diffrl.recipes import compose
from diffrl.trainer import RunStopped, Trainer

PROMPTS = ["a red seven", "a blue two"]


def _overrides(tmp_path, out, *extra):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return [
        "sampler.num_steps=3", "sampler.eval_num_steps=2", "trainer.steps=3", "trainer.prompts_per_step=2", "trainer.group_size=2",
        "eval.seeds_per_prompt=1", "eval.every=100", "trainer.checkpoint_every=1", "trainer.threads=1", "trainer.wandb=disabled",
        "distributed.backend=ray", "distributed.num_workers=2", "distributed.ray_call_timeout_s=120", f"trainer.output_dir={out}", "trainer.progress=false",
        f"trainer.prompts={prompts}", *extra,
    ]


@pytest.fixture
def cluster(ray_local):
    """The process's local Ray instance (tests/conftest.py)."""
    return ray_local


def _kill_ranks_before_steps(trainer: Trainer, kills: dict[int, int]) -> list[int]:
    """SIGKILL rank ``kills[i]``'s process just before step index ``i`` runs (once per step index)."""
    killed: list[int] = []
    original = trainer.train_step

    def train_step(step):
        rank = kills.pop(step, None)
        if rank is not None:
            pid = ray.get(trainer.workers.executor.actors[rank].pid.remote())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        return original(step)

    trainer.train_step = train_step
    return killed


def _records(run):
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time", "perf/")) and "seconds" not in k} for r in rows if r["kind"] == "train"]


@pytest.mark.ray
@pytest.mark.slow
def test_lost_rank_restarts_from_the_newest_checkpoint_or_stops_naming_it(tmp_path, cluster, capsys):
    """One run of 4 steps with ``trainer.max_restarts=1``: rank 1 killed before step 3 restarts the workers from
    step_000002, and the steps after it retrace the uninterrupted run bit for bit; rank 0 killed before step 4 finds the
    restarts spent, and the run stops with one line naming rank 0, the newest checkpoint and the setting."""
    straight = Trainer(compose(_overrides(tmp_path, tmp_path / "straight")))
    straight.fit()
    straight.close()

    run = tmp_path / "restarted"
    restarted = Trainer(compose(_overrides(tmp_path, run, "trainer.steps=4", "trainer.max_restarts=1", "trainer.progress=true")))
    killed = _kill_ranks_before_steps(restarted, {2: 1, 3: 0})
    with pytest.raises(RunStopped) as info:
        restarted.fit()
    restarted.close()
    assert len(killed) == 2
    out = capsys.readouterr()
    assert "the worker of rank 1 on" in out.out + out.err and "restarting the workers from step_000002" in out.out + out.err
    message = str(info.value)
    assert "\n" not in message and "rank 0" in message and "step_000003" in message and "trainer.max_restarts" in message
    # the restarted workers computed step 3 as the uninterrupted run did
    final = "checkpoints/step_000003/model.safetensors"
    a, b = load_file(str(tmp_path / "straight" / final)), load_file(str(run / final))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _records(tmp_path / "straight") == _records(run)


@pytest.mark.ray
@pytest.mark.ranks
def test_a_peers_collective_error_that_comes_first_still_reports_the_dead_rank(cluster):
    """When a rank dies, the live rank's collective fails at once; its error must not hide the cause (a lost
    rank, which the driver restarts or names) even when it reaches the driver first."""
    from diffrl.distributed.controller import WorkerLostError
    from diffrl.distributed.ray import RayExecutor

    class _Rank:  # defined here so that Ray pickles it by value (the workers cannot import this test module)
        def die_after(self, seconds: float) -> None:
            import time

            time.sleep(seconds)
            os._exit(1)

        def collective_fails(self) -> None:
            raise RuntimeError("Read error [127.0.0.1]:9140: Connection reset by peer")

    executor = object.__new__(RayExecutor)
    executor.rank_nodes = ["10.0.0.1", "10.0.0.2"]
    dying, live = (ray.remote(num_cpus=0)(_Rank).remote() for _ in range(2))
    refs = [dying.die_after.remote(2.0), live.collective_fails.remote()]
    ray.wait([refs[1]], timeout=30)  # the live rank's error is there first
    assert ray.wait([refs[0]], timeout=0)[0] == []
    with pytest.raises(WorkerLostError, match=r"^worker call x: the worker of rank 0 on 10\.0\.0\.1 died"):
        executor._get(refs, "worker call x", 60)
    # a task error with every rank alive is the error itself
    live2 = ray.remote(num_cpus=0)(_Rank).remote()
    with pytest.raises(ray.exceptions.RayTaskError, match="Connection reset by peer"):
        executor._get([live2.collective_fails.remote()], "worker call y", 60)
