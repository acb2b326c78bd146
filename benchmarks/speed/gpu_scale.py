"""Real model scale on one GPU (issue 16): fit, speed, executed MFU and log-prob parity of Flow-GRPO LoRA at the
published shapes of Qwen-Image 20 B, FLUX.1-dev 12 B, SD3.5-Large 8 B, SD3.5-Medium and Wan2.1 14 B.

Each model is built by its family at ``shape=<name>`` (``pipelines.shapes``): the published transformer and VAE
configs with random bf16 weights, allocated directly on the GPU; 2-layer text encoders of the real widths encode
the prompts once (the embeddings are cached and the encoders dropped). One run measures, per variant (``eager``:
``model.compile`` off; ``compiled``: the same with ``torch.compile``, ``--scope`` whole model or per block):

* **rollout**: ``sample_trajectories`` (K steps, CFG with the family's ``cfg_mode``, SDE window ODE elsewhere,
  VAE decode in chunks) — images/s, executed MFU, peak memory;
* **training**: ``DiffusionEngine.train_batch`` with the Flow-GRPO clipped loss on the window's steps,
  micro-batches, activation checkpointing per block (``--ckpt-every``) — seconds, executed MFU, peak memory;
* **end to end**: rollout → cheap reward (brightness; the reward is excluded and stated) → group advantages →
  update, images/s;
* **parity**: max |log p(training) − log p(rollout)| of every trained step on the first update.

Executed FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode`` on this GPU, eager, on one CFG
rollout forward and on one training micro-batch (forward + backward with the recompute of checkpointed blocks,
frozen base weights computing no weight gradients), so the MFU is of FLOPs actually run; the analytic count of
``diffrl.engine.flops`` (which charges a full backward) is kept beside it, labelled ``counted``.

    # the verl-omni Flow-GRPO LoRA recipe shape on Qwen-Image (512 px, 10 steps, true CFG 4, window 2 in [0, 5),
    # LoRA r64/α128 on attention + MLP, 16 images per prompt, micro-batch 16), eager and compiled side by side
    python3 benchmarks/speed/gpu_scale.py --recipe verl_omni_qwen_lora --out $OUT/qwen.json
    python3 benchmarks/speed/gpu_scale.py --shape flux_dev --variants compiled --out $OUT/flux.json
    # CPU smoke test of every code path (tiny shapes)
    PYTHONPATH=. python benchmarks/speed/gpu_scale.py --shape tiny_sd3 --device cpu --out /tmp/scale.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import platform
import re
import sys
import time
import traceback
from pathlib import Path

import diffusers
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpu_speed import git_commit, logp_check, matmul_peak, median, randomise_lora, sdpa_priority, sync, timed  # noqa: E402

from diffrl.algorithms.advantages import group_advantages  # noqa: E402
from diffrl.algorithms.losses import make_step_loss  # noqa: E402
from diffrl.config import LoraConfig, ModelConfig, OptimConfig, SamplerConfig  # noqa: E402
from diffrl.engine.engine import DiffusionEngine  # noqa: E402
from diffrl.rollout_driver import sample_while_scoring  # noqa: E402
from diffrl.sampling.rollout import sample_trajectories  # noqa: E402
from diffrl.sampling.seeding import Stream, derive  # noqa: E402
from pipelines import build_adapter  # noqa: E402
from pipelines.base import known_families  # noqa: E402
from pipelines.shapes import SHAPES  # noqa: E402
from rewards.base import build_reward, score  # noqa: E402

# per shape: family, image size, CFG scale, LoRA targets beyond attention; tiny_* are CPU smoke tests
QWEN_MLP = ["img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"]
FLUX_MLP = ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out"]
SETTINGS = {
    "qwen_image": dict(family="qwen_image", height=512, width=512, cfg=4.0, mlp=QWEN_MLP),
    "flux_dev": dict(family="flux", height=512, width=512, cfg=3.5, mlp=FLUX_MLP),
    # editing models (issue 38 item 3): a source image per prompt enters as context tokens (Qwen-Image-Edit's text
    # encoder reads it too, so its prompts are encoded in the rollout, not cached); Kontext's distilled guidance 2.5
    "qwen_image_edit": dict(family="qwen_image_edit", height=512, width=512, cfg=4.0, mlp=QWEN_MLP, edit=True),
    "flux_kontext": dict(family="flux_kontext", height=512, width=512, cfg=2.5, mlp=FLUX_MLP, edit=True),
    "sd35_large": dict(family="sd3", height=512, width=512, cfg=4.5, mlp=["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]),
    "sd35_medium": dict(family="sd3", height=512, width=512, cfg=4.5, mlp=["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]),
    "wan21_14b": dict(family="wan", height=480, width=832, frames=33, cfg=5.0, mlp=["ffn.net.0.proj", "ffn.net.2"]),
    "wan21_1_3b": dict(family="wan", height=480, width=832, frames=33, cfg=5.0, mlp=["ffn.net.0.proj", "ffn.net.2"]),
    "tiny_sd3": dict(family="sd3", shape="tiny", height=32, width=32, cfg=4.5, mlp=["ff.net.0.proj", "ff.net.2"]),
    "tiny_flux": dict(family="flux", shape="tiny", height=32, width=32, cfg=3.5, mlp=["ff.net.0.proj", "ff.net.2"]),
    "tiny_qwen_image": dict(family="qwen_image", shape="tiny", height=32, width=32, cfg=4.0, mlp=QWEN_MLP),
    "tiny_qwen_image_edit": dict(family="qwen_image_edit", shape="tiny", height=32, width=32, cfg=4.0, mlp=QWEN_MLP, edit=True),
    "tiny_flux_kontext": dict(family="flux_kontext", shape="tiny", height=32, width=32, cfg=2.5, mlp=["ff.net.0.proj", "ff.net.2"], edit=True),
    "tiny_wan": dict(family="wan", shape="tiny", height=32, width=32, frames=5, cfg=5.0, mlp=["ffn.net.0.proj", "ffn.net.2"]),
}
# verl-omni examples/flowgrpo_trainer/qwen_image/run_qwen_image_ocr_lora.sh
RECIPES = {
    "verl_omni_qwen_lora": dict(shape="qwen_image", steps=10, cfg=4.0, window=2, window_range=(0, 5), rank=64, alpha=128.0, mlp=True,
                                group=16, micro_batch=16, batch=32, n_text=128),
}


def cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def gb(x: float) -> float:
    return round(x / 2**30, 2)


class Memory:
    """Peak and current allocated memory per phase (CUDA; None on a CPU)."""

    def __init__(self, device):
        self.on = cuda(device)
        self.phases: dict[str, dict] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.on:
            sync("cuda")
            torch.cuda.reset_peak_memory_stats()
        yield
        if self.on:
            sync("cuda")
            self.phases[name] = {"peak_gb": gb(torch.cuda.max_memory_allocated()), "after_gb": gb(torch.cuda.memory_allocated())}


def prompts_of_length(adapter, n: int, n_text: int | None) -> list[str]:
    """``n`` distinct prompts; for Qwen-Image (valid tokens only) each encodes to exactly ``n_text`` valid tokens
    (the random-shape tokenizer spells words outside its vocabulary one character a token, up to 100 characters
    a word, so the prompt is built from 8-character words)."""
    base = [f"prompt {i} a sign that reads {chr(65 + i % 26)}" for i in range(n)]
    if n_text is None or type(adapter).__name__ != "QwenImageAdapter":
        return base
    tok = adapter.tokenizers["tokenizer"]
    out = []
    for i in range(n):
        chars = f"p{i}" + "x" * max(0, n_text)
        for _ in range(8):
            prompt = " ".join(chars[j : j + 8] for j in range(0, len(chars), 8))
            valid = len(tok(adapter_template(prompt)).input_ids) - 34
            if valid == n_text:
                break
            chars = chars[: max(1, len(chars) + n_text - valid)]
        else:
            raise ValueError(f"could not build a prompt of {n_text} tokens (got {valid})")
        out.append(prompt)
    return out


def adapter_template(prompt: str) -> str:
    from pipelines.qwen_image.adapter import PROMPT_TEMPLATE

    return PROMPT_TEMPLATE.format(prompt)


def window_mask(k: int, window: int, lo: int, hi: int, rng: torch.Generator) -> torch.Tensor:
    """Flow-GRPO-Fast's window: ``window`` SDE steps starting at random in ``[lo, hi − window]``."""
    start = int(torch.randint(lo, max(lo, hi - window) + 1, (1,), generator=rng))
    mask = torch.zeros(k, dtype=torch.bool)
    mask[start : start + window] = True
    return mask


