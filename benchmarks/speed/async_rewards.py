"""Rollout + scoring time of one RL step with a remote reward, sequential against ``reward.async_chunks``.

The reward is the digits classifier served by a real ``RewardServer`` (HTTP on 127.0.0.1, PNG + JSON) with a
extra latency of ``--latency`` seconds per request plus ``--per-image`` seconds per image: it stands for a reward model on another machine, whose
compute does not compete with the sampler for this machine's cores. For each ``async_chunks`` value the
script times ``Trainer.rollout_and_score`` of the same step (same samples, same scores: checked) and prints
one JSON line per setting plus the ratio to the sequential time.

    PYTHONPATH=. python benchmarks/speed/async_rewards.py --latency 0.1 --per-image 0.02 --chunks 1 2 4
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


class DelayedReward:
    """``reward`` plus ``latency + per_image·B`` seconds per call (network, a remote GPU's queue and compute)."""

    def __init__(self, reward, latency: float, per_image: float):
        self.reward, self.latency, self.per_image = reward, latency, per_image
        self.name = getattr(reward, "name", "digits")

    def __call__(self, images, prompts, metadata=None):
        time.sleep(self.latency + self.per_image * images.shape[0])
        return self.reward(images, prompts, metadata)


def main() -> None:
    from diffrl.recipes import compose
    from diffrl.tools.reward_server import RewardServer
    from diffrl.trainer import Trainer
    from rewards.base import build_reward

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency", type=float, default=0.1, help="seconds the server adds to each request")
    parser.add_argument("--per-image", type=float, default=0.02, help="seconds the server adds per image")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3, help="steps timed per setting (the median is reported)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with RewardServer(DelayedReward(build_reward("digits"), args.latency, args.per_image), name="digits", port=0, token=None, max_batch=1024) as server:
        reference, rows = None, []
        for chunks in args.chunks:
            with tempfile.TemporaryDirectory() as tmp:
                cfg = compose([
                    "reward.names=[remote]", f"+reward.options.remote={{url: '{server.url}', token: '', batch_size: 1024}}",
                    f"reward.async_chunks={chunks}", "sampler.micro_batch_size=8", "trainer.wandb=disabled",
                    f"trainer.output_dir={Path(tmp) / 'run'}",
                ])
                trainer = Trainer(cfg)
                seconds, timings = [], []
                for repeat in range(args.repeats):
                    times: dict = {}
                    start = time.perf_counter()
                    traj, scores = trainer.rollout_and_score(repeat, times)
                    seconds.append(time.perf_counter() - start)
                    timings.append(times)
                    if repeat == 0:
                        if reference is None:
                            reference = (traj["latents"], scores["rewards"])
                        assert torch.equal(traj["latents"], reference[0]) and torch.equal(scores["rewards"], reference[1])
                median = sorted(seconds)[len(seconds) // 2]
                row = {"async_chunks": chunks, "images": int(traj.batch_size[0]), "latency_s": args.latency, "per_image_s": args.per_image, "step_seconds_median": median,
                       "rollout_seconds": timings[-1]["time/rollout"], "reward_seconds": timings[-1]["time/reward"]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    base = rows[0]["step_seconds_median"]
    for row in rows:
        print(f"async_chunks={row['async_chunks']}: {row['step_seconds_median']:.2f} s per rollout+score, {base / row['step_seconds_median']:.2f}× the first setting")


if __name__ == "__main__":
    main()
