"""Strict structured configs (hydra ConfigStore) and how the CLI composes them.

``configs/config.yaml`` composes the groups ``model/ algorithm/ reward/ sampler/ experiment/`` on top
of the :class:`Config` schema registered here; an unknown key anywhere is an error naming the key.
Sizes are global: ``trainer.prompts_per_step`` prompts × ``trainer.group_size`` samples per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


@dataclass
class LoraSettings:
    rank: int = 8
    """LoRA rank; 0 = full fine-tuning"""
    alpha: float = 16.0
    """LoRA alpha (scale = alpha / rank)"""
    dropout: float = 0.0
    """LoRA dropout (0 keeps rollout and training log-probs identical)"""
    target_modules: Optional[list[str]] = None
    """module names (peft target_modules) the LoRA attaches to; null: the model family's default"""


@dataclass
class ModelConfig:
    family: str = "digits"
    """model family (pipelines/<family>)"""
    path: Optional[str] = None
    """local diffusers folder with the weights; null builds the family's tiny random config"""
    dtype: str = "float32"
    """denoiser dtype: float32 | bfloat16 | float16"""
    device: str = "cpu"
    """torch device"""
    options: dict[str, Any] = field(default_factory=dict)
    """family-specific keyword arguments of the adapter (e.g. +model.options.decode_chunk=4, sample_size for FLUX, drop_text_encoders)"""
    lora: LoraSettings = field(default_factory=LoraSettings)
    fsdp: bool = True
    """shard the denoiser with FSDP2 when trainer.num_workers > 1"""
    param_offload: bool = False
    """FSDP2: keep sharded parameters and optimizer state on the CPU"""
    activation_checkpointing: bool = False
    """recompute block activations in the backward pass"""
    compile: bool = False
    """torch.compile the denoiser in place after LoRA is attached (rollout and training share the compiled module; GPU speed)"""


@dataclass
class SamplerConfig:
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
    """training window: all | fraction | fast (Flow-GRPO-Fast) | mixgrpo | random (DanceGRPO)"""
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
class AlgorithmConfig:
    name: str = "flow_grpo"
    """algorithm name (documentation and run naming)"""
    trainer: str = "policy_gradient"
    """trainer type: policy_gradient | preference (Diffusion-DPO) | nft (DiffusionNFT)"""
    loss: str = "flow_grpo"
    """policy-gradient loss in the diffrl.losses registry: flow_grpo | grpo_guard | ddpo"""
    clip_range: float = 0.2
    """PPO ratio clip ε"""
    kl_beta: float = 0.0
    """weight β of the KL to the reference (LoRA disabled)"""
    kl_dt_scale: bool = False
    """Flow-GRPO KL with the dt factor ((μ−μ_ref)²/(2σ_t²)) instead of the exact Gaussian KL"""
    ratio_norm: bool = True
    """grpo_guard: normalise the log-ratio (RatioNorm)"""
    grad_reweight: bool = True
    """grpo_guard: reweight each step's surrogate by 1/Δt"""
    adv_std_mode: str = "global"
    """advantage normaliser: group | global | none (Dr.GRPO)"""
    adv_drop_zero_std: bool = False
    """drop prompt groups whose rewards are all equal (counted in metrics)"""
    adv_stat_tracker: bool = False
    """DDPO's per-prompt stat tracker instead of the current group's statistics"""
    adv_tracker_buffer: int = 32
    """stat tracker: rewards kept per prompt"""
    adv_tracker_min_count: int = 16
    """stat tracker: rewards of a prompt needed before its own statistics are used"""
    reward_aggregation: str = "sum_rewards"
    """several rewards: sum_rewards (advantages of the weighted sum) | sum_advantages"""
    dpo_beta: float = 50.0
    """Diffusion-DPO β (the reference code's beta_dpo)"""
    dpo_num_timesteps: int = 4
    """noise levels drawn per pair and update"""
    preference_pairs: Optional[str] = None
    """offline pairs (jsonl or parquet: prompt, image_0, image_1, label_0); null: online best/worst of each group"""
    nft_beta: float = 1.0
    """DiffusionNFT β"""
    nft_adaptive_weight: bool = True
    """DiffusionNFT's x0-space adaptively weighted loss"""
    nft_num_timesteps: Optional[int] = None
    """noise levels of the sampler schedule trained per sample (null: all K)"""
    old_schedule: str = "linear_to_0_5"
    """old-policy EMA decay: copy | linear_to_0_5 | delayed_linear | constant"""
    old_decay_rate: Optional[float] = None
    """decay increase per RL step (null: the schedule's default)"""
    old_decay_max: Optional[float] = None
    """largest decay (null: the schedule's default)"""
    old_decay_delay: Optional[int] = None
    """delayed_linear: RL steps at decay 0 (null: 75)"""
    adv_eps: float = 1e-4
    """added to the advantage std"""
    adv_clip_max: float = 5.0
    """advantages are clipped to ±adv_clip_max"""
    epochs: int = 1
    """passes over each step's trajectories"""
    mini_batch_size: Optional[int] = None
    """trajectories per optimizer step (global; null: the whole step)"""
    micro_batch_size: Optional[int] = None
    """trajectories per forward/backward on each worker (null: its whole share of the mini-batch)"""
    lr: float = 1e-3
    """AdamW learning rate"""
    lr_schedule: str = "constant"
    """constant | linear | cosine (decay to 0 by the last step)"""
    warmup_steps: int = 0
    """optimizer steps of linear learning-rate warm-up"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradient clipping (≤ 0: off)"""


