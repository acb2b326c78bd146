"""``diffrl sample``, ``diffrl eval`` and ``diffrl export-lora``.

Which model::

    (nothing)                 the base model of the recipe composed from the overrides
    --run RUN_DIR             the run's newest complete checkpoint, RUN_DIR/config.yaml as the config
    --checkpoint RUN/checkpoints/step_N   that checkpoint (its run's config.yaml when it sits in a run folder)
    --run RUN_DIR --base      the base model under the run's config

Overrides (``key=value``) apply on top of the run's config.yaml, or compose a recipe like ``diffrl train``
(``experiment=… sampler.eval_num_steps=…``) when there is no run config or with ``--recipe-config``. Give the
overrides together (argparse) and not right after ``--prompts``/``--seeds``, which take every word that follows.

* ``sample``: prompts × ``--seeds`` (each seed is the sample's own ``torch.Generator`` seed), drawn with the
  deterministic evaluation sampler (``--stochastic``: the rollout SDE); writes ``grid.png`` (one row per
  prompt), ``images/NNNN.png`` and ``samples.json`` with every image's rewards, per-prompt and overall means.
* ``eval``: the trainer's evaluation (``RunEvaluation.evaluate``, diffrl.run_evaluation): prompts × ``eval.seeds_per_prompt``
  held-out seeds (``diffrl.sampling.evaluation.eval_prompts_and_seeds``), the ODE / DDIM(η = 0) sampler with
  ``sampler.eval_num_steps`` steps, ``reward.names`` + ``reward.gold`` averaged by
  ``diffrl.sampling.evaluation.score_images``; writes ``eval.json`` (metrics, per prompt, per image) and ``eval_grid.png``.
  For the base model at a recipe's settings the metrics equal the ``eval/…`` numbers the trainer logs at step 0.
* ``export-lora``: the checkpoint's ``default`` LoRA adapter as diffusers' ``pytorch_lora_weights.safetensors``
  (peft keys prefixed by the family's component, ``transformer.`` for SD3-type families, ``unet.`` for SD1.5),
  written by the family pipeline's own ``save_lora_weights``; ``pipe.load_lora_weights(dir)`` loads it.
  The LoRA scale ``alpha / r`` is folded into ``lora_B`` and the metadata says ``lora_alpha = r``, so loaders
  that honour the metadata and loaders that assume ``alpha = r`` (no metadata) give the same weights
  ``W + (alpha/r)·B·A``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from safetensors.torch import load_file

from diffrl.checkpoint import CheckpointError, checkpoint_adapters, list_checkpoints, write_json_atomic
from diffrl.config import MOVED_KEYS, eval_metric_names
from diffrl.data import check_edit_prompts, eval_subset, load_prompts, run_prompts, sample_metadata
from diffrl.distributed import build_worker_group
from diffrl.distributed.workers import ActorRolloutRefWorker
from diffrl.logging import WandbInitError, save_gif, save_grid
from diffrl.recipes import ConfigError, compose, moved_key_message, run_schema, upgrade_run_config
from diffrl.sampling.evaluation import eval_prompts_and_seeds
from diffrl.sampling.evaluator import Evaluator
from diffrl.resume import RunFolderError
from diffrl.run_setup import worker_config
from diffrl.tools import plan, prompts as prompt_files, reward_server
from diffrl.tools.cli import add_train_parser
from diffrl.trainer import RunStopped, Trainer
from pipelines.base import family_class, split_prompts
from rewards.base import RewardError, build_reward

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
_GROUPS = ("experiment", "model", "algorithm", "reward", "sampler")


# -- the command line (diffrl.tools.cli hands every command here) ------------------------------------------
def run_train(args) -> int:
    """``diffrl train``: compose, then print the config (``--cfg job``) or plan (GPU runs) and train."""
    cfg = compose(args.overrides)
    if args.cfg == "job":
        print(OmegaConf.to_yaml(cfg), end="", flush=True)
        return 0
    warning = plan.preflight(args.overrides, cfg)  # GPU runs: will it fit? (trainer.plan_check)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    trainer = Trainer(cfg)
    print(f"diffrl: experiment {cfg.experiment} → {trainer.output_dir}", flush=True)
    summary = trainer.fit()
    keys = ("gold_accuracy_before", "gold_accuracy_after", "reward_before", "reward_after", "wall_seconds", "steps")
    print(json.dumps({k: summary[k] for k in keys if k in summary}, indent=2), flush=True)
    return 0


def main(argv: list[str]) -> int:
    """Parse ``argv`` (a command and its arguments) and run it: a config error, a missing file or a failing reward is one
    line on stderr and status 2; a run stopped by a fault, status 3 (``DIFFRL_TRACEBACK=1``: the traceback instead)."""
    parser = argparse.ArgumentParser(prog="diffrl", description="RL post-training of diffusion and flow-matching models")
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    handlers = {"train": run_train}
    handlers.update(add_parsers(sub))  # name -> handler(args) -> exit status
    handlers.update(reward_server.add_parsers(sub))
    handlers.update(plan.add_parser(sub))
    handlers.update(prompt_files.add_parser(sub))
    args = parser.parse_args(argv)
    try:
        return handlers[args.command](args)
    except RunStopped as exc:
        if os.environ.get("DIFFRL_TRACEBACK"):
            raise
        print(f"diffrl: stopped: {exc}", file=sys.stderr, flush=True)
        return 3
    except (CheckpointError, ConfigError, FileNotFoundError, FileExistsError, RunFolderError, RewardError, WandbInitError, ValueError) as exc:
        if os.environ.get("DIFFRL_TRACEBACK"):
            raise
        print(f"diffrl: error: {exc}", file=sys.stderr, flush=True)
        return 2


# -- argument parsing ---------------------------------------------------------------------------------
def _model_arguments(parser) -> None:
    parser.add_argument("overrides", nargs="*", help="config overrides key=value (hydra syntax), e.g. sampler.eval_num_steps=20")
    parser.add_argument("--checkpoint", help="a checkpoint folder RUN/checkpoints/step_N written by diffrl train")
    parser.add_argument("--run", help="a run folder: its newest complete checkpoint and its config.yaml")
    parser.add_argument("--recipe-config", action="store_true", help="compose the config from the recipe + overrides, not the run's config.yaml")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--overwrite", action="store_true", help="replace outputs already in --out")
    parser.add_argument("--adapter", choices=["auto", "default", "ema"], default="auto",
                        help="the checkpoint's LoRA to use: ema (the EMA a run with eval.ema=true evaluated), default (the trained "
                        "weights); auto: ema when the checkpoint holds one")


def add_parsers(sub) -> dict:
    """Add this module's sub-commands to ``sub``; return ``{name: handler(args) -> exit status}``."""
    sample = sub.add_parser(
        "sample", help="sample images for prompts and score them",
        description="prompts × seeds → grid.png, images/NNNN.png and samples.json with per-image and per-prompt rewards",
    )
    _model_arguments(sample)
    sample.add_argument("--base", action="store_true", help="with --run: the base model (no checkpoint) under the run's config")
    sample.add_argument("--prompts", nargs="+", help="prompts (quote each one)")
    sample.add_argument("--prompt-file", help="a file with one prompt per line, records (JSONL: GenEval rows, {prompt, metadata}, editing records; their metadata reaches the rewards) or a built-in set (its test split)")
    sample.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3], help="generator seeds; every prompt is drawn once per seed")
    sample.add_argument("--rewards", nargs="*", default=None, help="reward names to score with (default: reward.names and reward.gold; none: no scoring)")
    sample.add_argument("--stochastic", action="store_true", help="draw with the rollout sampler (sampler.kind, sampler.num_steps) instead of the evaluation ODE")

    ev = sub.add_parser("eval", help="evaluate on held-out prompts with fixed seeds", description="the trainer's evaluation of a model or checkpoint")
    _model_arguments(ev)
    ev.add_argument("--base", action="store_true", help="with --run: the base model (no checkpoint) under the run's config")
    ev.add_argument("--prompts", nargs="+", help="prompts (default: trainer.prompts or the family's prompt set)")
    ev.add_argument("--prompt-file", help="a file with one prompt per line, records (JSONL, with their metadata) or a built-in set (its test split)")

    export = sub.add_parser("export-lora", help="export a checkpoint's LoRA in the diffusers format", description="write pytorch_lora_weights.safetensors for pipe.load_lora_weights")
    _model_arguments(export)
    return {"sample": run_sample, "eval": run_eval, "export-lora": run_export_lora}


