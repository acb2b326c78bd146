"""Small builders the tests share."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import torch.multiprocessing as mp

from diffrl.config import LoraConfig, ModelConfig, OptimConfig, SamplerConfig
from diffrl.engine.engine import DiffusionEngine
from diffrl.tools.cli import main


def make_engine(adapter, sampler: SamplerConfig, *, lora_rank: int = 8, lora_alpha: float = 16.0, lora_target_modules=None,
                micro_batch_size: int | None = None, optim: OptimConfig | None = None, **model_options) -> DiffusionEngine:
    """A ``DiffusionEngine`` over ``adapter`` with the given LoRA and model settings (``ModelConfig`` fields)."""
    model = ModelConfig(lora=LoraConfig(rank=lora_rank, alpha=lora_alpha, target_modules=lora_target_modules), **model_options)
    return DiffusionEngine(adapter, model=model, optim=optim or OptimConfig(), sampler=sampler, micro_batch_size=micro_batch_size)


def tiny_run_overrides(tmp_path, out, steps, prompts, *extra, checkpoint_every: int = 2) -> list[str]:
    """Overrides of a seconds-long run of the default digits recipe: 3 rollout steps, 2 prompts × 3 per step, one
    evaluation sample per prompt, the prompts written to ``tmp_path/prompts.txt``."""
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n")
    return [
        "sampler.num_steps=3", "sampler.eval_num_steps=2", f"trainer.steps={steps}", "trainer.prompts_per_step=2",
        "trainer.group_size=3", "eval.seeds_per_prompt=1", "eval.every=100", f"trainer.checkpoint_every={checkpoint_every}",
        f"trainer.output_dir={out}", "trainer.progress=false", f"trainer.prompts={path}", *extra,
    ]


def short_recipe_run(out: Path, experiment: str, steps: int, *overrides: str, seeds: int = 2) -> dict:
    """The first ``steps`` steps of recipe ``experiment`` into ``out``, evaluated before and after on the 60 prompts × ``seeds``
    held-out seeds (no progress bar, no wandb); returns its ``summary.json``, whose ``fidelity`` is the headline under
    fidelity (``reward.fidelity``: the gold judge reads the sample right *and* it is a real digit) that the learning tests
    assert, not raw gold, which a run that hacks the reward raises too."""
    assert main(["train", f"experiment={experiment}", f"trainer.steps={steps}", f"eval.every={steps}", f"eval.seeds_per_prompt={seeds}",
                 f"trainer.checkpoint_every={steps}", "trainer.progress=false", "trainer.wandb=disabled", f"trainer.output_dir={out}",
                 *overrides]) == 0
    return json.loads((out / "summary.json").read_text())


def fidelity_gain(summary: dict) -> float:
    """The fidelity headline's gain at the run's last evaluation (``summary["fidelity"]["last_gain"]``), after checking
    that the evaluations kept the base's diversity (a collapsed run has no headline)."""
    fidelity = summary["fidelity"]
    assert fidelity["gain"] is not None, f"the trained evaluations fell below the diversity floor: {fidelity}"
    return fidelity["last_gain"]


# Modules every rank process of a test imports: the fork server imports them once per test process, and each rank
# forks from it with them loaded. A spawned rank imported them itself (torch, tensordict's torch._dynamo, diffusers,
# peft: 6-10 s alone, 30 s per pair of ranks beside the other xdist process on 2 cores).
RANK_PRELOAD = ["torch", "tensordict", "torch.distributed.fsdp", "diffusers", "peft", "diffrl.engine.engine", "diffrl.distributed.workers",
                "pipelines"]


def start_ranks(fn, args: tuple, nprocs: int = 2) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` fresh processes and wait for them (``torch.multiprocessing.start_processes``),
    started by a fork server that has the heavy modules loaded. The server holds no threads and no process group (it
    only imports), so each rank starts as clean as a spawned one; a rank's exception is raised here, as with spawn."""
    multiprocessing.set_forkserver_preload(RANK_PRELOAD)  # read when the server starts (this process's first call)
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")
