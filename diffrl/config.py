"""The structured configs of the components: each is the schema of its yaml group and what the component
consumes at run time (no copies into other settings objects; every default is stated here once).

``ModelConfig`` → the model adapter and the engine (LoRA, FSDP2, compile); ``SamplerConfig`` → rollouts,
evaluation and training windows; ``OptimConfig`` → the engine's optimizer; ``AlgorithmConfig`` → the fields
every algorithm shares (each algorithm class in ``diffrl.algorithms`` extends it with its own ``Config``);
``RewardConfig``, ``TrainerConfig`` → the trainer; ``EvalConfig`` → evaluations, the EMA and checkpoint selection;
``DistributedConfig`` → where the workers run. ``diffrl.recipes`` composes them into the root config.
Sizes are global: ``trainer.prompts_per_step`` prompts × ``trainer.group_size`` samples per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Optional

from omegaconf import DictConfig, OmegaConf

STD_MODES = ("group", "global", "none")
AGGREGATION_MODES = ("sum_rewards", "sum_advantages")
LR_SCHEDULES = ("constant", "linear", "cosine")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """A config that cannot be composed (unknown key, bad value, unknown group option)."""


@dataclass(frozen=True)
class Check:
    """The valid values of one config key: a numeric range (``lo``/``hi``, open or closed) or ``choices``.

    Each config dataclass lists its keys' checks in ``CHECKS``; ``diffrl.recipes.validate`` applies them
    (through the class hierarchy) before a run builds anything. ``None`` passes where the field is
    optional; ``note`` says what a boundary value means (e.g. "0: only at the end")."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False
    choices: tuple | None = None
    note: str = ""

    def describe(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(map(str, self.choices))
        kind = "an integer" if self.integer else "a number"
        parts = []
        if self.lo is not None:
            parts.append(f"{'>' if self.lo_open else '≥'} {self.lo:g}")
        if self.hi is not None:
            parts.append(f"{'<' if self.hi_open else '≤'} {self.hi:g}")
        text = f"{kind} {' and '.join(parts)}" if parts else kind
        return text + (f" ({self.note})" if self.note else "")

    def rejected_examples(self) -> list[Any]:
        """Values this check rejects: just outside each bound, zero or negative where invalid, a non-integer
        for integer keys, a wrong type and an unknown choice (the fault-injection tests try them all)."""
        if self.choices is not None:
            return ["not-a-choice", 3]
        out: list[Any] = ["abc", float("nan"), True]
        if self.lo is not None:
            out.append(self.lo if self.lo_open else self.lo - 1)
            out.append(self.lo - 10)
        if self.hi is not None:
            out.append(self.hi if self.hi_open else self.hi + 1)
        if self.integer:
            out.append((self.lo or 0) + 1.5)
        return [v for v in out if not self.ok(v)]

    def ok(self, value: Any) -> bool:
        if self.choices is not None:
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.integer and not float(value).is_integer():
            return False
        if not math.isfinite(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return not (self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi))


def at_least(lo: float, *, integer: bool = True, note: str = "") -> Check:
    return Check(lo=lo, integer=integer, note=note)


def positive(*, integer: bool = False, note: str = "") -> Check:
    return Check(lo=0, lo_open=True, integer=integer, note=note)


def between(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False, note: str = "") -> Check:
    return Check(lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open, note=note)


def one_of(*choices: Any) -> Check:
    return Check(choices=tuple(choices))


@dataclass
class LoraConfig:
    CHECKS: ClassVar[dict[str, Check]] = {
        "rank": at_least(0, note="0: full fine-tuning"), "alpha": positive(), "dropout": between(0, 1, hi_open=True),
    }
    rank: int = 8
    """LoRA rank; 0 = full fine-tuning"""
    alpha: float = 16.0
    """LoRA alpha (scale = alpha / rank)"""
    dropout: float = 0.0
    """LoRA dropout (0 keeps rollout and training log-probs identical)"""
    target_modules: Optional[list[str]] = None
    """module names (peft target_modules) the LoRA attaches to; null: the model family's default"""
    experts: Optional[list[str]] = None
    """the experts the LoRA attaches to, for two-expert families (wan22): [high], [low] or both; null: every expert (a family
    without experts refuses any other value)"""


@dataclass
class ModelConfig:
    CHECKS: ClassVar[dict[str, Check]] = {"dtype": one_of(*DTYPES), "checkpoint_every": at_least(1), "compile_mode": one_of(*COMPILE_MODES), "compile_scope": one_of("model", "blocks"),
                                          "rollout_precision": one_of("model", "fp8"), "rollout_fp8_kernel": one_of("auto", "emulate", "scaled_mm"),
                                          "sequence_parallel": at_least(1)}
    family: str = "digits"
    """model family (pipelines/<family>)"""
    path: Optional[str] = None
    """the weights: a local diffusers folder or a Hugging Face Hub id (org/name, resolved through the HF cache: only the
    family's components are downloaded; HF_HUB_OFFLINE=1 takes the cached snapshot); null builds the family's random config"""
    revision: Optional[str] = None
    """Hub revision (branch, tag or commit) of a model.path given as a Hub id; null: the default branch"""
    dtype: str = "float32"
    """denoiser dtype: float32 | bfloat16 | float16"""
    device: str = "cpu"
    """torch device"""
    options: dict[str, Any] = field(default_factory=dict)
    """family-specific keyword arguments of the adapter (e.g. +model.options.decode_chunk=4, sample_size for FLUX, drop_text_encoders)"""
    lora: LoraConfig = field(default_factory=LoraConfig)
    fsdp: bool = True
    """shard the denoiser with FSDP2 when distributed.num_workers > 1"""
    param_offload: bool = False
    """FSDP2: keep sharded parameters and optimizer state on the CPU"""
    sequence_parallel: int = 1
    """video families (wan, wan22): split each sample's tokens over this many ranks (Ulysses all-to-all over attention heads,
    diffrl.engine.sequence_parallel); ranks = data-parallel groups × this; it must divide the ranks, the attention heads and
    the video tokens; 1: off"""
    activation_checkpointing: bool = False
    """recompute block activations in the backward pass (diffrl.engine.memory; model.checkpoint_every picks the blocks)"""
    checkpoint_every: int = 1
    """with activation_checkpointing: checkpoint every k-th repeated block (1: all, least memory; 2: every other, half the recompute)"""
    compile: bool = False
    """torch.compile the denoiser in place after LoRA is attached (rollout and training share the compiled module; GPU speed)"""
    compile_backend: str = "inductor"
    """torch.compile backend of model.compile (inductor on GPU; aot_eager for CPU tests)"""
    compile_scope: str = "model"
    """what model.compile compiles: model (the whole denoiser, one graph) | blocks (each repeated block; identical blocks share one graph, so a 60-block model compiles in a fraction of the time)"""
    compile_mode: str = "default"
    """torch.compile mode: default | reduce-overhead (CUDA graphs) | max-autotune | max-autotune-no-cudagraphs"""
    compile_cache_dir: Optional[str] = None
    """inductor's cache directory (compiled kernels, FX graphs), so that a restart does not recompile; null: torch's default (/tmp)"""
    compile_vae: bool = True
    """with model.compile: also compile the VAE decoder of latent families (AutoencoderKL: SD3, FLUX; default mode), which decodes every rollout"""
    rollout_precision: str = "model"
    """model: rollouts in model.dtype | fp8: the denoiser's linear layers in float8 e4m3 with rowwise scales during rollouts
    (diffrl.engine.fp8; training and evaluations stay in model.dtype, and the loss corrects the rollout's policy mismatch
    with truncated importance weights, algorithm.rollout_is_cap)"""
    rollout_fp8_kernel: str = "auto"
    """with rollout_precision=fp8: scaled_mm (torch._scaled_mm, FP8 tensor cores) | emulate (quantise, dequantise, float32
    matmul: the same numbers anywhere) | auto (scaled_mm on CUDA compute capability ≥ 8.9, else emulate)"""
    fuse_lora_rollout: bool = False
    """fold the active LoRA into the base weights during rollouts (one matmul per layer instead of three; exact restore after; costs one copy of the LoRA-targeted weights; rollout log-probs then differ from training's by the fused weights' rounding; with distributed.num_workers > 1 only on rollout replicas)"""

    def adapter_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of the family's adapter: ``options`` plus path, dtype and device."""
        options = OmegaConf.to_container(self.options, resolve=True) if isinstance(self.options, DictConfig) else dict(self.options)
        return {**options, "path": self.path, "revision": self.revision, "dtype": self.dtype, "device": self.device}


@dataclass
class SamplerConfig:
    CHECKS: ClassVar[dict[str, Check]] = {
        "num_steps": at_least(1), "noise_level": at_least(0, integer=False), "clip_sample": positive(),
        "timestep_fraction": between(0, 1, lo_open=True), "window_size": at_least(1), "window_shift": at_least(0),
        "window_shift_every": at_least(1), "guidance_scale": at_least(0, integer=False), "shift": positive(),
        "height": at_least(1), "width": at_least(1), "micro_batch_size": at_least(1), "eval_num_steps": at_least(1),
    }
    num_steps: int = 10
    """denoising steps K of rollouts"""
    kind: str = "flow_sde"
    """step of stochastic rollout steps: flow_sde | dance_sde | cps | ddim; ode | dpm2 sample deterministically"""
    noise_level: float = 0.7
    """noise scale of the stochastic step (Flow-GRPO's a, DanceGRPO's η, DDIM's η)"""
    ode_solver: str = "ode"
    """solver of the steps outside the SDE window: ode (Euler) | dpm2 (DPM-Solver++(2M))"""
    clip_sample: Optional[float] = None
    """ddim: clamp the predicted x0 to [-clip_sample, clip_sample] (pixel-space DDPM models); null: no clamp"""
    window: str = "all"
    """training window: all | fraction | fast (Flow-GRPO-Fast) | mixgrpo | random (DanceGRPO, one choice per RL step) |
    random_per_sample (DanceGRPO's reference code: each sample its own steps, never the last)"""
    timestep_fraction: float = 1.0
    """fraction of steps trained by the fraction and random windows"""
    window_size: int = 2
    """SDE steps in the fast and mixgrpo windows"""
    window_range: list[int] = field(default_factory=list)
    """[start, end) of the steps the fast/mixgrpo window may cover (empty: all steps)"""
    window_shift: int = 1
    """MixGRPO: steps the window moves towards low noise each time"""
    window_shift_every: int = 25
    """MixGRPO: RL steps between moves"""
    window_frozen: bool = False
    """MixGRPO: keep the window at its start"""
    same_initial_noise: bool = False
    """samples of one prompt group share their initial noise"""
    guidance_scale: float = 1.0
    """classifier-free guidance scale; 1 runs no unconditional branch"""
    shift: Optional[float] = None
    """sigma-schedule shift; null takes the model family's"""
    height: int = 16
    """image height in pixels"""
    width: int = 16
    """image width in pixels"""
    micro_batch_size: Optional[int] = None
    """trajectories per rollout forward (null: all of a step)"""
    eval_num_steps: int = 10
    """steps of the deterministic (ODE) evaluation sampler"""
    eval_stochastic: bool = False
    """evaluate with the rollout's stochastic step (kind, noise_level) at every step on the fixed eval seeds,
    instead of the ODE / DDIM(η = 0): the policy stochastic-step RL trains (DDPO's reporting)"""


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule (the engine's optimizer; keys sit under ``algorithm.``)."""

    CHECKS: ClassVar[dict[str, Check]] = {
        "lr": positive(), "lr_schedule": one_of(*LR_SCHEDULES), "warmup_steps": at_least(0), "weight_decay": at_least(0, integer=False),
        "eps": positive(), "max_grad_norm": Check(note="≤ 0: no clipping"), "nonfinite": one_of("skip", "stop"),
    }

    lr: float = 1e-3
    """AdamW learning rate"""
    lr_schedule: str = "constant"
    """constant | linear | cosine (decay to 0 by the last step)"""
    warmup_steps: int = 0
    """optimizer steps of linear learning-rate warm-up"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas"""
    eps: float = 1e-8
    """AdamW epsilon"""
    max_grad_norm: float = 1.0
    """gradient clipping (≤ 0: off)"""
    nonfinite: str = "skip"
    """a non-finite loss or gradient: skip (drop the gradients, count the step in skipped_nonfinite, weights and
    optimizer state unchanged) | stop (the run stops; the newest checkpoint is from before it)"""


@dataclass
class AlgorithmConfig(OptimConfig):
    """What every algorithm has. Each algorithm class (``diffrl.algorithms``) extends this with its own
    ``Config``; the ``algorithm`` schema is the union of the registered ones (``diffrl.recipes``)."""

    CHECKS: ClassVar[dict[str, Check]] = {
        "kl_beta": at_least(0, integer=False), "adv_std_mode": one_of(*STD_MODES), "adv_eps": at_least(0, integer=False),
        "adv_clip_max": positive(), "reward_aggregation": one_of(*AGGREGATION_MODES), "epochs": at_least(1),
        "mini_batch_size": at_least(1), "micro_batch_size": at_least(1),
    }

    name: str = "flow_grpo"
    """the algorithm group's name, set from ``algorithm=<group>`` (diffrl.recipes; another value is refused): not a switch"""
    trainer: str = "policy_gradient"
    """the algorithm class its group's schema selects (never set by hand): a name of the registry
    diffrl.algorithms.ALGORITHMS, e.g. policy_gradient for the groups flow_grpo … ddpo (docs/algorithms.md lists them all)"""
    kl_beta: float = 0.0
    """weight β of the KL to the reference (LoRA disabled)"""
    adv_std_mode: str = "global"
    """advantage normaliser: group | global | none (Dr.GRPO)"""
    adv_eps: float = 1e-4
    """added to the advantage std"""
    adv_clip_max: float = 5.0
    """advantages are clipped to ±adv_clip_max"""
    reward_aggregation: str = "sum_rewards"
    """several rewards: sum_rewards (advantages of the weighted sum) | sum_advantages"""
    epochs: int = 1
    """passes over each step's trajectories"""
    mini_batch_size: Optional[int] = None
    """trajectories per optimizer step (global; null: the whole step)"""
    micro_batch_size: Optional[int] = None
    """trajectories per forward/backward on each worker (null: its whole share of the mini-batch)"""


def eval_metric_names(reward: Any) -> list[str]:
    """The evaluation's metrics of a reward config (the dataclass, its DictConfig or a plain dict), each once, in order:
    ``reward.names``, ``reward.gold``, ``reward.fidelity``, ``reward.judges``."""
    get = reward.get if hasattr(reward, "get") else (lambda key: getattr(reward, key, None))
    optional = [get(key) for key in ("gold", "fidelity")]
    return list(dict.fromkeys([*get("names"), *[n for n in optional if n], *(get("judges") or [])]))


@dataclass
class RewardConfig:
    CHECKS: ClassVar[dict[str, Check]] = {"async_chunks": at_least(1)}
    names: list[str] = field(default_factory=lambda: ["digits"])
    """rewards to optimise: registry names, entry points or module:Class paths"""
    weights: list[float] = field(default_factory=list)
    """weight of each reward in the sum (empty: 1.0 each)"""
    options: dict[str, Any] = field(default_factory=dict)
    """reward name → keyword arguments of its constructor"""
    gold: Optional[str] = "digits_gold"
    """metric reported as gold accuracy at evaluations (a reward name); null: none"""
    judges: list[str] = field(default_factory=list)
    """more judges reported at evaluations beside gold (reward names, never trained on); summary.json flags a judge whose
    change over training differs from gold's beyond the evaluation noise (paired |t| > 2)"""
    fidelity: Optional[str] = None
    """the headline metric that counts a sample only when it is right and real (digits: digits_fidelity, the gold judge's
    accuracy over the samples that pass a realness check); evaluated like gold, and summary.json's ``fidelity`` reports it at
    the evaluation where it is highest while the diversity stays at least 0.70 × the base's; null: none"""
    feature_space: Optional[str] = None
    """a reward that also gives features(images) and reference_features(prompt) (diffrl.sampling.distribution.FeatureSpace):
    evaluations add feature diversity and the Fréchet distance to its real images (digits: digits_gold2); null: pixel
    diversity and near-duplicates only"""
    async_chunks: int = 1
    """sample a step's rollouts in this many chunks of whole prompt groups and score each chunk in a background
    thread while the next one is sampled (remote and model rewards overlap with sampling); 1: sample, then score"""


@dataclass
class TrainerConfig:
    """The loop (``diffrl.trainer``): how many steps of what size, the prompts and seed that fix every step, the run
    folder, checkpoints, resume and logging. Evaluation is ``eval.*`` (:class:`EvalConfig`), where the workers run
    ``distributed.*`` (:class:`DistributedConfig`)."""

    CHECKS: ClassVar[dict[str, Check]] = {
        "steps": at_least(1), "prompts_per_step": at_least(1), "group_size": at_least(1), "seed": at_least(0),
        "checkpoint_every": at_least(0, note="0: only at the end"), "threads": at_least(1), "peak_flops": positive(),
        "resume": one_of("never", "auto"), "max_restarts": at_least(0), "wandb": one_of("offline", "online", "disabled"),
    }
    steps: int = 100
    """RL steps"""
    prompts_per_step: int = 8
    """distinct prompts per step (global)"""
    group_size: int = 8
    """samples per prompt (global)"""
    seed: int = 0
    """seed of prompts, noise and initialisation"""
    prompts: Optional[str] = None
    """training prompts: a built-in prompt set (geneval | ocr | general: its train split, with each prompt's metadata for
    the rewards; docs/prompts.md), a prompt file (one per line), a JSONL of records (GenEval rows {prompt, tag, include, …},
    {prompt, metadata}, or editing records {source, instruction, metadata}); null: the model family's built-in prompts;
    ${prompts_required:'<what>'} in a recipe: it needs the user's records (refused without them, naming what)"""
    prompts_if_missing: Optional[str] = None
    """the prompts a recipe that requires trainer.prompts (${prompts_required:…}) takes when none is given: +shrink=tiny sets tiny stand-in
    records so such a recipe runs shrunk; null: a recipe without its prompts is refused before anything is built"""
    plan_check: bool = True
    """on a GPU run, plan the recipe first (diffrl plan, on the CPU, before anything is allocated) and warn when its peak
    exceeds the device's memory; false: skip the check"""
    checkpoint_every: int = 50
    """write a LoRA checkpoint every N steps (and at the end); 0: only at the end"""
    output_dir: Optional[str] = None
    """run folder; null: outputs/<experiment>-<timestamp>"""
    progress: bool = True
    """show a progress bar"""
    no_spread_warning: int = 10
    """warn (one line, once) when no prompt group's rewards have differed for this many steps in a row: every advantage is
    0, so loss and grad norm are 0 and nothing learns; 0: never warn"""
    threads: Optional[int] = None
    """torch CPU threads (null: torch's default)"""
    peak_flops: Optional[float] = None
    """FLOP/s per device for MFU (null: the device table of diffrl.engine.flops; no MFU on CPU)"""
    max_restarts: int = 0
    """a lost worker (Ray): restart the workers from the newest checkpoint up to this many times; 0: stop with a clear error"""
    resume: str = "never"
    """never | auto: continue from the newest complete checkpoint in output_dir (partial ones are ignored)"""
    wandb: str = "offline"
    """wandb logging: offline (run files in <output_dir>/wandb, nothing leaves the machine) | online | disabled"""
    wandb_project: str = "diffrl"
    """wandb project"""
    wandb_entity: Optional[str] = None
    """wandb entity (team or user; null: the account's default)"""
    wandb_run_name: Optional[str] = None
    """wandb run name (null: the run folder's name)"""


@dataclass
class EvalConfig:
    """Evaluations (``diffrl.sampling.evaluator``): before the first step, every ``eval.every`` steps and after the last,
    deterministic samples of held-out (prompt, seed) pairs scored by every reward and judge; the weights they evaluate
    (the trained LoRA or its EMA, ``eval.ema``), and what the run keeps or stops on by them (``eval.select_by``,
    ``eval.stop_when_diverging``). ``diffrl eval`` / ``sample`` read the same keys from a run's config."""

    CHECKS: ClassVar[dict[str, Check]] = {
        "num_prompts": at_least(1), "every": at_least(0, note="0: only before and after training"), "seeds_per_prompt": at_least(1),
        "seed": at_least(0), "max_grid_images": at_least(1), "ema_decay": between(0, 1, hi_open=True), "ema_every": at_least(1),
        "ema_cadence": one_of("rl_step", "optimizer_step"), "ema_repeats": at_least(1), "stop_when_diverging": at_least(0, note="0: off"),
    }
    prompts: Optional[str] = None
    """evaluation prompts: a built-in set (its test split) or a file; null: the test split of trainer.prompts when it
    names a built-in set, else trainer.prompts (or the family's built-in prompts)"""
    num_prompts: Optional[int] = None
    """evaluate the first N evaluation prompts (null: all of them; GenEval's test split has 553)"""
    every: int = 50
    """evaluate every N steps (and before the first and after the last step); 0: only before and after"""
    seeds_per_prompt: int = 4
    """evaluation samples per prompt (fixed held-out seeds)"""
    seed: int = 1234
    """base seed of evaluation samples (disjoint from training seeds)"""
    max_grid_images: int = 60
    """images in each evaluation grid (and rows of the wandb sample table)"""
    ema: bool = False
    """evaluate an EMA of the trained LoRA (flow_grpo's train.ema): a LoRA adapter "ema", a copy of the initial adapter,
    moved towards the trained one every ema_every steps (ema_cadence) by ema ← d·ema + (1 − d)·trained with d = min((1 + s)/(10 + s),
    ema_decay) after s steps; evaluations, and by default diffrl sample/eval/export-lora of its checkpoints, use it; rollouts
    keep sampling the trained weights (so it is a matter of what is evaluated and exported, not of training)"""
    ema_decay: float = 0.9
    """the EMA's decay once warmed up (flow_grpo: 0.9)"""
    ema_every: int = 8
    """steps between EMA updates, counted in ema_cadence's unit (flow_grpo: 8 optimizer steps)"""
    ema_cadence: str = "rl_step"
    """rl_step: after RL step s, when s % ema_every == 0, with d(s) | optimizer_step (flow_grpo's EMAModuleWrapper): after
    optimizer step n of the run (inside the update, at the weights of that step), when (n + 1) % ema_every == 0, with d(n)"""
    ema_repeats: int = 1
    """EMA moves per update, each ema ← d·ema + (1 − d)·trained (flow_grpo calls its EMA once per per-GPU micro-batch, so each
    of its updates is repeated gradient_accumulation_steps times: 2 in its 32-GPU SD3 configs)"""
    select_by: Optional[str] = None
    """keep the best checkpoint by this evaluation metric, a held-out judge the run does not train on (reward.gold or one of
    reward.judges, or any eval/ key; a leading - selects the lowest): each evaluation that beats every earlier one writes a
    checkpoint and best.json names it (diffrl.selection); null: off"""
    stop_when_diverging: int = 0
    """k ≥ 1: stop when over the last k evaluations the evaluation reward rose every time while eval.select_by's metric fell
    every time (the reward-hacking signature), naming the step and the best checkpoint; 0: off"""


@dataclass
class DistributedConfig:
    """Where the workers run (``diffrl.distributed``): in this process or as Ray actors with torch.distributed + FSDP2,
    how many data-parallel ranks and their resources, and rollout replicas beside them (their weight sync and how far
    their rollouts may run ahead). Sizes of ``trainer.*`` are global and split evenly over ``distributed.num_workers``."""

    CHECKS: ClassVar[dict[str, Check]] = {
        "backend": one_of("local", "ray"), "num_workers": at_least(1),
        "num_gpus_per_worker": at_least(0, integer=False), "num_cpus_per_worker": at_least(0, integer=False),
        "ray_rendezvous_timeout_s": positive(), "ray_call_timeout_s": positive(),
        "rollout_replicas": at_least(0, note="0: rollout on the actor ranks"), "max_staleness": at_least(0, note="0: synchronous"),
        "weight_sync_bucket_mb": positive(), "weight_sync_backend": one_of("gloo", "nccl"),
        "num_gpus_per_rollout": at_least(0, integer=False), "num_cpus_per_rollout": at_least(0, integer=False),
    }
    backend: str = "local"
    """local (one worker in this process) | ray (one Ray actor per worker, torch.distributed + FSDP2)"""
    num_workers: int = 1
    """data-parallel workers (ranks); global sizes are split evenly over them"""
    num_gpus_per_worker: float = 0.0
    """Ray: GPUs per worker (0 on CPU)"""
    num_cpus_per_worker: float = 1.0
    """Ray: CPUs per worker"""
    ray_address: Optional[str] = None
    """Ray: the cluster to join (auto, host:port or ray://head:10001); null: start a local Ray in this process"""
    ray_rendezvous_timeout_s: float = 300.0
    """Ray: seconds for the ranks' placement and process-group rendezvous before a clear error"""
    ray_call_timeout_s: Optional[float] = None
    """Ray: seconds a worker call may take before an error naming the ranks that did not answer (null: no limit)"""
    rollout_replicas: int = 0
    """Ray: rollout replicas, each a Ray actor with its own model copy synced from the actor after every step (0: the actor ranks sample)"""
    max_staleness: int = 0
    """with rollout replicas: steps a trajectory's weights may lag the actor's (0: synchronous; k ≥ 1: rollouts run k steps ahead of training,
    corrected by truncated importance weights, algorithm.rollout_is_cap)"""
    weight_sync_bucket_mb: float = 64.0
    """weight sync to the replicas: MiB per broadcast bucket"""
    weight_sync_backend: Optional[str] = None
    """weight sync: gloo | nccl (null: nccl when model.device is CUDA, else gloo; a replica on the actor's own GPU needs gloo)"""
    num_gpus_per_rollout: float = 0.0
    """Ray: GPUs per rollout replica (fractions share a GPU with the actor)"""
    num_cpus_per_rollout: float = 1.0
    """Ray: CPUs per rollout replica"""


@dataclass(frozen=True)
class BatchPlan:
    """A run's batch arithmetic, derived once from its global sizes (``trainer.prompts_per_step`` ×
    ``trainer.group_size``), its ranks (``distributed.num_workers``, ``model.sequence_parallel``) and the algorithm's
    ``mini_batch_size``; the checks, the algorithm (``RunContext.batch``) and the rollout request read it."""

    prompts_per_step: int
    group_size: int
    num_workers: int = 1
    sequence_parallel: int = 1
    """ranks that share one data-parallel group's samples"""
    mini_batch_size: int = 0
    """algorithm.mini_batch_size (0: one mini-batch of the whole step)"""

    @classmethod
    def of(cls, trainer: Any, distributed: Any = None, model: Any = None, algorithm: Any = None) -> "BatchPlan":
        """The plan of the sizes in ``trainer`` (and, when given, ``distributed``, ``model`` and ``algorithm``)."""
        return cls(
            prompts_per_step=int(trainer.prompts_per_step), group_size=int(trainer.group_size),
            num_workers=int(distributed.num_workers) if distributed is not None else 1,
            sequence_parallel=int(getattr(model, "sequence_parallel", 1) or 1) if model is not None else 1,
            mini_batch_size=int(algorithm.mini_batch_size or 0) if algorithm is not None else 0,
        )

    @property
    def rows(self) -> int:
        """Trajectories of one RL step: ``prompts_per_step × group_size``."""
        return self.prompts_per_step * self.group_size

    @property
    def mini_batch(self) -> int:
        """Rows of one optimizer step (the whole step when ``mini_batch_size`` is 0)."""
        return self.mini_batch_size or self.rows

    @property
    def dp_size(self) -> int:
        """Data-parallel groups: groups of ``sequence_parallel`` ranks share their samples (a ``sequence_parallel`` that
        does not divide ``num_workers`` is refused with the workers, and counts as one rank a group here)."""
        k, W = self.sequence_parallel, self.num_workers
        return W // k if k > 1 and W % k == 0 else W


EVAL_KEYS = ("eval_prompts", "eval_num_prompts", "eval_every", "eval_seeds_per_prompt", "eval_seed", "max_grid_images", "ema",
             "ema_decay", "ema_every", "select_by", "stop_when_diverging")
MOVED_KEYS: dict[str, str] = {
    **{f"trainer.{key}": "eval." + key.removeprefix("eval_") for key in EVAL_KEYS},
    **{f"trainer.{f.name}": f"distributed.{f.name}" for f in fields(DistributedConfig)},
}
"""Keys that ``TrainerConfig`` held before it was split by concern (old key → new key); ``diffrl.recipes`` refuses an
old key with one line naming its new place."""