# -- which model, which config --------------------------------------------------------------------------
@dataclass
class ModelSource:
    """The config to build the model with and the checkpoint to load into it (None: the base model)."""

    cfg: object
    checkpoint: Path | None
    step: int | None
    run_config: Path | None


def check_checkpoint(path: str | Path) -> Path:
    """``path`` as a complete checkpoint folder, or an error that names what is wrong and the fix."""
    path = Path(path)
    hint = "give a checkpoint folder RUN/checkpoints/step_N written by `diffrl train`, or --run RUN for its newest"
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist (--checkpoint); {hint}")
    if not path.is_dir():
        raise ValueError(f"checkpoint {path} is a file, not a checkpoint folder; {hint}")
    if (path / "checkpoints").is_dir() or (path / "config.yaml").is_file():
        raise ValueError(f"{path} is a run folder, not a checkpoint; use --run {path} (its newest checkpoint) or --checkpoint {path / 'checkpoints'}/step_N")
    missing = [name for name in ("model.safetensors", "state.json") if not (path / name).is_file()]
    if missing:
        raise ValueError(f"{path} is not a complete diffrl checkpoint: {' and '.join(missing)} missing; {hint}")
    return path


def newest_checkpoint(run: str | Path) -> Path:
    """The newest complete ``checkpoints/step_N`` of a run folder."""

    run = Path(run)
    if not run.is_dir():
        raise FileNotFoundError(f"run folder {run} does not exist (--run); give the trainer.output_dir of a run")
    found = list_checkpoints(run / "checkpoints")
    if not found:
        raise FileNotFoundError(
            f"run folder {run} has no complete checkpoint under {run / 'checkpoints'}; "
            "use --base for its base model, or --checkpoint for a checkpoint elsewhere"
        )
    return check_checkpoint(found[-1])