@dataclass
class RewardConfig:
    names: list[str] = field(default_factory=lambda: ["digits"])
    """rewards to optimise: registry names, entry points or module:Class paths"""
    weights: list[float] = field(default_factory=list)
    """weight of each reward in the sum (empty: 1.0 each)"""
    options: dict[str, Any] = field(default_factory=dict)
    """reward name → keyword arguments of its constructor"""
    gold: Optional[str] = "digits_gold"
    """metric reported as gold accuracy at evaluations (a reward name); null: none"""
    async_chunks: int = 1
    """sample a step's rollouts in this many chunks of whole prompt groups and score each chunk in a background
    thread while the next one is sampled (remote and model rewards overlap with sampling); 1: sample, then score"""


@dataclass
class TrainerConfig:
    steps: int = 100
    """RL steps"""
    prompts_per_step: int = 8
    """distinct prompts per step (global)"""
    group_size: int = 8
    """samples per prompt (global)"""
    seed: int = 0
    """seed of prompts, noise and initialisation"""
    prompts: Optional[str] = None
    """prompt file (one per line); null: the model family's built-in prompt set"""
    eval_every: int = 50
    """evaluate every N steps (and before the first and after the last step)"""
    eval_seeds_per_prompt: int = 4
    """evaluation samples per prompt (fixed held-out seeds)"""
    eval_seed: int = 1234
    """base seed of evaluation samples (disjoint from training seeds)"""
    checkpoint_every: int = 50
    """write a LoRA checkpoint every N steps (and at the end); 0: only at the end"""
    output_dir: Optional[str] = None
    """run folder; null: outputs/<experiment>-<timestamp>"""
    progress: bool = True
    """show a progress bar"""
    max_grid_images: int = 60
    """images in each evaluation grid"""
    threads: Optional[int] = None
    """torch CPU threads (null: torch's default)"""
    peak_flops: Optional[float] = None
    """FLOP/s per device for MFU (null: the device table of diffrl.flops; no MFU on CPU)"""
    backend: str = "local"
    """local (one worker in this process) | ray (one Ray actor per worker, torch.distributed + FSDP2)"""
    num_workers: int = 1
    """data-parallel workers (ranks); global sizes are split evenly over them"""
    num_gpus_per_worker: float = 0.0
    """Ray: GPUs per worker (0 on CPU)"""
    num_cpus_per_worker: float = 1.0
    """Ray: CPUs per worker"""
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
class Config:
    experiment: str = "custom"
    """recipe name (set by experiment/*.yaml)"""
    model: ModelConfig = field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


class ConfigError(ValueError):
    """A config that cannot be composed (unknown key, bad value, unknown group option)."""


def _register() -> None:
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="diffrl_schema", node=Config)
    cs.store(group="model", name="diffrl_schema", node=ModelConfig)
    cs.store(group="algorithm", name="diffrl_schema", node=AlgorithmConfig)
    cs.store(group="reward", name="diffrl_schema", node=RewardConfig)
    cs.store(group="sampler", name="diffrl_schema", node=SamplerConfig)


def _asset_path(name: str) -> str:
    return str(CONFIG_DIR.parent / "assets" / name)


if not OmegaConf.has_resolver("asset"):
    OmegaConf.register_new_resolver("asset", _asset_path)


def _valid_keys(dotted_parent: str) -> list[str]:
    node: Any = OmegaConf.structured(Config)
    for part in [p for p in dotted_parent.split(".") if p]:
        node = node.get(part) if isinstance(node, DictConfig) else None
    return sorted(node.keys()) if isinstance(node, DictConfig) else []


def _explain(exc: Exception) -> str:
    """Turn hydra/omegaconf errors into one message that names the key and the valid choices."""
    import re

    text = str(exc)
    match = re.search(r"Could not override '([^']+)'", text) or re.search(r"Key '([^']+)' (?:is )?not in", text)
    if match:
        key = match.group(1)
        full = getattr(exc, "full_key", None) or key
        parent = full.rsplit(".", 1)[0] if "." in full else ""
        valid = _valid_keys(parent)
        where = f" under '{parent}'" if parent else ""
        return f"unknown config key '{full}'{where}; valid keys{where}: {valid}. Check the spelling (see diffrl/config.py)."
    cause = exc.__cause__ or exc.__context__
    return f"invalid configuration: {text}" + (f" ({cause})" if cause else "")


def compose(overrides: list[str] | None = None, config_name: str = "config") -> DictConfig:
    """Compose ``configs/<config_name>.yaml`` with command-line ``overrides`` (hydra syntax).

    Raises:
        ConfigError: naming the offending key or group option, with the valid choices where known.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    _register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides or []))
        schema = OmegaConf.structured(Config)
        OmegaConf.set_struct(schema, True)
        OmegaConf.set_struct(schema.reward.options, False)  # per-reward option dicts: +reward.options.<name>.<key>=
        OmegaConf.set_struct(schema.model.options, False)  # adapter keyword arguments: +model.options.<key>=
        cfg_typed = OmegaConf.merge(schema, OmegaConf.to_container(cfg, resolve=False))
        OmegaConf.resolve(cfg_typed)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(_explain(exc)) from None
    OmegaConf.set_struct(cfg_typed, True)
    return cfg_typed
