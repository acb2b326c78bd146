"""``diffrl plan``: will a recipe fit on my GPUs, and how long will a step take — answered on a CPU before renting them.

The recipe is composed exactly as ``diffrl train`` composes it; its model is built at the published shape of
``model.path`` (or ``model.options.shape``) with fake tensors (:mod:`diffrl.engine.trace`), and the run's own
code is stepped on one rank's share of the batch: the worker is built (LoRA or full, reference/old/EMA
adapters, optimizer), the step's prompts encoded, one rollout sampled as configured (every step, CFG mode,
rollout micro-batches, VAE decode chunks), one training micro-batch of one trained step updated through the
algorithm (forward, activation checkpointing, backward, the optimizer's step and states), then a second
rollout with the optimizer state resident. Nothing is allocated; the live bytes of every phase and the FLOPs
that ran are counted.

Per rank of ``--gpus N`` (``distributed.num_workers=N`` sharding the batch; with ``model.fsdp`` the parameters,
gradients and optimizer states are FSDP2-sharded ``1/N``, plus two blocks gathered whole for prefetch; with
``model.param_offload`` those live on the host). With ``model.sequence_parallel=k`` the N ranks form N/k data-parallel
groups of k: one rank of a group is traced on its group's samples with the video transformers split as the run splits
them (:mod:`diffrl.engine.sequence_parallel`; its all-to-alls and gathers run as local copies of the same shapes), so
the transformer's activations and FLOPs are the rank's 1/k while the trajectories, the VAE and the text encoders stay
whole:

* peak memory by phase and by category (weights, trainable parameters, the fp32 master weights of a bf16 full
  fine-tune, gradients, optimizer states, other adapters, VAE and text encoders, and the activations and rollout
  buffers above them);
* FLOPs of one RL step (the rollout's and the update's: the traced micro-batch × micro-batches × trained
  steps), and the seconds and images/s they take at a per-GPU MFU: the one measured on an H200 for that
  model (:data:`MEASURED_MFU`, its source named) or ``--mfu``;
* the text encoders as the run holds them (published shapes build the published ones: T5-XXL and the CLIPs,
  Qwen2.5-VL-7B, UMT5-XXL), until ``drop_text_encoders`` frees them after the prompts are cached;
* the reward models of ``reward.names`` that run on a GPU, from the published weights they declare
  (:mod:`diffrl.tools.plan_rewards`), beside rank 0's policy (the trainer's process builds them); the EMA adapter
  of ``eval.ema``;
* when the peak exceeds the budget, the cheapest change that fits (each candidate planned again), starting from
  the phase that peaks and trying text-encoder dropping, ``param_offload`` and more GPUs, ending with the exact
  overrides to add; or, when nothing tried fits, what came closest.

Not counted (printed as such): reward models' activations while scoring and any reward whose weights are not
known, evaluations, CUDA's context and workspaces and the caching allocator's fragmentation (the measured peaks in
``benchmarks/RESULTS.md`` "diffrl plan against the H200 measurements" show how close the rest is).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from diffusers.models import modeling_utils
from omegaconf import OmegaConf, open_dict

from diffrl.algorithms import build_algorithm, objectives
from diffrl.data import run_prompts, step_prompts
from diffrl.distributed import build_worker_group
from diffrl.distributed.workers import ActorRolloutRefWorker
from diffrl.engine import sequence_parallel
from diffrl.engine import trace as tracing
from diffrl.engine.engine import DiffusionEngine
from diffrl.engine.flops import DEVICE_PEAK_FLOPS
from diffrl.recipes import compose, validate
from diffrl.recipes import check_sizes
from diffrl.rollout_driver import rollout_request
from diffrl.sampling import rollout, sde
from diffrl.run_setup import run_context, worker_config
from diffrl.sampling.schedules import build_window
from diffrl.tools.plan_rewards import reward_bytes
from pipelines.base import PARENT_SHAPES, SHAPES, family_class, parent_shape_name, published_shape

GiB = 2**30
GPUS = {  # name → (memory in GiB that torch reports as total, dense bf16 FLOP/s from diffrl.engine.flops)
    "h100": (79.2, DEVICE_PEAK_FLOPS["H100"]),
    "h200": (139.8, DEVICE_PEAK_FLOPS["H200"]),
    "a100": (79.2, DEVICE_PEAK_FLOPS["A100"]),
    "a100-40gb": (39.4, DEVICE_PEAK_FLOPS["A100"]),
    "l40s": (44.4, DEVICE_PEAK_FLOPS["L40S"]),
    "a10g": (22.0, DEVICE_PEAK_FLOPS["A10G"]),
    "rtx4090": (23.6, DEVICE_PEAK_FLOPS["RTX 4090"]),
}
# executed MFU (FLOPs run / seconds / matmul peak measured in the run) of rollout and training, measured on one
# H200 by benchmarks/speed/gpu_scale.py (benchmarks/results/<source>); model.compile picks the row
MEASURED_MFU = {
    ("qwen_image", False): (0.452, 0.436, "gpu_scale_qwen_image_verl_omni_h200.json eager"),
    ("qwen_image", True): (0.624, 0.651, "gpu_scale_qwen_image_verl_omni_h200.json compiled"),
    ("flux_dev", True): (0.660, 0.704, "gpu_scale_flux_dev_h200.json compiled"),
    ("sd35_large", True): (0.588, 0.588, "gpu_scale_sd35_large_b32_h200.json compiled"),
    ("sd35_medium", False): (0.289, 0.273, "gpu_scale_sd35m_b32_eager_autotune_cut_h200.json eager"),
    ("sd35_medium", True): (0.485, 0.541, "gpu_scale_sd35m_cudagraphs_rollout_only_h200.json compiled"),
    ("wan21_14b", True): (0.680, 0.704, "gpu_scale_wan21_14b_h200.json compiled"),
}
ASSUMED_MFU = 0.3


class PlanError(ValueError):
    """Bad input to the planner (one line: the cause and the fix)."""


def gpu_spec(gpu: str, memory_gb: float | None) -> tuple[str, float, float]:
    """``(name, memory GiB, peak FLOP/s)`` of ``--gpu`` (``--gpu-memory-gb`` overrides the memory)."""
    name = gpu.lower().replace("_", "-")
    if name not in GPUS:
        raise PlanError(f"unknown GPU {gpu!r}; choose one of {sorted(GPUS)} (or give --gpu-memory-gb and --peak-tflops with any of them)")
    memory, peak = GPUS[name]
    if memory_gb is not None and not memory_gb > 0:
        raise PlanError(f"--gpu-memory-gb must be > 0, got {memory_gb}")
    return name, float(memory_gb or memory), peak


def shape_of(family: str, path, shape: str) -> str:
    """The published shape a recipe plans at (``pipelines.base.published_shape``), its error as :class:`PlanError`."""
    try:
        return published_shape(family, path, shape)
    except ValueError as exc:
        raise PlanError(str(exc)) from None


def plan_config(overrides: list[str], gpus: int):
    """The recipe composed and validated like ``diffrl train``, set up for planning: ``distributed.num_workers=N``
    checked against the batch, the model at its published shape on fake CPU tensors."""
    if gpus < 1:
        raise PlanError(f"--gpus must be ≥ 1, got {gpus}")
    cfg = compose(overrides)
    k = int(cfg.model.sequence_parallel)
    if gpus % k:
        raise PlanError(f"model.sequence_parallel={k} splits each sample over {k} GPUs: --gpus must be a multiple of {k}, got {gpus}")
    if k > 1 and not cfg.model.fsdp:
        raise PlanError(f"model.sequence_parallel={k} runs on ranks sharded with FSDP2: add model.fsdp=true")
    with open_dict(cfg):
        cfg.distributed.num_workers = gpus
        family = cfg.model.family
        options = cfg.model.get("options") or {}
        shape = shape_of(family, cfg.model.path, str(options.get("shape", "tiny")))
        if shape != "local":
            cfg.model.path = None
            cfg.model.revision = None
        if shape not in ("tiny", "local"):
            cfg.model.options = {**(OmegaConf.to_container(cfg.model.options) if cfg.model.options else {}), "shape": shape}
        cfg.model.device = "cpu"
        cfg.distributed.backend = "local"
    cfg = validate(cfg, hub_cache=False)  # nothing is loaded: the plan needs no cached weights
    try:
        check_sizes(cfg, backend=False)  # N Ray ranks planned as one local worker, on a machine that need not have Ray
        sequence_parallel.check_config(cfg.model, cfg.sampler, family_class(cfg.model.family), num_workers=gpus, backend="ray")  # family, heads, tokens
    except ValueError as exc:
        raise PlanError(f"{exc} (planning --gpus {gpus})") from None
    return cfg, shape


@dataclass
class Trace:
    """One rank's traced step: phases (peak/after bytes, FLOPs), static bytes by category, the FLOPs of the
    step's rollout and update, the largest FSDP block's parameter bytes; the reward models' bytes on rank 0's GPU
    and what could not be counted."""

    phases: dict
    categories: dict
    rollout_flops: float
    train_flops: float
    block_bytes: int
    images_per_rank: int
    trace_s: float
    rewards: dict = dataclasses.field(default_factory=dict)
    not_counted: list = dataclasses.field(default_factory=list)


def _param_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters()) if module is not None else 0


def _categories(worker, ema: bool = False) -> dict:
    engine = worker.engine
    adapter = engine.adapter
    denoiser = adapter.denoiser
    frozen = trainable = other_adapters = 0
    for name, p in denoiser.named_parameters():
        size = p.numel() * p.element_size()
        if p.requires_grad:
            trainable += size
        elif "lora_" in name:
            other_adapters += size
        else:
            frozen += size
    optimizer = sum(t.numel() * t.element_size() for state in engine.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor))
    encoders = sum(_param_bytes(m) for m in getattr(adapter, "text_encoders", {}).values())
    reference = _param_bytes(engine._reference_copy.denoiser) if engine._reference_copy is not None else 0
    # bf16 full fine-tuning: fp32 masters (4 bytes a weight) are stepped, and their fp32 gradients are the ones that persist
    master_state = engine.master_state()
    masters = sum(m.numel() * m.element_size() for m in master_state.values())
    gradients = sum((master_state[n] if n in master_state else p).numel() * (master_state[n] if n in master_state else p).element_size()
                    for n, p in denoiser.named_parameters() if p.requires_grad)
    categories = {"weights": frozen, "trainable": trainable, "gradients": gradients, "optimizer": optimizer, "other_adapters": other_adapters,
                  "reference_copy": reference, "vae": _param_bytes(getattr(adapter, "vae", None)), "text_encoders": encoders}
    if masters:  # (absent otherwise: LoRA plans read as before)
        categories["master_weights"] = masters
    if ema and engine.uses_lora and not any(".ema." in name for name, _ in denoiser.named_parameters()):
        categories["ema_adapter"] = trainable  # eval.ema's adapter, made at the first optimizer step: a copy of the trained one
    return categories


def step_recipe(cfg, gpus: int, phase, memo=lambda adapter: contextlib.nullcontext()) -> dict:
    """Run one rank's share of the recipe's first RL step in phases: ``build`` (the worker: model, adapters,
    optimizer), ``text_encode``, ``rollout``, ``train`` (one micro-batch of one trained step through the
    algorithm's update) and ``rollout_after_update`` (the optimizer state resident). ``phase(name)`` is a
    context manager around each; ``memo(adapter)`` one around the rollouts and the update. Returns the sizes
    the FLOPs scale by and the static bytes by category."""
    t = cfg.trainer
    # an objective on clean samples trains `<...>num_timesteps` noise levels per sample, one backward each: the
    # peak of one is the peak of all, so one is traced and its FLOPs scaled (NFT's 24 levels would cost minutes)
    levels = {k: int(v) for k, v in vars(cfg.algorithm).items() if k.endswith("num_timesteps") and isinstance(v, int) and v > 1}
    if levels:
        cfg = copy.copy(cfg)
        cfg.algorithm = dataclasses.replace(cfg.algorithm, **{k: 1 for k in levels})
    k = int(cfg.model.sequence_parallel)
    if k > 1:  # the worker is built whole on one process; its transformers are split below
        cfg = copy.copy(cfg)
        cfg.model = dataclasses.replace(cfg.model, sequence_parallel=1)
    run = run_context(cfg)
    algorithm = build_algorithm(cfg.algorithm, run)
    config = worker_config(cfg, algorithm)
    prompts, _, _ = run_prompts(cfg)
    per_rank = t.prompts_per_step * t.group_size // (gpus // k)  # a group's samples: every rank of it holds them all
    with phase("build"):
        group = build_worker_group(ActorRolloutRefWorker, config, backend="local", num_workers=1)
        group.init_model()
    worker = group.executor.worker  # the local executor's one worker
    adapter = worker.engine.adapter
    if k > 1:
        for transformer in adapter.sequence_parallel_transformers():
            sequence_parallel.apply_wan(transformer, sequence_parallel.SequenceParallel(None, k, 0))
    if prompts is None:
        prompts = group.default_prompts() or ["a photograph"]
    step = step_prompts(prompts, 0, t.prompts_per_step, t.seed)
    window = build_window(cfg.sampler, t.seed)

    def request():  # rank 0's share of the step's request (the data-parallel split takes contiguous slices)
        return rollout_request(run, algorithm, step, window.masks(0), 0)[:per_rank]

    with phase("text_encode"):
        if hasattr(adapter, "cache_prompts"):
            adapter.cache_prompts(sorted({p if isinstance(p, str) else p.prompt for p in request()["prompts"].tolist()}))
    group.set_loss_fn(algorithm.objective())
    algorithm.setup(group)
    with memo(adapter):
        with phase("rollout"):
            traj = group.generate_sequences(request())  # noqa: F841 (held through the phase: its memory is the peak traced)
        trained = _trained_steps(traj)
        # the update of one micro-batch of one trained step: the peak of every other is the same
        micro = int(cfg.algorithm.micro_batch_size or per_rank)
        take = min(per_rank, max(micro, 2))  # one micro-batch (part of a group: its rewards are made up anyway)
        small = _one_step(traj[:take])
        rewards = torch.linspace(0.0, 1.0, take)  # spread, so that group advantages are not all zero
        scores = {"rewards": rewards, **{f"reward/{name}": rewards for name in run.reward_weights}}
        with phase("train"):
            algorithm.update(group, small, scores, 0)
        del traj, small
        with phase("rollout_after_update"):
            traj = group.generate_sequences(request())  # noqa: F841 (held through the phase: its memory is the peak traced)
    blocks = adapter.fsdp_blocks()
    return {"categories": _categories(worker, bool(cfg.eval.ema)), "block_bytes": max((_param_bytes(b) for b in blocks), default=0), "per_rank": per_rank,
            "trained_steps": trained, "trained_samples": take, "levels": max(levels.values(), default=1)}


@contextlib.contextmanager
def _batched_noise():
    """Per-sample noise (``randn_per_sample`` with a generator per row, as rollouts and objectives draw it) as one fake
    draw of the batch's shape while tracing: the same bytes on the GPU (a run draws the rows on host generators and
    copies the stacked batch over), without a thousand dispatches per denoising step. Rows of at most
    :data:`diffrl.engine.trace.SMALL_RANDOM` elements are drawn as the run draws them."""
    original = sde.randn_per_sample

    def draw(shape, generator, device, dtype=torch.float32):
        if isinstance(generator, (list, tuple)) and len(generator) == shape[0] and math.prod(shape[1:]) > tracing.SMALL_RANDOM:
            return torch.randn(tuple(shape), device=device, dtype=dtype)
        return original(shape, generator, device, dtype)

    modules = (sde, rollout, objectives)
    for module in modules:
        module.randn_per_sample = draw
    try:
        yield
    finally:
        for module in modules:
            module.randn_per_sample = original


@contextlib.contextmanager
def _quiet():
    """Silence what building models on fake tensors prints on every plan: diffusers' "modules that should be kept in
    float32: []" of a ``.to(dtype)``, transformers' notices and torch's FakeTensor / meta-device warnings."""
    loggers = [logging.getLogger(name) for name in ("diffusers", "transformers", "torch._subclasses.fake_tensor")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@contextlib.contextmanager
def _eager_loading():
    """diffusers' ``from_pretrained`` of a local folder builds on the meta device and moves each weight in through
    accelerate, which cannot make a fake parameter; building first and loading the state dict works on fake
    tensors (``low_cpu_mem_usage=False`` as the default while planning)."""
    previous = getattr(modeling_utils, "_LOW_CPU_MEM_USAGE_DEFAULT", None)
    modeling_utils._LOW_CPU_MEM_USAGE_DEFAULT = False
    try:
        yield
    finally:
        modeling_utils._LOW_CPU_MEM_USAGE_DEFAULT = previous


@contextlib.contextmanager
def _local_collectives():
    """torch.distributed's all-to-all and all-gather as local copies into the buffers the caller allocated, so that one
    rank of a sequence-parallel group is traced without a process group: the shapes, bytes and FLOPs around them are the
    rank's (the bytes they move between GPUs are time, not memory)."""
    saved = dist.all_to_all_single, dist.all_gather

    def all_to_all_single(output, input, *args, **kwargs):
        output.copy_(input)

    def all_gather(outputs, input, *args, **kwargs):
        for out in outputs:
            out.copy_(input)

    dist.all_to_all_single, dist.all_gather = all_to_all_single, all_gather
    try:
        yield
    finally:
        dist.all_to_all_single, dist.all_gather = saved


def trace_recipe(cfg, gpus: int, *, allocation_unit: int = tracing.ALLOCATION_UNIT, per_block: bool | None = None) -> Trace:
    """Step one rank of the recipe on fake tensors (:func:`step_recipe` under :func:`diffrl.engine.trace.shape_trace`).

    At a published shape with ``per_block`` the transformer is traced with two blocks of each kind
    (``Shape.block_kinds``), then with one more of each kind in turn, and every byte and FLOP count is
    extrapolated linearly to the published depth: a block's weights, LoRA, gradients, optimizer states, saved
    activations and FLOPs add up per block, and the transient of one block's forward or recompute does not grow with
    the depth (``tests/test_plan.py`` compares it with the full trace). Two, not one: with a single block the training
    peak falls elsewhere (Wan2.1-14B's grows by 1.11 GiB from the first block to the second, then 0.85 GiB a block).
    FLUX.1's 57 blocks are then 3 traces of 4-5. ``per_block=None`` does so when the traces hold under half the
    blocks of the whole model (not for SD3.5-Medium: its 24 blocks of three kinds would be 3 traces of 5-6, each
    building the text encoders again; 15 s whole against 18 s per block); True always, False never."""
    start = time.perf_counter()
    name = str((cfg.model.options or {}).get("shape", "tiny"))
    built = PARENT_SHAPES.get(name, name)  # an editing shape builds through its parent's
    spec = SHAPES.get(built) if name not in ("tiny", "local") else None
    kinds = spec.block_kinds() if spec is not None and per_block is not False else {}
    grow = [k for k, n in kinds.items() if n > 2]
    base = {k: min(n, 2) for k, n in kinds.items()}  # from the second block on each adds the same (the first's peak differs)
    traced = sum(base.values()) * (1 + len(grow)) + len(grow)
    if not grow or (per_block is None and 2 * traced > sum(kinds.values())):
        return _trace_once(cfg, gpus, allocation_unit, start)
    with _shape_as(built, spec.with_depth(base)):
        first = _trace_once(cfg, gpus, allocation_unit, start)
    steps = []
    for kind in grow:
        with _shape_as(built, spec.with_depth({**base, kind: base[kind] + 1})):
            steps.append((kinds[kind] - base[kind], _trace_once(cfg, gpus, allocation_unit, start)))
    return _extrapolate(first, steps, time.perf_counter() - start)


@contextlib.contextmanager
def _shape_as(name: str, shape):
    saved = SHAPES[name]
    SHAPES[name] = shape
    try:
        yield
    finally:
        SHAPES[name] = saved


def _extrapolate(first: Trace, steps: list, trace_s: float) -> Trace:
    """``first`` plus ``n ×`` (trace with one more block of a kind − ``first``) for each ``(n, trace)`` of ``steps``."""
    def grow(get):
        return get(first) + sum(n * (get(t) - get(first)) for n, t in steps)

    phases = {name: {k: (round(grow(lambda t: t.phases[name][k])) if k != "trace_s" else v) for k, v in p.items()} for name, p in first.phases.items()}
    categories = {k: round(grow(lambda t: t.categories.get(k, 0))) for k in first.categories}
    return dataclasses.replace(first, phases=phases, categories=categories, rollout_flops=grow(lambda t: t.rollout_flops),
                               train_flops=grow(lambda t: t.train_flops), trace_s=trace_s)


@contextlib.contextmanager
def _optimizer_peaks(trace, out: dict):
    """Record in ``out`` the bytes live when the engine's optimizer step starts and their peak during it, and the peak of
    the forwards and backwards before it: FSDP2 shards what the step creates (states, Adam's temporaries) but not the
    activations, so :func:`per_rank` scales the two parts apart."""
    original = DiffusionEngine._optimizer_step

    def step(self, *args, **kwargs):
        out.setdefault("backward_peak", trace.peak)
        before, trace.peak = trace.peak, trace.current
        out.setdefault("start", trace.current)
        try:
            return original(self, *args, **kwargs)
        finally:
            out["peak"] = max(out.get("peak", 0), trace.peak)
            trace.peak = max(trace.peak, before)

    DiffusionEngine._optimizer_step = step
    try:
        yield
    finally:
        DiffusionEngine._optimizer_step = original


def _trace_once(cfg, gpus: int, allocation_unit: int, start: float) -> Trace:
    optimizer: dict = {}
    with _quiet(), _eager_loading(), _local_collectives(), _batched_noise(), tracing.shape_trace(allocation_unit=allocation_unit) as trace, \
            _optimizer_peaks(trace, optimizer):
        sizes = step_recipe(cfg, gpus, trace.phase, lambda adapter: tracing.memoised_forward(adapter, trace))
    phases = trace.phases
    if optimizer:
        phases["train"] = {**phases["train"], "backward_peak_bytes": optimizer["backward_peak"], "optimizer_start_bytes": optimizer["start"],
                           "optimizer_peak_bytes": optimizer["peak"]}
    rewards, uncounted = reward_bytes(cfg)
    sizes["categories"]["reward_models"] = sum(rewards.values())
    # the traced update ran `trained_samples` trajectories on one trained step; a step runs per_rank on every trained step
    train_flops = phases["train"]["flops"] / sizes["trained_samples"] * sizes["per_rank"] * max(1, sizes["trained_steps"]) * sizes["levels"]
    return Trace(
        phases=dict(phases), categories=sizes["categories"], rollout_flops=phases["rollout"]["flops"], train_flops=train_flops,
        block_bytes=sizes["block_bytes"], images_per_rank=sizes["per_rank"], trace_s=time.perf_counter() - start,
        rewards=rewards, not_counted=uncounted,
    )


def _trained_steps(traj) -> int:
    mask = traj["sde_mask"]
    return int(mask[0].sum()) if mask.ndim == 2 else int(mask.sum())


def _one_step(traj):
    """``traj`` with only its first trained step kept (its other masks unchanged); as it is when no step is
    trained (objectives on the clean samples: NFT, AWM, DGPO, whose levels are inside the traced update)."""
    if _trained_steps(traj) == 0:
        return traj
    traj = traj.clone(recurse=False)
    mask = traj["sde_mask"].clone()
    first = int(mask[0].nonzero()[0]) if mask.ndim == 2 else int(mask.nonzero()[0])
    mask[..., :] = False
    mask[..., first] = True
    traj["sde_mask"] = mask
    return traj


def per_rank(tr: Trace, cfg, gpus: int) -> dict:
    """Per-rank peak bytes by phase and by category, FSDP2 sharding over ``gpus`` applied to the traced
    single-rank numbers: sharded state ``1/N`` (on the host with ``model.param_offload``) plus two whole
    blocks gathered for prefetch. The optimizer's states exist from the first update on, the gradients during
    it: their share is moved only in the phases that hold them."""
    c = tr.categories
    sharded = bool(cfg.model.fsdp) and gpus > 1
    keep = (0.0 if cfg.model.param_offload else 1.0 / gpus) if sharded else 1.0
    static = tuple(k for k in ("weights", "trainable", "master_weights", "other_adapters", "reference_copy") if k in c)
    resident = {k: c[k] * keep for k in (*static, "optimizer", "gradients")}
    resident["fsdp_gathered_blocks"] = 2 * tr.block_bytes if sharded else 0
    resident["vae"], resident["text_encoders"] = c["vae"], c["text_encoders"]
    resident["ema_adapter"] = c.get("ema_adapter", 0)  # made at the first optimizer step (LoRA: replicated, not sharded)
    resident["reward_models"] = c.get("reward_models", 0)  # built by the trainer's process beside rank 0's policy
    shift = sum(c[k] for k in static) * (keep - 1.0) + resident["fsdp_gathered_blocks"] + resident["reward_models"]
    phases = {}
    for name, p in tr.phases.items():
        if name == "build":
            continue
        moved = shift
        if name == "train" and "optimizer_peak_bytes" in p:
            # forward and backward of a later step, beside the optimizer's states (sharded); the step itself: what it
            # found shifted like the static state, what it made (states, temporaries) sharded
            backward = p["backward_peak_bytes"] + moved + c["gradients"] * (keep - 1.0) + c["optimizer"] * keep
            made = p["optimizer_peak_bytes"] - p["optimizer_start_bytes"]
            step = p["optimizer_start_bytes"] + moved + c["gradients"] * (keep - 1.0) + made * keep
            phases[name] = max(0.0, backward, step)
            continue
        if name == "train":
            moved += c["gradients"] * (keep - 1.0)
        if name == "rollout_after_update":
            moved += c["optimizer"] * (keep - 1.0) + resident["ema_adapter"]
        phases[name] = max(0.0, p["peak_bytes"] + moved)
    peak_phase = max(phases, key=phases.get)
    return {"phases": phases, "peak_bytes": phases[peak_phase], "peak_phase": peak_phase, "resident": resident, "sharded": sharded}


def _state_bytes(tr: Trace, cfg, gpus: int) -> float:
    """Bytes per rank that no micro-batch change lowers: the (sharded) weights, adapters, optimizer states, VAE
    and text encoders."""
    r = per_rank(tr, cfg, gpus)["resident"]
    return sum(v for k, v in r.items() if k != "gradients")  # (gradients live only during the update)


def mfu_for(shape: str, compiled: bool, mfu: float | None) -> tuple[float, float, str]:
    """``(rollout MFU, training MFU, source)``: ``--mfu``, else the H200 measurement of the shape (or its
    text-to-image parent's) in the recipe's compile mode, else the other mode's, else an assumption."""
    if mfu is not None:
        if not 0 < mfu <= 1:
            raise PlanError(f"--mfu must be in (0, 1], got {mfu}")
        return mfu, mfu, "--mfu"
    base = parent_shape_name(shape)
    for key in ((base, compiled), (base, not compiled)):
        if key in MEASURED_MFU:
            r, t, source = MEASURED_MFU[key]
            label = f"measured on H200: benchmarks/results/{source}" + ("" if key[0] == shape else f" ({base}'s)")
            if key[1] != compiled:
                label += f" (model.compile={str(compiled).lower()} not measured: the other mode's)"
            return r, t, label
    return ASSUMED_MFU, ASSUMED_MFU, f"assumed {ASSUMED_MFU} (no measurement of {shape}; pass --mfu)"


def estimate(tr: Trace, cfg, shape: str, gpus: int, peak_flops: float, mfu: float | None) -> dict:
    """FLOPs of one RL step per rank and the seconds / images/s they take at the MFU of :func:`mfu_for`."""
    mfu_r, mfu_t, source = mfu_for(shape, bool(cfg.model.compile), mfu)
    rollout_s = tr.rollout_flops / (mfu_r * peak_flops)
    train_s = tr.train_flops / (mfu_t * peak_flops)
    step_s = rollout_s + train_s
    images = tr.images_per_rank * (gpus // int(cfg.model.sequence_parallel))  # the data-parallel groups' samples
    return {"rollout_flops": tr.rollout_flops, "train_flops": tr.train_flops, "rollout_mfu": mfu_r, "train_mfu": mfu_t, "mfu_source": source,
            "rollout_s": rollout_s, "train_s": train_s, "step_s": step_s, "images_per_s": images / step_s, "images_per_step": images}


NOT_COUNTED = (
    "the reward models' activations while scoring",
    "evaluations (eval.every: their rewards, judges and samples)",
    "CUDA's context (about 0.5 GiB) and workspaces, and the caching allocator's fragmentation "
    "(measured peaks ran 4-11 % above the plan: benchmarks/RESULTS.md)",
)
TRAIN_PHASES = ("train",)
ROLLOUT_PHASES = ("rollout", "rollout_after_update")


def candidates(cfg, gpus: int, peak_phase: str = "rollout", text_encoders: bool = True) -> list[tuple[str, list[str], int, tuple]]:
    """Changes that lower the peak, cheapest first: ``(what, overrides, gpus, phases it lowers)`` (an empty
    tuple: every phase). Dropping the text encoders comes first (free once the prompts are cached), then the
    micro-batches and checkpointing of the phase that peaks (``peak_phase``), then the other phase's, CFG as two
    forwards, everything together, ``param_offload`` of the FSDP2 shards, and more GPUs (FSDP2, then with offload)."""
    out = []
    t, a, m = cfg.trainer, cfg.algorithm, cfg.model
    k = int(m.sequence_parallel)
    per_rank = t.prompts_per_step * t.group_size // (gpus // k)
    options = dict(m.options or {})
    if text_encoders and not options.get("drop_text_encoders", False):
        out.append(("drop the text encoders after caching the prompts", ["+model.options.drop_text_encoders=true"], gpus, ()))
    train, rollout = [], []
    micro = int(a.micro_batch_size or per_rank)
    for _ in range(3):  # halving up to three times (then ÷8)
        if micro > 1:
            micro //= 2
            train.append((f"training micro-batch {micro}", [f"algorithm.micro_batch_size={micro}"], gpus, TRAIN_PHASES))
    if not m.activation_checkpointing or int(m.checkpoint_every) > 1:
        train.append(("activation checkpointing of every block", ["model.activation_checkpointing=true", "model.checkpoint_every=1"], gpus, TRAIN_PHASES))
    chunk = int(cfg.sampler.micro_batch_size or per_rank)
    for _ in range(3):
        if chunk > 1:
            chunk = max(1, chunk // (2 if chunk <= 64 else 4))
            rollout.append((f"rollout micro-batch {chunk}", [f"sampler.micro_batch_size={chunk}"], gpus, ROLLOUT_PHASES))
    out += (train + rollout) if peak_phase in TRAIN_PHASES else (rollout + train)
    if options.get("cfg_mode") == "batched":
        out.append(("CFG as two forwards (cfg_mode=split)", ["+model.options.cfg_mode=split"], gpus, ()))
    if int(cfg.distributed.rollout_replicas):
        out.append(("rollouts on the actor ranks (no replicas)", ["distributed.rollout_replicas=0", "distributed.max_staleness=0"], gpus, ()))
    memory = [c for c in out if c[3]]  # every knob of this rank count at its smallest, together
    if len({c[3] for c in memory}) > 1:
        last = {}
        for c in memory:
            last[c[1][0].split("=")[0]] = c
        out.append(("together: " + ", ".join(c[0] for c in last.values()), [o for c in last.values() for o in c[1]], gpus, ()))
    if gpus > 1 and m.fsdp and not m.param_offload:
        out.append(("FSDP2 shards on the host (param_offload)", ["model.param_offload=true"], gpus, ()))
    batch, n, more = t.prompts_per_step * t.group_size, gpus * 2, []
    while n <= 64:
        if batch % (n // k) == 0 and (a.mini_batch_size or batch) % (n // k) == 0:
            out.append((f"{n} GPUs (FSDP2)", ["model.fsdp=true"], n, ()))
            if not m.param_offload:
                more.append((f"{n} GPUs (FSDP2, shards on the host)", ["model.fsdp=true", "model.param_offload=true"], n, ()))
        n *= 2
    return out + more


def plan(overrides: list[str], *, gpus: int = 1, gpu: str = "h100", gpu_memory_gb: float | None = None, mfu: float | None = None,
         peak_tflops: float | None = None, recommend: bool = True) -> dict:
    """Plan the recipe of ``overrides`` on ``gpus`` GPUs of kind ``gpu`` (see the module docstring)."""
    name, budget_gb, peak = gpu_spec(gpu, gpu_memory_gb)
    if mfu is not None and not 0 < mfu <= 1:  # before the trace (seconds to minutes), as every bad input
        raise PlanError(f"--mfu must be in (0, 1], got {mfu}")
    if peak_tflops is not None:
        if not float(peak_tflops) > 0:
            raise PlanError(f"--peak-tflops must be > 0, got {peak_tflops}")
        peak = float(peak_tflops) * 1e12
    cfg, shape = plan_config(overrides, gpus)
    tr = trace_recipe(cfg, gpus)
    rank = per_rank(tr, cfg, gpus)
    result = {
        "recipe": cfg.experiment, "overrides": list(overrides), "shape": shape, "gpus": gpus, "gpu": name, "gpu_memory_gib": budget_gb,
        "sequence_parallel": int(cfg.model.sequence_parallel),
        "peak_gib": rank["peak_bytes"] / GiB, "peak_phase": rank["peak_phase"], "phases_gib": {k: v / GiB for k, v in rank["phases"].items()},
        "resident_gib": {k: v / GiB for k, v in rank["resident"].items()}, "fsdp_sharded": rank["sharded"],
        "fits": rank["peak_bytes"] / GiB <= budget_gb, "trace_seconds": tr.trace_s, **estimate(tr, cfg, shape, gpus, peak, mfu),
        "rewards_gib": {k: v / GiB for k, v in tr.rewards.items()},
        "not_counted": [*tr.not_counted, *NOT_COUNTED],
    }
    if recommend and not result["fits"]:
        result["recommendation"] = None
        tried = []
        base = list(overrides)
        for what, extra, n, lowers in candidates(cfg, gpus, rank["peak_phase"], tr.categories["text_encoders"] > 0):
            state = _state_bytes(tr, cfg, n) / GiB
            if state > budget_gb:  # no re-plan: the sharded state alone does not fit
                tried.append({"change": what, "gpus": n, "peak_gib": state, "note": "its weights and optimizer state alone exceed the budget"})
                continue
            if "drop_text_encoders" in extra[0] and (rank["peak_bytes"] - tr.categories["text_encoders"]) / GiB > budget_gb:
                tried.append({"change": what, "gpus": n, "peak_gib": (rank["peak_bytes"] - tr.categories["text_encoders"]) / GiB,
                              "note": "it frees only the text encoders' weights"})
                continue
            untouched = {k: v / GiB for k, v in rank["phases"].items() if lowers and k not in lowers}
            if untouched and max(untouched.values()) > budget_gb:  # no re-plan: a phase it does not change is over
                worst = max(untouched, key=untouched.get)
                tried.append({"change": what, "gpus": n, "peak_gib": untouched[worst], "note": f"the {worst} phase, which it does not change, needs more"})
                continue
            if any(o in base for o in extra) and n == gpus:
                continue  # already set
            try:
                sub = plan([*base, *extra], gpus=n, gpu=gpu, gpu_memory_gb=budget_gb, mfu=mfu, peak_tflops=peak_tflops, recommend=False)
            except ValueError as exc:
                tried.append({"change": what, "error": str(exc)})
                continue
            tried.append({"change": what, "overrides": extra, "gpus": n, "peak_gib": sub["peak_gib"], "step_s": sub["step_s"]})
            if sub["fits"]:
                result["recommendation"] = tried[-1]
                break
        result["tried"] = tried
    return result


def _flops(x: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if x >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x / 1e6:.1f} MFLOP"


def report(r: dict) -> str:
    """The plan as text."""
    lines = [
        f"diffrl plan: {r['recipe']} at shape {r['shape']} on {r['gpus']} × {r['gpu']} ({r['gpu_memory_gib']:.1f} GiB each)"
        + (f", each sample's tokens split over {r['sequence_parallel']} of them" if r["sequence_parallel"] > 1 else ""),
        f"  peak per GPU {r['peak_gib']:.2f} GiB in {r['peak_phase']} → {'fits' if r['fits'] else 'DOES NOT FIT'}"
        + (" (FSDP2-sharded)" if r["fsdp_sharded"] else ""),
        "  by phase: " + ", ".join(f"{k} {v:.2f}" for k, v in r["phases_gib"].items()) + " GiB",
        "  resident: " + ", ".join(f"{k} {v:.2f}" for k, v in r["resident_gib"].items() if v) + " GiB; the rest of a phase's peak is activations and rollout buffers",
        f"  one RL step: {r['images_per_step']} images, rollout {_flops(r['rollout_flops'])} + update {_flops(r['train_flops'])} per GPU",
        f"  at MFU {r['rollout_mfu']:.2f} (rollout) / {r['train_mfu']:.2f} (update) [{r['mfu_source']}]: "
        f"{r['step_s']:.3g} s per step ({r['rollout_s']:.3g} + {r['train_s']:.3g}), {r['images_per_s']:.3g} images/s",
        *(f"  reward model {k} on GPU {v:.2f} GiB (rank 0's, built by the trainer's process)" for k, v in r.get("rewards_gib", {}).items() if v),
        *(f"  not counted: {line}" for line in r["not_counted"]),
        f"  traced in {r['trace_seconds']:.0f} s",
    ]
    if "recommendation" in r:
        rec = r["recommendation"]
        if rec:
            more = "" if rec["gpus"] == r["gpus"] else f" --gpus {rec['gpus']}"
            lines.append(f"  cheapest change that fits: {rec['change']} ({' '.join(rec['overrides'])}{more}) → {rec['peak_gib']:.2f} GiB, "
                         f"{rec['step_s']:.3g} s per step")
        else:
            lines.append("  nothing tried fits: " + "; ".join(f"{t['change']} {t.get('peak_gib', float('nan')):.1f} GiB" for t in r.get("tried", [])))
        lines.append(f"  next step: {next_step(r)}")
    return "\n".join(lines)


def next_step(r: dict) -> str:
    """The one thing to do next, as the exact command line: the recommended overrides added to the plan's, or, when
    nothing tried fits, the change that came closest on a GPU with the memory it needs."""
    base = " ".join(r["overrides"])
    rec = r.get("recommendation")
    if rec:
        gpus = rec["gpus"]
        return f"add {' '.join(rec['overrides'])}" + ("" if gpus == r["gpus"] else f" and run on {gpus} GPUs") + \
            f": diffrl plan {base} {' '.join(rec['overrides'])} --gpus {gpus} --gpu {r['gpu']}".rstrip()
    tried = [t for t in r.get("tried", []) if "peak_gib" in t]
    if not tried:
        return "nothing could be tried: lower trainer.prompts_per_step or sampler.height/width"
    best = min(tried, key=lambda t: t["peak_gib"])
    extra = " ".join(best.get("overrides", []))
    bigger = sorted((mem, name) for name, (mem, _) in GPUS.items() if mem >= best["peak_gib"])
    where = f"--gpu {bigger[0][1]}" if bigger else f"--gpus {2 * best['gpus']}"
    return (f"closest: {best['change']} at {best['peak_gib']:.1f} GiB per GPU; try diffrl plan {base} {extra} --gpus {best['gpus']} {where}"
            if extra else f"closest: {best['change']} at {best['peak_gib']:.1f} GiB per GPU; try a GPU with more memory ({where})")


def gpu_kind(device_name: str) -> str:
    """The :data:`GPUS` kind of a CUDA device name (``NVIDIA H100 80GB HBM3`` → ``h100``; unknown → ``h100``,
    whose peak is the dense bf16 rate of the current generation)."""
    name = device_name.lower().replace(" ", "")
    for kind in sorted(GPUS, key=len, reverse=True):
        if kind.split("-")[0] in name:
            return kind
    return "h100"


def preflight(overrides: list[str], cfg, *, memory_gib: float | None = None, device_name: str | None = None) -> str | None:
    """``diffrl train``'s check before a GPU run (``trainer.plan_check``): the warning to print when the plan's
    peak exceeds the device's memory (``memory_gib``, default CUDA device 0's), else None. A recipe the planner
    cannot plan is not refused either: the warning says so."""
    if not cfg.trainer.plan_check or not str(cfg.model.device).startswith("cuda"):
        return None
    if memory_gib is None:
        if not torch.cuda.is_available():
            return None
        props = torch.cuda.get_device_properties(0)
        memory_gib, device_name = props.total_memory / GiB, props.name
    try:
        r = plan(overrides, gpus=int(cfg.distributed.num_workers), gpu=gpu_kind(device_name or ""), gpu_memory_gb=memory_gib)
    except ValueError as exc:
        return f"diffrl: warning: the plan check could not plan this recipe ({exc}); training anyway (trainer.plan_check=false skips the check)"
    if r["fits"]:
        return None
    rec = r.get("recommendation")
    fix = f"; the cheapest change that fits: {rec['change']} ({' '.join(rec['overrides'])})" if rec else "; no single change tried fits"
    return (f"diffrl: warning: diffrl plan puts this run's peak at {r['peak_gib']:.1f} GiB per GPU ({r['peak_phase']}), above the device's "
            f"{memory_gib:.1f} GiB{fix}; training anyway (trainer.plan_check=false skips the check)")


def add_parser(sub) -> dict:
    p = sub.add_parser("plan", help="will a recipe fit on my GPUs, and how long will a step take (CPU only)",
                       description="plan a recipe's memory per GPU and step time without a GPU; overrides as for diffrl train")
    p.add_argument("overrides", nargs="*", help="hydra overrides, e.g. experiment=qwen_image_ocr_lora_flow_grpo")
    p.add_argument("--gpus", type=int, default=1, help="GPUs (distributed.num_workers; FSDP2 with model.fsdp)")
    p.add_argument("--gpu", default="h100", help=f"GPU kind: {', '.join(sorted(GPUS))}")
    p.add_argument("--gpu-memory-gb", type=float, default=None, help="memory per GPU in GiB (default: the kind's)")
    p.add_argument("--mfu", type=float, default=None, help="MFU to estimate time with (default: the H200 measurement of the model)")
    p.add_argument("--peak-tflops", type=float, default=None, help="bf16 peak per GPU (default: the kind's datasheet)")
    p.add_argument("--json", default=None, help="also write the plan as JSON here")
    return {"plan": run_plan}


def run_plan(args) -> int:
    import json

    r = plan(args.overrides, gpus=args.gpus, gpu=args.gpu, gpu_memory_gb=args.gpu_memory_gb, mfu=args.mfu, peak_tflops=args.peak_tflops)
    print(report(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


__all__ = ["GPUS", "gpu_kind", "preflight", "MEASURED_MFU", "PlanError", "Trace", "add_parser", "estimate", "gpu_spec", "mfu_for", "per_rank", "plan", "plan_config", "report",
           "shape_of", "trace_recipe", "next_step", "candidates"]