def apply_overrides(cfg, overrides: list[str], source: Path):
    """Dotted ``key=value`` overrides on a saved config (strict: an unknown key is an error naming it)."""
    for item in overrides:
        key, eq, _ = item.partition("=")
        key = key.lstrip("+~")
        if not eq:
            raise ConfigError(f"override {item!r} is not key=value")
        if key in MOVED_KEYS:
            raise ConfigError(moved_key_message(key))
        if key in _GROUPS:
            raise ConfigError(
                f"override {item!r} selects a config group, but the config comes from {source}; "
                "override single keys (e.g. sampler.eval_num_steps=20) or add --recipe-config to compose the recipe instead"
            )
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException:
            parent = key.rsplit(".", 1)[0] if "." in key else ""
            node = OmegaConf.select(cfg, parent) if parent else cfg
            valid = sorted(node.keys()) if OmegaConf.is_dict(node) else []
            raise ConfigError(f"cannot apply override {item!r} to {source}: unknown config key '{key}' or bad value; valid keys under '{parent}': {valid}") from None
    return cfg


def load_config(overrides: list[str], run_config: Path | None):
    """The run's saved config + overrides, or (no run config) the recipe composed like ``diffrl train``."""
    if run_config is None:
        return compose(overrides)
    stored = upgrade_run_config(OmegaConf.to_container(OmegaConf.load(run_config)))
    try:  # the schema of the run's own algorithm class (NFT, DPO, AWM … each have their own Config)
        cfg = OmegaConf.merge(run_schema(stored), stored)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError(f"{run_config} does not fit this diffrl's config schema (key '{key}': {str(exc).splitlines()[0]}); "
                          "add --recipe-config and give the run's settings as overrides") from None
    cfg = apply_overrides(cfg, overrides, run_config)
    OmegaConf.set_struct(cfg, True)
    return cfg