def source_images(n: int, height: int, width: int, seed: int) -> torch.Tensor:
    """``n`` uint8 ``[3, H, W]`` source images for an editing model: smooth random colour fields (a 4×4 grid of random
    colours upsampled bilinearly), one per prompt, fixed by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    grid = torch.rand(n, 3, 4, 4, generator=g)
    return (torch.nn.functional.interpolate(grid, size=(height, width), mode="bilinear", align_corners=False) * 255).round().to(torch.uint8)


def rollout(adapter, settings, prompts, group, seed, window, window_range, micro, reward=None, sources=None, chunks=1):
    """One Flow-GRPO-Fast rollout: groups of ``group`` images per prompt sharing their initial noise, scored by
    ``reward`` (``(name, fn)``: a registered reward, its seconds in ``td["reward_seconds"]``; ``None``: brightness);
    ``sources``: an editing model's uint8 source image per prompt (each group edits its prompt's source).

    ``chunks > 1`` (with a registered reward): the library's overlapped path (``diffrl.rollout_driver.sample_while_scoring``,
    what ``reward.async_chunks`` runs in the trainer): the batch is sampled in ``chunks`` consecutive slices and each
    slice's images are scored on the CPU cores while the GPU samples the next; ``td["reward_wait_seconds"]`` is what
    is left after sampling (the last chunk's scoring). Seeds are per image, so the samples and rewards are the serial
    call's (bit for bit when ``micro`` divides a chunk)."""
    adapter.denoiser.eval()
    rng = torch.Generator().manual_seed(seed)
    mask = window_mask(settings.num_steps, window, *window_range, rng) if window else None
    flat = [p for p in prompts for _ in range(group)]
    seeds = [derive(seed, Stream.ROLLOUT, 0, i, 0) for i in range(len(flat))]
    init = [derive(seed, Stream.ROLLOUT, 0, i // group, 1) for i in range(len(flat))]
    gid = torch.arange(len(flat)) // group
    src = None if sources is None else sources.repeat_interleave(group, dim=0)
    metadata = [{"text": f"SIGN {i // group}"} for i in range(len(flat))]  # the OCR reward reads its targets here (the prompts quote none)

    def sample(lo, hi):
        return sample_trajectories(adapter, flat[lo:hi], settings=settings, seeds=seeds[lo:hi], sde_mask=mask, init_seeds=init[lo:hi],
                                   group_id=gid[lo:hi], micro_batch_size=micro, source_images=None if src is None else src[lo:hi])

    def scored(lo, hi, td):
        start = time.perf_counter()
        name, fn = reward
        return score({name: (fn, 1.0)}, td["images"], flat[lo:hi], metadata[lo:hi])["rewards"].float(), time.perf_counter() - start

    n = len(flat)
    if reward is None:
        td = sample(0, n)
        rewards = td["images"].float().mean(dim=tuple(range(1, td["images"].ndim))) / 255.0  # brightness: a cheap stand-in reward
    elif chunks <= 1:  # the serial loop: sample everything, then score
        td = sample(0, n)
        rewards, seconds = scored(0, n, td)
        td.set_non_tensor("reward_seconds", seconds)
        td.set_non_tensor("reward_wait_seconds", seconds)
    else:
        if n % chunks:
            raise ValueError(f"--reward-chunks {chunks} must divide the batch of {n} images")
        size = n // chunks
        parts, results, _, wait = sample_while_scoring(lambda c: (c, sample(c * size, (c + 1) * size)), chunks,
                                                       lambda part: scored(part[0] * size, (part[0] + 1) * size, part[1]))
        td = torch.cat([part for _, part in parts], dim=0)
        rewards = torch.cat([r for r, _ in results])
        td.set_non_tensor("reward_seconds", sum(seconds for _, seconds in results))
        td.set_non_tensor("reward_wait_seconds", wait)
    td["rewards"] = rewards
    td["advantages"] = group_advantages(rewards, td["group_id"])
    return td


class OpFlops(TorchDispatchMode):
    """FLOPs of every op run inside it, by ``torch.utils.flop_counter``'s per-op formulas (matmuls,
    convolutions, SDPA forward and backward), without ``FlopCounterMode``'s module hooks: those keep each
    module's activations alive, which defeats activation checkpointing and runs out of memory on long
    sequences (Wan at 480×832×33 frames: 14 040 tokens)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out

    def get_total_flops(self) -> int:
        return self.total


KERNEL_KINDS = (
    ("attention", ("sdpa", "flash", "fmha", "attention", "attn")),
    ("convolution", ("conv", "implicit", "fprop", "dgrad", "wgrad", "winograd")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "wgmma", "sm90_")),
    ("fused (triton)", ("triton",)),
    ("elementwise / reduction (aten)", ("elementwise", "vectorized", "reduce", "at::native", "cat", "copy", "fill")),
)
"""kernel-name fragments → the kind a profiled kernel counts under (first match wins; the rest is "other")"""


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def profile_call(fn, device, top: int = 25) -> dict:
    """One call of ``fn`` under ``torch.profiler``: wall seconds, GPU kernel seconds by :func:`kernel_kind` (their
    sum against the wall time is how busy the GPU was) and the ``top`` kernels by total time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda(device) else [])
    with profile(activities=activities) as prof:
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        wall = time.perf_counter() - t0
    kernels = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t and str(getattr(e, "device_type", "")).endswith("CUDA"):
            kernels.append((e.key, t / 1e6, e.count))
    kinds: dict[str, float] = {}
    for name, t, _ in kernels:
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + t
    busy = sum(kinds.values())
    kernels.sort(key=lambda k: -k[1])
    return {"wall_s": wall, "kernel_s": busy, "gpu_busy_fraction": busy / wall if wall else None,
            "kinds_s": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
            "top_kernels": [{"name": n[:160], "s": t, "calls": c, "kind": kernel_kind(n)} for n, t, c in kernels[:top]]}


@contextlib.contextmanager
def counted_attention(device):
    """Eager, with SDPA on a backend ``torch.utils.flop_counter`` counts (flash/efficient on CUDA, math on a CPU)."""
    stance = torch.compiler.set_stance("force_eager") if hasattr(torch.compiler, "set_stance") else contextlib.nullcontext()
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH] if cuda(device) else [SDPBackend.MATH]
    with stance, sdpa_kernel(backends):
        yield


def count_flops(engine, adapter, td, cfg, micro: int, train: bool = True) -> dict:
    """FLOPs actually executed (:class:`OpFlops`, eager, SDPA through flash attention so it is counted): one
    rollout step's CFG forward per image, and one trajectory's training step (forward + backward, recompute
    included); the optimizer step is not run."""
    device = adapter.device
    k = int(td["sde_mask"][0].nonzero()[0])
    one = td[:1]
    with counted_attention(device):
        adapter.denoiser.eval()
        fc = OpFlops()
        with fc, torch.no_grad(), engine.rollout_weights():  # the rollout's weights: LoRA fused or not
            adapter.predict(one["latents"][:, k].to(device), one["sigmas"][:, k].to(device), one["cond"].to(device), cfg)
        rollout_step = fc.get_total_flops()
        if not train:
            return {"rollout_step_flops_per_image": float(rollout_step)}
        mb = td[:1].to(device)  # one trajectory: FLOPs are linear in the batch
        adapter.denoiser.train()
        fc = OpFlops()
        with fc:
            out = engine._score_step(adapter, mb, k)
            out.log_prob.float().mean().backward()
        train_step = fc.get_total_flops() / mb.shape[0]
    engine.optimizer.zero_grad(set_to_none=True)
    return {"rollout_step_flops_per_image": float(rollout_step), "train_step_flops_per_trajectory": float(train_step)}


def measure(args, label: str, compile_on: bool, results: dict):
    s = args.settings
    device = args.device
    r = results.setdefault("variants", {}).setdefault(label, {})
    mem = Memory(device)
    r["memory"] = mem.phases
    edit = s.get("edit", False)  # Qwen-Image-Edit's text encoder reads the source image: it stays and runs in the rollout
    kwargs = dict(shape=s.get("shape", args.shape), dtype=args.dtype, device=device, drop_text_encoders=True, decode_chunk=args.decode_chunk, cfg_mode=args.cfg_mode)
    if edit:
        kwargs.pop("drop_text_encoders")
    if s["family"] in ("flux", "flux_kontext"):
        kwargs.pop("cfg_mode")
    if "frames" in s:
        kwargs["num_frames"] = args.frames or s["frames"]
    t0 = time.perf_counter()
    with mem.phase("build"):
        adapter = build_adapter(s["family"], **kwargs)
    r["build_s"] = time.perf_counter() - t0
    r["transformer_params_b"] = sum(p.numel() for p in adapter.denoiser.parameters()) / 1e9
    print(f"[{label}] built {r['transformer_params_b']:.2f} B in {r['build_s']:.1f} s; {mem.phases}", flush=True)
    prompts = prompts_of_length(adapter, args.batch // args.group, args.n_text)
    sources = source_images(len(prompts), s["height"], s["width"], args.seed) if edit else None
    r["source_size"] = [s["height"], s["width"]] if edit else None
    if not edit:
        with mem.phase("text_encode"):
            adapter.cache_prompts(prompts)
    cond = adapter.encode_prompts(prompts[:1], sources[:1].float() / 255.0) if edit else adapter.encode_prompts(prompts[:1])
    r["n_text_tokens"] = int(cond["prompt_embeds_mask"].sum()) if "prompt_embeds_mask" in cond.keys() else int(cond["prompt_embeds"].shape[1])

    targets = list(adapter.lora_target_modules) + (list(s["mlp"]) if args.mlp else [])
    full = "full" in label  # full fine-tuning: every weight trained, fp32 masters of the bf16 weights (diffrl.engine.precision)
    model = ModelConfig(
        lora=LoraConfig(rank=0 if full else args.rank, alpha=args.alpha, target_modules=targets), compile=compile_on, compile_backend=args.compile_backend,
        compile_scope="model" if "whole" in label else args.scope, compile_mode="reduce-overhead" if "graphs" in label else args.mode, compile_cache_dir=args.cache_dir,
        activation_checkpointing=args.ckpt_every > 0, checkpoint_every=max(1, args.ckpt_every),
        fuse_lora_rollout="fuse" in label, compile_vae="novae" not in label,
        rollout_precision="fp8" if "fp8" in label else "model",  # FP8 rollouts (diffrl.engine.fp8); max_abs_dlogp is then |Δ log p| FP8 vs bf16
    )
    settings = SamplerConfig(num_steps=args.steps, kind="flow_sde", noise_level=0.7, guidance_scale=args.cfg, height=s["height"], width=s["width"])
    engine = DiffusionEngine(adapter, model=model, optim=OptimConfig(lr=1e-5), sampler=settings, micro_batch_size=args.micro_batch)
    t1 = time.perf_counter()
    engine.initialize()
    randomise_lora(engine.module, scale=1e-3)
    r["init_s"] = time.perf_counter() - t1
    r["trainable_params_b"] = sum(p.numel() for p in engine.trainable_parameters()) / 1e9
    r["fp32_master_weights"] = engine.master_weights is not None
    print(f"[{label}] {r['n_text_tokens']} text tokens; {'full fine-tuning' if full else 'LoRA attached'} ({r['trainable_params_b'] * 1e3:.0f} M trainable"
          f"{', fp32 masters' if r['fp32_master_weights'] else ''}) in {r['init_s']:.1f} s; {mem.phases}", flush=True)
    loss_fn = make_step_loss("flow_grpo", clip_range=1e-4)
    reward = None if args.reward == "brightness" else (args.reward, build_reward(args.reward))
    r["reward"] = args.reward

    reward_times = []

    def roll(i, chunks=1):
        with torch.no_grad(), engine.rollout_weights():
            td = rollout(adapter, settings, prompts, args.group, args.seed + i, args.window, args.window_range, args.rollout_micro, reward, sources, chunks)
        if reward is not None:
            reward_times.append((td.get_non_tensor("reward_seconds"), td.get_non_tensor("reward_wait_seconds")))
        return td


    t1 = time.perf_counter()
    with mem.phase("rollout_warmup"):
        td = roll(0)
    r["first_rollout_s"] = time.perf_counter() - t1
    trained = int(td["sde_mask"][0].sum())
    if not args.rollout_only:
        t1 = time.perf_counter()
        with mem.phase("train_warmup"):
            r["max_abs_dlogp"], r["dlogp_per_step"] = logp_check(engine, td, loss_fn)
        sync(device)
        r["first_train_s"] = time.perf_counter() - t1
        r["logp_ok"] = r["max_abs_dlogp"] <= args.logp_tol
        print(f"[{label}] built in {r['build_s']:.0f} s ({r['transformer_params_b']:.2f} B); warm-up rollout {r['first_rollout_s']:.1f} s, "
              f"train {r['first_train_s']:.1f} s; max|Δlogp| {r['max_abs_dlogp']:.2e}; memory {mem.phases}", flush=True)
    key = "flops_full" if full else "flops_fused" if "fuse" in label else "flops"  # a fused rollout executes no LoRA matmuls; full FT computes weight gradients
    if key not in results or ("train_step_flops_per_trajectory" not in results[key] and not args.rollout_only):
        results[key] = count_flops(engine, adapter, td, args.cfg, args.micro_batch, train=not args.rollout_only)
        results[key]["analytic_forward_flops_per_image"] = engine_forward_flops(adapter, s, args, r["n_text_tokens"])
        print(f"  executed FLOPs ({key}): {results[key]}", flush=True)
    f = results[key]
    rollout_flops = f["rollout_step_flops_per_image"] * args.steps * args.batch
    peak = args.peak_tflops * 1e12

    with mem.phase("rollout"):
        times = timed(lambda: roll(1), device, args.repeats)
    r["rollout_s"] = median(times)
    r["rollout_images_per_s"] = args.batch / r["rollout_s"]
    r["rollout_mfu_executed"] = rollout_flops / r["rollout_s"] / peak
    print(f"[{label}] rollout {r['rollout_images_per_s']:.2f} img/s (MFU {r['rollout_mfu_executed']:.3f})", flush=True)
    if args.profile:
        r["rollout_profile"] = profile_call(lambda: roll(2), device)
        latents = td["latents"][:, -1].to(device)
        r["decode_s"] = median(timed(lambda: adapter.decode(latents), device, 2))
        p = r["rollout_profile"]
        print(f"[{label}] rollout profile: wall {p['wall_s']:.2f} s, kernels {p['kernel_s']:.2f} s; by kind {p['kinds_s']}; VAE decode of the batch {r['decode_s']:.2f} s", flush=True)
        for k in p["top_kernels"][:15]:
            print(f"    {k['s']:.3f} s  {k['calls']:5d}×  [{k['kind']}] {k['name'][:110]}", flush=True)
    if not args.rollout_only:  # the update, and rollout → update end to end
        train_flops = f["train_step_flops_per_trajectory"] * trained * args.batch
        with mem.phase("train"):
            times = timed(lambda: engine.train_batch(td, loss_fn), device, args.repeats)
        r["train_s"] = median(times)
        r["train_mfu_executed"] = train_flops / r["train_s"] / peak
        fwd = f["analytic_forward_flops_per_image"]
        r["train_mfu_counted"] = (4 if args.cfg > 1 and s["family"] != "flux" else 3) * fwd * trained * args.batch / r["train_s"] / peak
        print(f"[{label}] rollout {r['rollout_images_per_s']:.2f} img/s (MFU {r['rollout_mfu_executed']:.3f}); train {r['train_s']:.2f} s "
              f"(MFU executed {r['train_mfu_executed']:.3f}, counted {r['train_mfu_counted']:.3f})", flush=True)

        if args.e2e_iters:
            with mem.phase("end_to_end"):
                times = timed(lambda i=[1]: (i.__setitem__(0, i[0] + 1), engine.train_batch(roll(100 + i[0]), loss_fn)), device, args.e2e_iters)
            r["e2e_iteration_s"] = median(times)
            r["e2e_images_per_s"] = args.batch / r["e2e_iteration_s"]
            if reward_times:  # the reward's share of an end-to-end iteration
                r["e2e_reward_s"] = median([t for t, _ in reward_times[-args.e2e_iters:]])
            r["e2e_mfu_executed"] = (rollout_flops + train_flops) / r["e2e_iteration_s"] / peak
            print(f"[{label}] end to end {r['e2e_images_per_s']:.3f} images/s (MFU {r['e2e_mfu_executed']:.3f}); memory {mem.phases}", flush=True)
            if reward is not None and args.reward_chunks > 1:
                measure_overlap(args, r, roll, lambda i: engine.train_batch(roll(200 + i, args.reward_chunks), loss_fn), reward_times, rollout_flops + train_flops, peak)
    r["peak_gb"] = max((p["peak_gb"] for p in mem.phases.values()), default=None)
    del engine, adapter, td
    torch._dynamo.reset()
    gc.collect()  # the variant's modules sit in reference cycles: without this the next variant builds beside them (77 GB on 2026-12-05)
    if cuda(device):
        torch.cuda.empty_cache()


def measure_overlap(args, r: dict, roll, iterate, reward_times: list, flops: float, peak: float) -> None:
    """The end-to-end loop with the reward off the critical path (``--reward-chunks C``): each rollout chunk scored on
    the CPU cores while the GPU samples the next (:func:`rollout`), beside the serial loop just measured. First the
    same iteration both ways: the samples, log-probs and rewards must be the serial loop's (``overlap_identical``)."""
    serial, overlapped = roll(300), roll(300, args.reward_chunks)
    same = {key: bool(torch.equal(serial[key], overlapped[key])) for key in ("latents", "log_probs", "rewards", "advantages")}
    r["overlap_identical"] = all(same.values())
    r["overlap_identical_by_key"] = same
    r["overlap_max_abs_reward_diff"] = float((serial["rewards"] - overlapped["rewards"]).abs().max())
    del serial, overlapped
    start = len(reward_times)
    times = timed(lambda i=[0]: (i.__setitem__(0, i[0] + 1), iterate(i[0])), args.device, args.e2e_iters)
    r["e2e_overlap_iteration_s"] = median(times)
    r["e2e_overlap_images_per_s"] = args.batch / r["e2e_overlap_iteration_s"]
    r["e2e_overlap_reward_s"] = median([t for t, _ in reward_times[start:]])
    r["e2e_overlap_reward_wait_s"] = median([w for _, w in reward_times[start:]])
    r["e2e_overlap_mfu_executed"] = flops / r["e2e_overlap_iteration_s"] / peak
    r["reward_chunks"] = args.reward_chunks
    print(f"[overlap] end to end with the reward overlapped ({args.reward_chunks} chunks): {r['e2e_overlap_images_per_s']:.3f} images/s "
          f"(serial {r['e2e_images_per_s']:.3f}); reward {r['e2e_overlap_reward_s']:.2f} s of which {r['e2e_overlap_reward_wait_s']:.2f} s after sampling; "
          f"identical to the serial loop: {r['overlap_identical']} {same}", flush=True)


REFERENCE_PIPELINES = {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline", "qwen_image": "QwenImagePipeline"}
"""family → the diffusers pipeline whose eager ``__call__`` is the reference (issue 16's "eager reference")"""


def reference_pipeline(adapter, family: str):
    """The family's diffusers pipeline around the adapter's transformer and VAE (no LoRA, eager), with its
    scheduler built from the same config; the text encoders are absent (prompts arrive as embeddings)."""
    if family not in REFERENCE_PIPELINES:
        raise ValueError(f"no diffusers reference pipeline for family {family!r}; the reference variant supports {sorted(REFERENCE_PIPELINES)}")
    cls = getattr(diffusers, REFERENCE_PIPELINES[family])
    parts = {name: None for name in inspect.signature(cls.__init__).parameters if name != "self"}
    parts.update(transformer=adapter.denoiser, vae=adapter.vae, scheduler=diffusers.FlowMatchEulerDiscreteScheduler.from_config(adapter.scheduler_config))
    pipe = cls(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference_call(pipe, family: str, cond, group: int, settings, cfg: float, steps: int, seed: int, output_type: str):
    """One eager pipeline call on cached embeddings, each repeated for ``group`` images per prompt (the pipelines
    repeat only the embeddings they compute themselves), with the family's guidance
    (SD3: batched CFG; FLUX: embedded guidance; Qwen-Image: true CFG), then the VAE decode unless
    ``output_type="latent"``."""
    cond = cond.apply(lambda t: t.repeat_interleave(group, dim=0), batch_size=[cond.shape[0] * group])
    kw = dict(prompt_embeds=cond["prompt_embeds"])
    if family == "sd3":
        kw.update(pooled_prompt_embeds=cond["pooled_prompt_embeds"], negative_prompt_embeds=cond["negative_prompt_embeds"],
                  negative_pooled_prompt_embeds=cond["negative_pooled_prompt_embeds"], guidance_scale=cfg)
    elif family == "flux":
        kw.update(pooled_prompt_embeds=cond["pooled_prompt_embeds"], guidance_scale=cfg)
    else:  # Qwen-Image: the cache pads to the longest prompt of the family; the pipeline's own encode_prompt keeps the batch's longest
        for pre in ("", "negative_"):
            n = int(cond[f"{pre}prompt_embeds_mask"].sum(-1).max())
            kw[f"{pre}prompt_embeds"], kw[f"{pre}prompt_embeds_mask"] = cond[f"{pre}prompt_embeds"][:, :n], cond[f"{pre}prompt_embeds_mask"][:, :n]
        kw.update(true_cfg_scale=cfg)
    g = torch.Generator(device=pipe.transformer.device).manual_seed(seed)
    with torch.no_grad():
        return pipe(height=settings["height"], width=settings["width"], num_inference_steps=steps,
                    generator=g, output_type=output_type, return_dict=False, **kw)[0]


def measure_reference(args, label: str, results: dict):
    """The eager diffusers pipeline at the run's shape and batch: images/s of the whole call (denoising loop and
    VAE decode, as a user of the pipeline gets them) and of the loop alone (``output_type="latent"``), executed
    FLOPs of the loop counted on one image."""
    s = args.settings
    device = args.device
    r = results.setdefault("variants", {}).setdefault(label, {})
    mem = Memory(device)
    r["memory"] = mem.phases
    kwargs = dict(shape=s.get("shape", args.shape), dtype=args.dtype, device=device, drop_text_encoders=True)
    if "frames" in s or s.get("edit"):
        raise ValueError(f"the reference variant measures the text-to-image pipelines; shape {args.shape} is {'video' if 'frames' in s else 'an editing model'}")
    with mem.phase("build"):
        adapter = build_adapter(s["family"], **kwargs)
    prompts = prompts_of_length(adapter, args.batch // args.group, args.n_text)
    adapter.cache_prompts(prompts)
    cond = adapter.encode_prompts(prompts).to(device)
    pipe = reference_pipeline(adapter, s["family"])
    call = lambda i, out="pt", c=cond, group=args.group: reference_call(pipe, s["family"], c, group, s, args.cfg, args.steps, args.seed + i, out)  # noqa: E731
    t0 = time.perf_counter()
    with mem.phase("rollout_warmup"):
        images = call(0)
    r["first_rollout_s"] = time.perf_counter() - t0
    r["images_shape"] = list(images.shape)
    if "flops_reference" not in results:
        fc = OpFlops()
        with counted_attention(device), fc:
            call(0, "latent", cond[:1], 1)
        results["flops_reference"] = {"loop_flops_per_image": float(fc.get_total_flops())}
    peak = args.peak_tflops * 1e12
    with mem.phase("rollout"):
        times = timed(lambda: call(1), device, args.repeats)
    r["rollout_s"] = median(times)
    r["rollout_images_per_s"] = args.batch / r["rollout_s"]
    r["rollout_mfu_executed"] = results["flops_reference"]["loop_flops_per_image"] * args.batch / r["rollout_s"] / peak
    times = timed(lambda: call(2, "latent"), device, args.repeats)
    r["loop_s"] = median(times)
    r["loop_images_per_s"] = args.batch / r["loop_s"]
    r["loop_mfu_executed"] = results["flops_reference"]["loop_flops_per_image"] * args.batch / r["loop_s"] / peak
    r["peak_gb"] = max((p["peak_gb"] for p in mem.phases.values()), default=None)
    print(f"[{label}] eager {REFERENCE_PIPELINES[s['family']]}: {r['rollout_images_per_s']:.2f} img/s with the VAE decode "
          f"(MFU {r['rollout_mfu_executed']:.3f}), {r['loop_images_per_s']:.2f} img/s for the denoising loop alone (MFU {r['loop_mfu_executed']:.3f})", flush=True)


def pair_of(label: str) -> str:
    """The pair a variant belongs to: a one-character suffix (``compiled_b`` pairs with ``reference_b`` and
    ``eager_b``), none for the first pair."""
    m = re.search(r"_(\w)$", label)
    return m.group(1) if m else ""


def speedups(results: dict) -> None:
    """Each variant's rollout images/s over the eager diffrl run and over the diffusers reference of its own pair
    (``rollout_speedup_vs_eager``, ``rollout_speedup_vs_reference``), and, per variant kind, those ratios over
    all the pairs (``pairs``: each ratio, their mean)."""
    variants = results.get("variants", {})
    base = lambda label: label[: -2] if pair_of(label) else label  # noqa: E731
    for ref_kind in ("eager", "reference"):
        refs = {pair_of(k): v for k, v in variants.items() if base(k) == ref_kind and v.get("rollout_images_per_s")}
        for label, r in variants.items():
            ref = refs.get(pair_of(label))
            if base(label) != ref_kind and ref and r.get("rollout_images_per_s"):
                r[f"rollout_speedup_vs_{ref_kind}"] = r["rollout_images_per_s"] / ref["rollout_images_per_s"]
    pairs: dict[str, dict] = {}
    for label, r in variants.items():
        for ref_kind in ("eager", "reference"):
            if f"rollout_speedup_vs_{ref_kind}" in r:
                entry = pairs.setdefault(base(label), {}).setdefault(f"vs_{ref_kind}", {"ratios": []})
                entry["ratios"].append(round(r[f"rollout_speedup_vs_{ref_kind}"], 4))
    for kinds in pairs.values():
        for entry in kinds.values():
            entry["mean"] = sum(entry["ratios"]) / len(entry["ratios"])
    if pairs:
        results["pairs"] = pairs


def engine_forward_flops(adapter, s, args, n_text: int) -> float:
    """The family's analytic forward FLOPs (``pipelines.flops``) at this run's prompt length."""
    adapter.prompt_tokens = lambda *_, **__: n_text  # the formula's text length: this run's prompts (an editing family passes the size)
    try:
        return float(adapter.forward_flops(s["height"], s["width"], lora_rank=args.rank))
    except Exception:  # noqa: BLE001 - a family without a formula at this shape: the executed count still stands
        return float("nan")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen_image", choices=sorted(SETTINGS))
    p.add_argument("--recipe", default=None, choices=sorted(RECIPES), help="a published recipe's shape (sets shape, steps, CFG, window, LoRA, batch)")
    p.add_argument("--variants", default="eager,compiled", help="comma list of reference (the family's eager diffusers pipeline, no LoRA), "
                   "eager, compiled and their variants; a one-character suffix (_b, _c) makes another pair, measured in turn; a label holding "
                   "'fuse' folds LoRA into the weights for the rollout (model.fuse_lora_rollout), 'novae' leaves the VAE decoder "
                   "uncompiled (model.compile_vae=false), 'graphs' replays CUDA graphs (reduce-overhead), 'whole' compiles the whole model, "
                   "'fp8' samples with FP8 linear layers (model.rollout_precision=fp8; max_abs_dlogp is then the FP8-vs-bf16 |Δ log p|); "
                   "e.g. eager,compiled,compiled_fuse,compiled_fuse_fp8")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on a CPU")
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=16, help="images per iteration (prompts × group)")
    p.add_argument("--group", type=int, default=8, help="images per prompt")
    p.add_argument("--micro-batch", type=int, default=8, help="trajectories per training forward/backward")
    p.add_argument("--rollout-micro", type=int, default=None, help="images per rollout forward (default: the whole batch)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--cfg", type=float, default=None)
    p.add_argument("--window", type=int, default=2, help="SDE steps trained (0: all)")
    p.add_argument("--window-range", type=int, nargs=2, default=(0, 5))
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--alpha", type=float, default=128.0)
    p.add_argument("--mlp", action="store_true", help="LoRA on the MLP projections too")
    p.add_argument("--frames", type=int, default=None, help="video frames (Wan)")
    p.add_argument("--n-text", type=int, default=None, help="Qwen-Image prompt tokens")
    p.add_argument("--ckpt-every", type=int, default=1, help="activation checkpointing of every k-th block (0: off)")
    p.add_argument("--scope", default="blocks", choices=["model", "blocks"], help="model.compile_scope")
    p.add_argument("--mode", default="default", help="model.compile_mode")
    p.add_argument("--cache-dir", default=None, help="model.compile_cache_dir (inductor cache)")
    p.add_argument("--compile-backend", default=None)
    p.add_argument("--cfg-mode", default="split")
    p.add_argument("--decode-chunk", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--e2e-iters", type=int, default=2)
    p.add_argument("--reward", default="brightness", help="the end-to-end loop's reward: brightness (a free stand-in) or a registered "
                   "reward run in the loop, e.g. ocr (PP-OCRv4 via onnxruntime on the CPU cores; targets 'SIGN <prompt index>')")
    p.add_argument("--reward-chunks", type=int, default=0, help="with a registered --reward: also measure the end-to-end loop with the reward "
                   "off the critical path (the batch sampled in this many chunks, each scored on the CPU cores while the next samples), beside "
                   "the serial loop; pass --rollout-micro dividing a chunk so both loops run the same kernels (results bit for bit)")
    p.add_argument("--peak-tflops", type=float, default=None, help="bf16 matmul rate the MFU divides by (default: measured here)")
    p.add_argument("--logp-tol", type=float, default=None)
    p.add_argument("--sdpa", default="cudnn", choices=["cudnn", "flash", "default"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", default=None)
    p.add_argument("--profile", action="store_true", help="profile one rollout: GPU kernel time by kind, the top kernels, the VAE decode's share")
    p.add_argument("--rollout-only", action="store_true", help="measure the rollout only (no update, parity or end to end)")
    args = p.parse_args(argv)
    if args.recipe:
        rec = RECIPES[args.recipe]
        args.shape = rec["shape"]
        args.steps, args.cfg, args.window, args.window_range = rec["steps"], rec["cfg"], rec["window"], rec["window_range"]
        args.rank, args.alpha, args.mlp, args.group, args.micro_batch, args.batch = rec["rank"], rec["alpha"], rec["mlp"], rec["group"], rec["micro_batch"], rec["batch"]
        args.n_text = args.n_text or rec["n_text"]
    args.settings = SETTINGS[args.shape]
    known_families()  # every family's published shapes registered (pipelines.shapes)
    args.cfg = args.settings["cfg"] if args.cfg is None else args.cfg
    on_gpu = cuda(args.device)
    args.dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    args.compile_backend = args.compile_backend or ("inductor" if on_gpu else "aot_eager")
    args.logp_tol = args.logp_tol if args.logp_tol is not None else (1e-3 if args.dtype != "float32" else 1e-6)
    if on_gpu:
        torch.backends.cuda.matmul.allow_tf32 = True
    results = {
        "date": time.strftime("%Y-%m-%d"), "commit": args.commit or git_commit(), "torch": torch.__version__, "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if on_gpu else "cpu", "shape": args.shape, "recipe": args.recipe,
        "published": {k: v for k, v in vars(SHAPES.get(args.shape)).items() if k in ("params_billion", "source")} if args.shape in SHAPES else None,
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items() if k not in ("settings",)},
    }
    if on_gpu:
        measured = matmul_peak(args.device) / 1e12
        results["matmul_tflops_measured"] = measured
        args.peak_tflops = args.peak_tflops or measured
    args.peak_tflops = args.peak_tflops or 1.0
    results["peak_tflops"] = args.peak_tflops
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with sdpa_priority(args.sdpa if on_gpu else "default"):
        for label in filter(None, args.variants.split(",")):
            try:
                if label.startswith("reference"):
                    measure_reference(args, label, results)
                    if on_gpu:  # its pipeline and adapter went with the call
                        torch.cuda.empty_cache()
                else:
                    measure(args, label, label.startswith("compiled"), results)
            except Exception as exc:  # noqa: BLE001 - keep what the other variants measured
                results.setdefault("variants", {}).setdefault(label, {})["error"] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
                if on_gpu:
                    results["variants"][label]["memory_at_error_gb"] = gb(torch.cuda.max_memory_allocated())
                    torch.cuda.empty_cache()
            out.write_text(json.dumps(results, indent=2, default=str))
    speedups(results)
    if "rollout_speedup_vs_eager" in results.get("variants", {}).get("compiled", {}):
        results["rollout_speedup_compiled_vs_eager"] = results["variants"]["compiled"]["rollout_speedup_vs_eager"]
    out.write_text(json.dumps(results, indent=2, default=str))
    print(table(results))
    for kind, entry in results.get("pairs", {}).items():
        print(f"  {kind}: " + "; ".join(f"{k} {v['mean']:.3f}× (pairs {v['ratios']})" for k, v in entry.items()), flush=True)
    return results


def table(results: dict) -> str:
    rows = [("variant", "rollout img/s", "rollout MFU", "train s", "train MFU exec/counted", "e2e img/s", "e2e overlapped img/s", "e2e MFU", "max|Δlogp|", "peak GB")]
    for label, r in results.get("variants", {}).items():
        if "error" in r:
            rows.append((label, "error: " + r["error"][:80], "", "", "", "", "", "", "", str(r.get("memory_at_error_gb", ""))))
            continue
        f = lambda k, fmt="{:.2f}": fmt.format(r[k]) if r.get(k) is not None else "–"  # noqa: E731
        rows.append((label, f("rollout_images_per_s"), f("rollout_mfu_executed", "{:.3f}"), f("train_s"),
                     f"{f('train_mfu_executed', '{:.3f}')} / {f('train_mfu_counted', '{:.3f}')}", f("e2e_images_per_s", "{:.3f}"), f("e2e_overlap_images_per_s", "{:.3f}"),
                     f("e2e_mfu_executed", "{:.3f}"), f("max_abs_dlogp", "{:.1e}"), f("peak_gb")))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    return f"{results['shape']} on {results['device']}\n" + "\n".join(" | ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows)


if __name__ == "__main__":
    main()
