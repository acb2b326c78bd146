"""``diffrl`` command line.

    diffrl train [key=value ...]          run a recipe (default: experiment=digits_flow_grpo on CPU)
    diffrl sample / eval / export-lora    sample images, evaluate, export the LoRA (diffrl.tools.commands)
    diffrl serve-reward reward=<name>     serve a registered reward over HTTP (diffrl.tools.reward_server)
    diffrl plan [key=value ...] --gpus N  will the recipe fit, how long will a step take (CPU only; diffrl.tools.plan)

Overrides use hydra syntax: ``diffrl train experiment=digits_flow_grpo trainer.steps=20
trainer.output_dir=runs/a``. Errors in the config, missing files and failing rewards print one line
naming the cause (set ``DIFFRL_TRACEBACK=1`` for the full traceback) and exit with status 2; a run that
stops on a fault (a reward down, a full disk, a lost worker) prints the cause and the checkpoint that
``trainer.resume=auto`` continues from, and exits with status 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from diffrl.checkpoint import CheckpointError
from diffrl.logging import WandbInitError
from diffrl.recipes import ConfigError, compose
from diffrl.tools import commands, plan, reward_server
from diffrl.resume import RunFolderError
from diffrl.trainer import RunStopped, Trainer
from rewards.base import RewardError


def _train(overrides: list[str]) -> int:

    cfg = compose(overrides)
    warning = plan.preflight(overrides, cfg)  # GPU runs: will it fit? (trainer.plan_check)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    trainer = Trainer(cfg)
    print(f"diffrl: experiment {cfg.experiment} → {trainer.output_dir}", flush=True)
    summary = trainer.fit()
    keys = ("gold_accuracy_before", "gold_accuracy_after", "reward_before", "reward_after", "wall_seconds", "steps")
    print(json.dumps({k: summary[k] for k in keys if k in summary}, indent=2), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="diffrl", description="RL post-training of diffusion and flow-matching models")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run a training recipe", description="run a training recipe; overrides as key=value")
    train.add_argument("overrides", nargs="*", help="hydra overrides, e.g. experiment=digits_flow_grpo trainer.steps=20")

    handlers = {"train": lambda args: _train(args.overrides)}
    handlers.update(commands.add_parsers(sub))  # name -> handler(args) -> exit status
    handlers.update(reward_server.add_parsers(sub))
    handlers.update(plan.add_parser(sub))
    args = parser.parse_args(argv)

    try:
        return handlers[args.command](args)
    except RunStopped as exc:
        if os.environ.get("DIFFRL_TRACEBACK"):
            raise
        print(f"diffrl: stopped: {exc}", file=sys.stderr, flush=True)
        return 3
    except (CheckpointError, ConfigError, FileNotFoundError, RunFolderError, RewardError, WandbInitError, ValueError) as exc:
        if os.environ.get("DIFFRL_TRACEBACK"):
            raise
        print(f"diffrl: error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