def resolve_source(args) -> ModelSource:
    """Turn ``--run``/``--checkpoint``/``--base``/overrides into a config and a checkpoint."""
    if args.run and args.checkpoint:
        raise ValueError("give either --run (its newest checkpoint) or --checkpoint, not both")
    base = getattr(args, "base", False)
    if base and not args.run:
        raise ValueError("--base needs --run (the base model under the run's config); without --run the base model is the default")
    checkpoint, run_config = None, None
    if args.run:
        run = Path(args.run)
        if not run.is_dir():
            raise FileNotFoundError(f"run folder {run} does not exist (--run); give the trainer.output_dir of a run")
        checkpoint = None if base else newest_checkpoint(run)
        run_config = run / "config.yaml"
        if not run_config.is_file() and not args.recipe_config:
            raise FileNotFoundError(f"run folder {run} has no config.yaml; add --recipe-config and give the model settings as overrides")
    elif args.checkpoint:
        checkpoint = check_checkpoint(args.checkpoint)
        candidate = checkpoint.parent.parent / "config.yaml"
        run_config = candidate if checkpoint.parent.name == "checkpoints" and candidate.is_file() else None
    if args.recipe_config:
        run_config = None
    cfg = load_config(list(args.overrides), run_config)
    step = json.loads((checkpoint / "state.json").read_text()).get("global_step") if checkpoint else None
    return ModelSource(cfg=cfg, checkpoint=checkpoint, step=step, run_config=run_config)


def chosen_adapter(args, source: ModelSource) -> str:
    """``--adapter`` resolved against the checkpoint: ``ema`` or ``default`` (the base model: ``default``). ``auto`` takes
    what the run evaluated: ``ema`` when the checkpoint holds one and the run's config has ``eval.ema`` on (a run
    that turned it off on resume keeps a stale EMA); without the run's config, ``ema`` whenever the checkpoint holds one."""
    want = getattr(args, "adapter", "auto")
    held = checkpoint_adapters(source.checkpoint) if source.checkpoint is not None else set()
    if want == "ema" and "ema" not in held:
        where = f"checkpoint {source.checkpoint}" if source.checkpoint is not None else "the base model"
        raise ValueError(f"--adapter ema: {where} holds no 'ema' LoRA (the run was trained without eval.ema=true); use --adapter default")
    if want == "auto":
        evaluated = bool(source.cfg.eval.ema) if source.run_config is not None else True
        return "ema" if "ema" in held and evaluated else "default"
    return want


def build_workers(source: ModelSource):
    """One local ``ActorRolloutRefWorker`` group built like the trainer's, with the checkpoint loaded."""
    import torch


    cfg = source.cfg
    if cfg.trainer.threads:
        torch.set_num_threads(int(cfg.trainer.threads))
    config = worker_config(cfg)
    # one local process samples whole videos: a run trained with sequence parallelism is evaluated without it (same weights)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, sequence_parallel=1))
    workers = build_worker_group(ActorRolloutRefWorker, config, backend="local", num_workers=1)
    workers.init_model()
    if source.checkpoint is not None:
        try:
            workers.load_checkpoint(source.checkpoint)
        except (KeyError, RuntimeError) as exc:
            raise ValueError(
                f"checkpoint {source.checkpoint} does not fit the model built from the config (model.family={cfg.model.family}, "
                f"model.path={cfg.model.path}, model.lora.rank={cfg.model.lora.rank}): {exc}; use the run's own config (--run, or "
                "a checkpoint inside its run folder) or matching overrides"
            ) from None
    return workers


def build_metrics(cfg, names: list[str] | None = None) -> dict:
    """``name -> reward`` exactly as the trainer's ``eval_metrics``: ``reward.names``, ``reward.gold``, then the
    second judges of ``reward.judges``."""

    options = OmegaConf.to_container(cfg.reward.options, resolve=True)
    if names is None:
        names = eval_metric_names(cfg.reward)
    return {name: build_reward(name, **options.get(name, {})) for name in dict.fromkeys(names)}


def group_by_prompt(prompts: list[str], per_image: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Mean of every per-image value over the samples of each prompt (prompts in first-seen order)."""
    out = {}
    for prompt in dict.fromkeys(prompts):
        rows = [i for i, p in enumerate(prompts) if p == prompt]
        out[prompt] = {name: sum(values[i] for i in rows) / len(rows) for name, values in per_image.items()}
    return out


def read_prompts(args, required: bool) -> tuple[list | None, dict[str, dict]]:
    """``--prompts`` or ``--prompt-file`` (a prompt file, records with their metadata, or a built-in set's test split)
    and the metadata of each prompt (``{prompt: row}``; empty for ``--prompts``)."""
    if args.prompts and args.prompt_file:
        raise ValueError("give either --prompts or --prompt-file, not both")
    if args.prompt_file:
        return load_prompts(args.prompt_file, "test")
    if args.prompts:
        return list(args.prompts), {}
    if required:
        raise ValueError("no prompts: give --prompts \"a red seven\" … or --prompt-file FILE")
    return None, {}


def prepare_out(folder: str | Path, names: list[str], overwrite: bool) -> Path:
    """``folder`` after checking that none of ``names`` exists in it (checked before any work; created on writing)."""

    folder = Path(folder)
    taken = [n for n in names if (folder / n).exists()]
    if taken and not overwrite:
        raise RunFolderError(f"{folder} already holds {', '.join(taken)}; choose another --out or add --overwrite")
    return folder


def _describe(source: ModelSource) -> dict:
    c = source.cfg
    return {
        "checkpoint": str(source.checkpoint) if source.checkpoint else None, "step": source.step,
        "config": str(source.run_config) if source.run_config else "recipe", "experiment": c.experiment,
        "model": {"family": c.model.family, "path": c.model.path},
    }


# -- sample ---------------------------------------------------------------------------------------------
def run_sample(args) -> int:

    prompts, table = read_prompts(args, required=True)
    out = prepare_out(args.out, ["samples.json", "grid.png", "images"], args.overwrite)
    source = resolve_source(args)
    cfg = source.cfg
    prompts = check_edit_prompts(prompts, cfg.model.family, cfg.sampler, editing=family_class(cfg.model.family).editing)
    metrics = {} if args.rewards in (["none"],) else build_metrics(cfg, args.rewards or None)
    adapter = chosen_adapter(args, source)
    workers = build_workers(source)
    all_records = [p for p in prompts for _ in args.seeds]
    seeds = [s for _ in prompts for s in args.seeds]
    # --stochastic: the rollout's own stochastic sampler, no step trained
    evaluator = Evaluator(metrics, eval_num_steps=None if args.stochastic else cfg.sampler.eval_num_steps, micro_batch_size=cfg.sampler.micro_batch_size)
    result = evaluator.run(workers.generate_sequences, all_records, seeds, policy="ema" if adapter == "ema" else "current",
                           metadata=sample_metadata(split_prompts(all_records)[0], table))  # the records' metadata reaches the rewards
    images, all_prompts, sources, per_image = result.images, result.prompts, result.sources, result.outputs
    means = {f"eval/{name}": float(values.mean()) for name, values in result.scores.items()}
    (out / "images").mkdir(parents=True, exist_ok=True)
    samples = []
    for i, (prompt, seed) in enumerate(zip(all_prompts, seeds)):
        name = f"images/{i:04d}.png"
        save_grid(images[i : i + 1], out / name, columns=1, padding=0)  # a video's middle frame
        if images.ndim == 5:
            save_gif(images[i], out / f"images/{i:04d}.gif")
        samples.append({"index": i, "prompt": prompt, "seed": seed, "image": name, "rewards": {k: v[i] for k, v in per_image.items()},
                        **({"source": all_records[i].name} if sources is not None else {}),
                        **({"metadata": table[prompt]} if prompt in table else {})})
    save_grid(images if sources is None else torch.cat([sources, images], dim=-1), out / "grid.png", columns=len(args.seeds), scale=4)
    stochastic_eval = bool(cfg.sampler.get("eval_stochastic", False))
    sampler = {"kind": cfg.sampler.kind if args.stochastic or stochastic_eval else "ode/ddim (deterministic)",
               "num_steps": cfg.sampler.num_steps if args.stochastic else cfg.sampler.eval_num_steps,
               "guidance_scale": cfg.sampler.guidance_scale, "height": cfg.sampler.height, "width": cfg.sampler.width}
    record = {**_describe(source), "adapter": adapter, "sampler": sampler, "mean": {k[5:]: v for k, v in means.items()},
              "per_prompt": group_by_prompt(all_prompts, per_image), "samples": samples}
    _write_json(out / "samples.json", record)
    print(json.dumps({"out": str(out), "images": len(samples), "mean": record["mean"]}, indent=2), flush=True)
    return 0


# -- eval -----------------------------------------------------------------------------------------------
def run_eval(args) -> int:
    import time


    out = prepare_out(args.out, ["eval.json", "eval_grid.png"], args.overwrite)
    source = resolve_source(args)
    cfg, e = source.cfg, source.cfg.eval
    metrics = build_metrics(cfg)
    adapter = chosen_adapter(args, source)
    workers = build_workers(source)
    _, eval_prompts, table = run_prompts(cfg)  # the trainer's evaluation prompts (a set's test split, eval.num_prompts)
    given, given_table = read_prompts(args, required=False)
    if given:
        table = {**table, **given_table}
    prompts = given or eval_prompts or eval_subset(workers.default_prompts(), e)
    if not prompts:
        raise ValueError(f"model family {cfg.model.family!r} has no built-in prompts; give --prompts, --prompt-file or trainer.prompts=<file>")
    prompts = check_edit_prompts(prompts, cfg.model.family, cfg.sampler, editing=family_class(cfg.model.family).editing)
    start = time.perf_counter()
    all_records, seeds = eval_prompts_and_seeds(prompts, e.seeds_per_prompt, e.seed)
    evaluator = Evaluator(metrics, eval_num_steps=cfg.sampler.eval_num_steps, micro_batch_size=cfg.sampler.micro_batch_size)
    result = evaluator.run(workers.generate_sequences, all_records, seeds, policy="ema" if adapter == "ema" else "current",
                           metadata=sample_metadata(split_prompts(all_records)[0], table))
    images, all_prompts, sources, per_image = result.images, result.prompts, result.sources, result.outputs
    means = {f"eval/{name}": float(values.mean()) for name, values in result.scores.items()}
    cells = images if sources is None else torch.cat([sources, images], dim=-1)  # source | edit
    first_seed = cells[:: e.seeds_per_prompt][: e.max_grid_images]
    out.mkdir(parents=True, exist_ok=True)
    save_grid(first_seed, out / "eval_grid.png", columns=min(10, len(first_seed)), scale=4)
    settings = {"eval_num_steps": cfg.sampler.eval_num_steps, "guidance_scale": cfg.sampler.guidance_scale,
                "eval_seeds_per_prompt": e.seeds_per_prompt, "eval_seed": e.seed, "prompts": len(prompts)}
    record = {
        **_describe(source), "adapter": adapter, "settings": settings, "metrics": means, "gold": cfg.reward.gold, "seconds": time.perf_counter() - start,
        "per_prompt": group_by_prompt(all_prompts, per_image),
        "samples": [{"index": i, "prompt": p, "seed": s, "rewards": {k: v[i] for k, v in per_image.items()}} for i, (p, s) in enumerate(zip(all_prompts, seeds))],
    }
    _write_json(out / "eval.json", record)
    print(json.dumps({"out": str(out), "checkpoint": record["checkpoint"], "metrics": means}, indent=2), flush=True)
    return 0


def _write_json(path: Path, obj) -> None:

    write_json_atomic(path, obj)


# -- export-lora ----------------------------------------------------------------------------------------
def diffusers_lora_state(weights: dict, *, rank: int, alpha: float, adapter: str = "default") -> dict:
    """diffrl checkpoint weights → diffusers/peft LoRA keys of one adapter, scale folded into ``lora_B``.

    ``<module>.lora_A.<adapter>.weight`` → ``<module>.lora_A.weight`` (the pipeline's ``save_lora_weights``
    prefixes the component, e.g. ``transformer.``); ``lora_B`` is multiplied by
    ``alpha / rank`` (peft's ``scaling``), so a loader using ``lora_alpha = r`` computes
    ``W + (alpha/r)·B·A`` as diffrl did. Other adapters (DiffusionNFT's ``old``, or ``default`` when ``ema`` is exported)
    are left out.
    """
    if rank <= 0:
        raise ValueError("model.lora.rank is 0: the checkpoint holds full fine-tuned weights, not a LoRA; there is no LoRA to export")
    scale = alpha / rank
    out = {}
    for name, value in weights.items():
        for part in ("lora_A", "lora_B"):
            marker = f".{part}.{adapter}."
            if marker in name:
                module, _, tail = name.partition(marker)
                if value.ndim != 2 or value.shape[0 if part == "lora_A" else 1] != rank:
                    raise ValueError(f"{name} has shape {tuple(value.shape)}, not a rank-{rank} LoRA; set model.lora.rank to the checkpoint's rank")
                out[f"{module}.{part}.{tail}"] = (value * scale if part == "lora_B" else value).contiguous()
    if not out:
        raise ValueError(f"the checkpoint holds no LoRA adapter {adapter!r} (lora_A/lora_B weights); it was trained with model.lora.rank=0 or is not a diffrl LoRA checkpoint")
    return out


def run_export_lora(args) -> int:
    import diffusers

    if getattr(args, "base", False):
        raise ValueError("export-lora exports a trained checkpoint; --base has no LoRA")
    if not args.run and not args.checkpoint:
        raise ValueError("export-lora needs --run RUN_DIR (its newest checkpoint) or --checkpoint RUN/checkpoints/step_N")
    source = resolve_source(args)
    cfg = source.cfg
    family = cfg.model.family
    adapter_class = family_class(family)  # the family states its diffusers LoRA format (ModelAdapter.lora_pipeline)
    if adapter_class.lora_pipeline is None:
        raise ValueError(f"no diffusers LoRA format is known for model family {family!r} (its adapter sets no lora_pipeline)")
    pipeline_name, prefix = adapter_class.lora_pipeline, adapter_class.lora_component
    weights = load_file(str(source.checkpoint / "model.safetensors"))
    if not any("lora_" in n for n in weights):
        raise ValueError(f"checkpoint {source.checkpoint} holds full fine-tuned weights (model.lora.rank=0), not a LoRA; there is no LoRA to export")
    saved = json.loads((source.checkpoint / "state.json").read_text()).get("lora") if (source.checkpoint / "state.json").is_file() else None
    if saved:  # the checkpoint records what it was trained with; older checkpoints fall back to the config
        if source.run_config is None and (int(cfg.model.lora.rank), float(cfg.model.lora.alpha)) != (saved["rank"], saved["alpha"]):
            print(f"diffrl: note: using the checkpoint's LoRA rank {saved['rank']} / alpha {saved['alpha']} (the recipe config says "
                  f"{cfg.model.lora.rank} / {cfg.model.lora.alpha})", file=sys.stderr, flush=True)
        rank, alpha = int(saved["rank"]), float(saved["alpha"])
    else:
        rank, alpha = int(cfg.model.lora.rank), float(cfg.model.lora.alpha)
    adapter = chosen_adapter(args, source)
    state = diffusers_lora_state(weights, rank=rank, alpha=alpha, adapter=adapter)
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in state})
    out = prepare_out(args.out, [LORA_WEIGHT_NAME, "diffrl_lora.json"], args.overwrite)
    metadata = {"r": rank, "lora_alpha": rank, "target_modules": modules}
    getattr(diffusers, pipeline_name).save_lora_weights(
        str(out), weight_name=LORA_WEIGHT_NAME, **{f"{prefix}_lora_layers": state, f"{prefix}_lora_adapter_metadata": metadata}
    )
    if source.run_config is None and not saved:
        print(
            f"diffrl: warning: LoRA alpha taken from the recipe config (model.lora.alpha={alpha}, rank {rank}), not from a run's "
            "config.yaml; if the checkpoint was trained with another alpha, pass model.lora.alpha=<its value>", file=sys.stderr, flush=True,
        )
    info = {
        **_describe(source), "adapter": adapter, "pipeline": pipeline_name, "component": prefix, "file": LORA_WEIGHT_NAME, "rank": rank,
        "trained_alpha": alpha, "scale_folded_into_lora_B": alpha / rank, "modules": len(modules),
        "load": f"diffusers.{pipeline_name}.from_pretrained(<base model>).load_lora_weights({str(out)!r})",
    }
    _write_json(out / "diffrl_lora.json", info)
    print(json.dumps({"out": str(out), "pipeline": pipeline_name, "adapter": adapter, "tensors": len(state), "rank": rank}, indent=2), flush=True)
    return 0
