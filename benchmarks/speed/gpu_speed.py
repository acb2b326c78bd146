"""GPU speed of diffrl's rollout and training paths against eager diffusers/peft references (issue 8).

One run builds an SD3.5-Medium-shaped ``SD3Transformer2DModel`` with random weights (diffusers' SD3.5-M
config: 24 layers, 24 heads × 64, joint_attention_dim 4096, pooled 2048, caption projection 1536, patch 2,
16 latent channels, pos_embed_max_size 384, dual attention in layers 0–12, RMS q/k norm), in bf16, and at
512 px (1024 image tokens, 333 prompt tokens = 77 CLIP + 256 T5) measures side by side:

* **reference**: a diffusers-style eager sampling loop (``StableDiffusion3Pipeline``'s denoising loop:
  batched CFG, Euler step in fp32) and an eager peft LoRA training step (a Flow-GRPO step with CFG written
  directly against the transformer);
* **diffrl eager**: ``diffrl.sampling.rollout.sample_trajectories`` and ``DiffusionEngine.train_batch`` (flow_grpo)
  through an SD3 adapter, ``model.compile`` off;
* **diffrl compiled**: the same with ``ModelConfig(compile=True)`` (the denoiser compiled in place after
  LoRA is attached), plus end-to-end Flow-GRPO iterations (sample → reward → advantages → train on all
  SDE steps) and the rollout ↔ training log-prob check.

The adapter is ``pipelines.sd3.SD3Adapter`` around the big transformer with prompt embeddings drawn at
random into its prompt-embedding cache (no text encoders) and a tiny random VAE of the real downsampling
factor 8 and 16 latent channels (decode cost is not what is measured). MFU comes from
``diffrl.engine.flops.counter_for_adapter`` against ``--peak-tflops`` (the measured bf16 matmul rate; the run
also re-measures it). The SDPA backend priority is set once for every variant (``--sdpa``).

    # the GPU run (device tool, carry .whl): wheels, then the script; about 6–8 minutes of device time
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
    python3 benchmarks/speed/gpu_speed.py --out $OUT/gpu_speed.json --profile --commit <hash>
    # a 20-second CPU smoke test of every code path
    PYTHONPATH=. python benchmarks/speed/gpu_speed.py --tiny --device cpu --profile --out /tmp/gpu_speed_tiny.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import subprocess
import time
from pathlib import Path

import torch

SD35_MEDIUM = dict(
    sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
    num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
    pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
)
TINY = dict(
    sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
    num_attention_heads=2, joint_attention_dim=64, caption_projection_dim=32, pooled_projection_dim=32,
    pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm",
)
# a VAE with the real factor 8 (four blocks) and 16 latent channels, 8 channels wide: decoding is cheap
TINY_VAE_F8 = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(8, 8, 8, 8), layers_per_block=1, latent_channels=16, norm_num_groups=4, use_quant_conv=False,
    use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5305,
)


# -- building ---------------------------------------------------------------------------------------
def build_transformer(config: dict, device: str, seed: int):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    with torch.device(device):
        model = SD3Transformer2DModel(**config)
    return model.to(torch.bfloat16).requires_grad_(False)


def random_prompt_cache(prompts: list[str], n_text: int, width: int, pooled: int, seed: int) -> dict:
    """Random embeddings of every prompt and of the empty negative prompt (the SD3 cache's layout)."""
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    cache = {}
    for p in [*prompts, ""]:
        cache[p] = TensorDict(
            {
                "prompt_embeds": (0.5 * torch.randn(n_text, width, generator=g)).to(torch.bfloat16),
                "pooled_prompt_embeds": (0.5 * torch.randn(pooled, generator=g)).to(torch.bfloat16),
            },
            batch_size=[],
        )
    return cache


def build_adapter(config: dict, device: str, seed: int, prompts: list[str], n_text: int, cfg_mode: str | None = None):
    """An ``SD3Adapter`` over a random SD3.5-M-shaped transformer, a tiny factor-8 VAE and a filled
    prompt-embedding cache (no text encoders).

    ``cfg_mode``: ``SD3Adapter``'s (None: its default, ``split``: the unconditional branch as its own
    forward under ``no_grad``; ``batched``: one forward over both branches, whose backward also runs through
    the unconditional half)."""
    import inspect

    from diffusers import AutoencoderKL

    from pipelines.sd3.adapter import SD3_SCHEDULER_CONFIG, SD3Adapter

    class RandomSD3Adapter(SD3Adapter):
        text_encoder_names = ()
        tokenizer_names = ()

        def __init__(self):  # noqa: D107 - no weights folder, no tokenizers
            torch.manual_seed(seed + 1)
            parts = {
                "transformer": build_transformer(config, device, seed),
                "vae": AutoencoderKL(**TINY_VAE_F8),
                "scheduler": dict(SD3_SCHEDULER_CONFIG),
            }
            self._setup(parts, "bfloat16", device, decode_chunk=16, drop_text_encoders=True)
            self.shift = float(self.scheduler_config["shift"])
            self.max_sequence_length, self.clip_max_length = n_text, 77
            self.patch_size = int(self.denoiser.config.patch_size)
            self.cfg_mode = cfg_mode or inspect.signature(SD3Adapter.__init__).parameters["cfg_mode"].default
            self._cache = random_prompt_cache(prompts, n_text, config["joint_attention_dim"], config["pooled_projection_dim"], seed + 2)

        def default_prompts(self):
            return list(prompts)

    return RandomSD3Adapter()


# -- timing helpers ---------------------------------------------------------------------------------
def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def reset_peak(device):
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak_gb(device):
    return torch.cuda.max_memory_allocated() / 2**30 if torch.device(device).type == "cuda" else None


def matmul_peak(device) -> float | None:
    if torch.device(device).type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = timed(lambda: [a @ b for _ in range(10)], device, 3)
    return 10 * 2 * 8192**3 / median(times)


# -- the references ---------------------------------------------------------------------------------
def reference_sampling(model, sigmas, cond, shape, guidance, device):
    """StableDiffusion3Pipeline's denoising loop, eager: batched CFG, fp32 Euler step, bf16 latents."""
    neg, pos = cond
    seq = torch.cat([neg["prompt_embeds"], pos["prompt_embeds"]]).to(device)
    pooled = torch.cat([neg["pooled_prompt_embeds"], pos["pooled_prompt_embeds"]]).to(device)
    latents = torch.randn(shape, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        for k in range(len(sigmas) - 1):
            t = (1000.0 * sigmas[k]).expand(2 * shape[0]).to(device)
            out = model(hidden_states=torch.cat([latents, latents]), timestep=t, encoder_hidden_states=seq,
                        pooled_projections=pooled, return_dict=False)[0]
            u, c = out.chunk(2)
            v = u + guidance * (c - u)
            latents = (latents.float() + (sigmas[k + 1] - sigmas[k]).item() * v.float()).to(torch.bfloat16)
    return latents


def reference_lora_step(model, optimizer, params, cond, shape, guidance, noise_level, device, seed):
    """One eager Flow-GRPO step on a batch at one random sigma: CFG forward (uncond detached), the SDE
    transition's log-prob of a drawn next sample, the clipped-ratio loss, backward, clip, AdamW."""
    neg, pos = cond
    g = torch.Generator(device=device).manual_seed(seed)
    B = shape[0]
    x = torch.randn(shape, device=device, generator=g)
    s, s_next = 0.8, 0.7
    seq = torch.cat([neg["prompt_embeds"], pos["prompt_embeds"]]).to(device)
    pooled = torch.cat([neg["pooled_prompt_embeds"], pos["pooled_prompt_embeds"]]).to(device)
    out = model(hidden_states=torch.cat([x, x]).to(torch.bfloat16), timestep=torch.full((2 * B,), 1000.0 * s, device=device),
                encoder_hidden_states=seq, pooled_projections=pooled, return_dict=False)[0]
    u, c = out.chunk(2)
    u = u.detach()
    v = (u + guidance * (c - u)).float()
    dt = s_next - s
    std_t = noise_level * math.sqrt(s / (1 - s))
    mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
    std = std_t * math.sqrt(-dt)
    x_next = (mean + std * torch.randn(shape, device=device, generator=g)).detach()
    logp = (-((x_next - mean) ** 2) / (2 * std**2)).mean(dim=(1, 2, 3))
    adv = torch.randn(B, device=device, generator=g)
    ratio = torch.exp(logp - logp.detach())
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# -- diffrl paths -----------------------------------------------------------------------------------
def make_prompts(n: int) -> list[str]:
    return [f"random prompt {i}" for i in range(n)]


def diffrl_rollout(adapter, settings, prompts, seed):
    """``sample_trajectories`` as the rollout worker calls it (the module in eval mode; training sets train)."""
    from diffrl.sampling.rollout import sample_trajectories
    from diffrl.sampling.seeding import Stream, derive

    adapter.denoiser.eval()
    seeds = [derive(seed, Stream.ROLLOUT, 0, i, 0) for i in range(len(prompts))]
    return sample_trajectories(adapter, prompts, settings=settings, seeds=seeds)


def logp_check(engine, td, loss_fn):
    """Train once on the rollout ``td`` with a spy loss: max |log p(training path) − log p(rollout)| over
    every trained step (the first ratio of an on-policy update)."""
    worst = {"max_abs_dlogp": 0.0, "per_step": {}}

    def spy(step, batch, k):
        d = (step["log_prob"].detach().float() - batch["log_probs"][:, k].to(step["log_prob"].device)).abs()
        worst["max_abs_dlogp"] = max(worst["max_abs_dlogp"], d.max().item())
        seen = worst["per_step"].setdefault(int(k), {"max": 0.0, "sum": 0.0, "n": 0})
        seen["max"], seen["sum"], seen["n"] = max(seen["max"], d.max().item()), seen["sum"] + d.sum().item(), seen["n"] + d.numel()
        return loss_fn(step, batch, k)

    engine.train_batch(td, spy)
    per_step = {k: {"max": v["max"], "mean": v["sum"] / max(v["n"], 1)} for k, v in sorted(worst["per_step"].items())}
    return worst["max_abs_dlogp"], per_step


def randomise_lora(module, scale: float, seed: int = 0) -> None:
    """Non-zero LoRA B matrices, so the adapter takes part in the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.copy_(scale * torch.randn(p.shape, generator=g))


def add_advantages(td):
    from diffrl.algorithms.advantages import group_advantages

    rewards = td["images"].float().mean(dim=(1, 2, 3)) / 255.0  # a cheap stand-in reward: brightness
    td["rewards"] = rewards
    td["advantages"] = group_advantages(rewards, td["group_id"])
    return td


def measure_diffrl(args, label, compile_on, results, device, cfg_mode=None):
    """Rollout images/s, training-step MFU (and, compiled, end-to-end Flow-GRPO) of diffrl's own paths."""
    from diffrl.algorithms.losses import make_step_loss
    from diffrl.config import LoraConfig, ModelConfig, OptimConfig, SamplerConfig
    from diffrl.engine.engine import DiffusionEngine
    from diffrl.engine.flops import counter_for_adapter

    B = args.batch
    prompts = make_prompts(B)
    group = 4
    rl_prompts = [p for p in prompts[: B // group] for _ in range(group)]
    adapter = build_adapter(args.config, device, args.seed, prompts, args.n_text, cfg_mode)
    settings = SamplerConfig(num_steps=args.steps, kind="flow_sde", noise_level=0.7, guidance_scale=args.cfg,
                             height=args.size, width=args.size)
    model = ModelConfig(lora=LoraConfig(rank=args.rank, alpha=float(args.rank)), compile=compile_on, compile_backend=args.compile_backend)
    engine = DiffusionEngine(adapter, model=model, optim=OptimConfig(lr=1e-5), sampler=settings)
    t0 = time.perf_counter()
    engine.initialize()
    randomise_lora(engine.module, scale=1e-3)
    counter = counter_for_adapter(adapter, args.size, args.size, lora_rank=args.rank, peak_flops=args.peak_tflops * 1e12)
    loss_fn = make_step_loss("flow_grpo", clip_range=1e-4)
    n_image = (args.size // 8 // args.config["patch_size"]) ** 2
    r = results[label] = {"compile": compile_on, "cfg_mode": adapter.cfg_mode, "n_image_tokens": n_image, "n_text_tokens": adapter.prompt_tokens()}

    # warm-up (compiles the no-grad and the training graphs when compile is on)
    td = add_advantages(diffrl_rollout(adapter, settings, prompts, args.seed))
    r["first_rollout_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    r["max_abs_dlogp"], r["dlogp_per_step"] = logp_check(engine, td, loss_fn)  # the first update: rollout vs training log-probs
    sync(device)
    r["first_train_s"] = time.perf_counter() - t1
    r["logp_tolerance"] = args.logp_tol
    r["logp_ok"] = r["max_abs_dlogp"] <= args.logp_tol
    print(f"[{label}] warm-up: rollout {r['first_rollout_s']:.1f} s, train {r['first_train_s']:.1f} s, max|Δlogp| {r['max_abs_dlogp']:.2e}; "
          "per step max/mean: " + ", ".join(f"{k}: {v['max']:.1e}/{v['mean']:.1e}" for k, v in r["dlogp_per_step"].items()), flush=True)
    if args.done_file:
        Path(args.done_file).write_text("warm-up done")
    if args.logp_only:
        del engine, adapter, td
        return
    if args.wait_file:  # another process shares the GPU until it has written this file: time nothing before
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()  # leave the other process the memory this one does not hold
        deadline = time.monotonic() + 400
        while not Path(args.wait_file).exists() and time.monotonic() < deadline:
            time.sleep(1.0)
        r["waited_for"] = args.wait_file if Path(args.wait_file).exists() else f"{args.wait_file} (timed out)"

    reset_peak(device)
    times = timed(lambda: diffrl_rollout(adapter, settings, prompts, args.seed + 1), device, args.repeats)
    r["rollout_s"] = median(times)
    r["rollout_images_per_s"] = B / r["rollout_s"]
    r["rollout_mfu"] = counter.mfu(counter.rollout_flops(B, args.steps, args.cfg), r["rollout_s"])
    r["rollout_peak_gb"] = peak_gb(device)
    print(f"[{label}] rollout {r['rollout_images_per_s']:.2f} img/s, MFU {r['rollout_mfu']:.3f}", flush=True)

    reset_peak(device)
    times = timed(lambda: engine.train_batch(td, loss_fn), device, args.repeats)
    r["train_s"] = median(times)
    trained = int(td["sde_mask"][0].sum())
    r["train_mfu"] = counter.mfu(counter.train_flops(B, trained, args.cfg), r["train_s"])
    # what the hardware executes (flop_counter on a meta copy): frozen weights get no weight gradients, and the
    # batched CFG forward back-propagates through its unconditional half too (zero gradients)
    r["train_executed_units"] = executed_train_units(args, adapter.cfg_mode == "split")
    r["train_mfu_executed"] = counter.mfu(r["train_executed_units"] * counter.forward_flops(B) * trained, r["train_s"])
    r["train_peak_gb"] = peak_gb(device)
    print(f"[{label}] train step ({trained} SDE steps × {B}) {r['train_s']:.2f} s, MFU {r['train_mfu']:.3f} "
          f"(executed {r['train_mfu_executed']:.3f}), peak {r['train_peak_gb']} GB", flush=True)

    if args.e2e_iters:
        reset_peak(device)

        def iteration(i=[0]):  # noqa: B006 (a call counter)
            i[0] += 1
            batch = add_advantages(diffrl_rollout(adapter, settings, rl_prompts, args.seed + 100 + i[0]))
            engine.train_batch(batch, loss_fn)

        graphs = lambda: int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        before = graphs()
        times = timed(iteration, device, args.e2e_iters)
        r["e2e_times_s"], r["e2e_new_graphs"] = times, graphs() - before  # > 0: the loop recompiled
        r["e2e_iteration_s"] = median(times)
        r["e2e_trajectories_per_s"] = len(rl_prompts) / r["e2e_iteration_s"]
        n = len(rl_prompts)
        r["e2e_mfu"] = counter.mfu(counter.rollout_flops(n, args.steps, args.cfg) + counter.train_flops(n, trained, args.cfg), r["e2e_iteration_s"])
        r["e2e_peak_gb"] = peak_gb(device)
        print(f"[{label}] end-to-end Flow-GRPO {r['e2e_trajectories_per_s']:.2f} trajectories/s", flush=True)

    if args.profile:
        r["profile"] = profile_summary(adapter, engine, td, loss_fn, device)
    del engine, adapter, td
    torch._dynamo.reset()  # drop the compiled graphs (and the module they hold) before the next section
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def profile_summary(adapter, engine, td, loss_fn, device, top=12):
    """Device time by kernel (CPU time on a CPU) of one CFG forward (no grad) and one trained step
    (forward + backward), top kernels first."""
    from torch.profiler import ProfilerActivity, profile

    summary = {}
    if torch.device(device).type == "cuda":  # one whole rollout: device-busy time against wall time
        settings = engine.sampler
        prompts = make_prompts(int(td.batch_size[0]))
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            sync(device)
            t0 = time.perf_counter()
            diffrl_rollout(adapter, settings, prompts, 7)
            sync(device)
            wall = time.perf_counter() - t0
        rows = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0), key=lambda e: -e.self_device_time_total)
        busy = sum(e.self_device_time_total for e in rows) / 1e3
        summary["rollout_full"] = {"wall_ms": wall * 1e3, "device_ms": busy,
                                   "top": [{"name": e.key[:90], "ms": e.self_device_time_total / 1e3, "calls": e.count} for e in rows[:top]]}
        print(f"  profile rollout_full: wall {wall * 1e3:.0f} ms (under the profiler), device busy {busy:.0f} ms; top: "
              + "; ".join(f"{t['name'][:40]} {t['ms']:.1f}" for t in summary["rollout_full"]["top"][:6]), flush=True)
    on_gpu = torch.device(device).type == "cuda"
    activity = ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU
    self_ms = (lambda e: e.self_device_time_total / 1e3) if on_gpu else (lambda e: e.self_cpu_time_total / 1e3)

    x = td["latents"][:, 0].to(device)
    sigma = td["sigmas"][:, 0].to(device)
    cond = td["cond"].to(device)
    for name, fn, training in (
        ("rollout_forward", lambda: torch.no_grad()(adapter.predict)(x, sigma, cond, 4.5), False),
        ("train_fwd_bwd", lambda: adapter.predict(x, sigma, cond, 4.5).float().square().mean().backward(), True),
    ):
        adapter.denoiser.train(training)
        fn()
        sync(device)
        with profile(activities=[activity]) as prof:
            fn()
            sync(device)
        rows = sorted(prof.key_averages(), key=lambda e: -self_ms(e))
        summary[name] = {
            "ms_total": sum(self_ms(e) for e in rows),
            "top": [{"name": e.key[:90], "ms": self_ms(e), "calls": e.count} for e in rows[:top]],
        }
        print(f"  profile {name}: {summary[name]['ms_total']:.1f} ms; top: "
              + "; ".join(f"{t['name'][:40]} {t['ms']:.1f}" for t in summary[name]["top"][:5]), flush=True)
    engine.optimizer.zero_grad(set_to_none=True)
    return summary


def executed_train_units(args, split_cfg: bool) -> float:
    """Matmul/attention FLOPs that one CFG training pass (forward + backward, LoRA only trainable) executes
    per sample, in units of one forward, counted by ``torch.utils.flop_counter`` on a meta-device copy of
    the model (no memory, no compute). diffrl.engine.flops' convention counts 4 (3 for the conditional branch's
    forward + backward, 1 for the unconditional forward); with frozen base weights the backward computes no
    weight gradients, and the batched CFG forward back-propagates through both halves."""
    from diffusers import SD3Transformer2DModel
    from torch.utils.flop_counter import FlopCounterMode

    from diffrl.engine import lora
    from pipelines.sd3.adapter import SD3Adapter

    cfg = args.config
    with torch.device("meta"):
        model = SD3Transformer2DModel(**cfg).to(torch.bfloat16)
    lora.attach_lora(model, rank=args.rank, alpha=float(args.rank), dropout=0.0, target_modules=SD3Adapter.lora_target_modules)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    side = args.size // 8

    def forward(batch):
        meta = dict(device="meta", dtype=torch.bfloat16)
        return model(hidden_states=torch.empty(batch, cfg["in_channels"], side, side, **meta), timestep=torch.empty(batch, device="meta"),
                     encoder_hidden_states=torch.empty(batch, args.n_text, cfg["joint_attention_dim"], **meta),
                     pooled_projections=torch.empty(batch, cfg["pooled_projection_dim"], **meta), return_dict=False)[0]

    with FlopCounterMode(display=False) as fc, torch.no_grad():
        forward(1)
    one = fc.get_total_flops()
    with FlopCounterMode(display=False) as fc:
        if split_cfg:
            with torch.no_grad():
                forward(1)
            forward(1).float().mean().backward()
        else:
            forward(2).float().mean().backward()
    return fc.get_total_flops() / one


def flops_counter(args, lora_rank: int):
    """The analytic counter of diffrl.engine.flops for this model, image size and prompt length."""
    from diffrl.engine.flops import DiffusionFlopsCounter
    from pipelines.flops import mmdit_forward_flops

    side = args.size // 8 // args.config["patch_size"]
    return DiffusionFlopsCounter(mmdit_forward_flops(args.config, side * side, args.n_text, lora_rank), peak_flops=args.peak_tflops * 1e12)


def measure_reference(args, results, device):
    from diffrl.engine import lora
    from pipelines.sd3.adapter import SD3Adapter

    B = args.batch
    r = results["reference"] = {}
    model = build_transformer(args.config, device, args.seed)
    prompts = make_prompts(B)
    cache = random_prompt_cache(prompts, args.n_text, args.config["joint_attention_dim"], args.config["pooled_projection_dim"], args.seed + 2)
    pos = torch.stack([cache[p] for p in prompts])
    neg = torch.stack([cache[""] for _ in prompts])
    latent = args.size // 8
    shape = (B, args.config["in_channels"], latent, latent)
    sigmas = SD3Adapter.schedule(type("S", (), {"shift": 3.0, "scheduler_config": {}})(), args.steps)

    reset_peak(device)
    reference_sampling(model, sigmas, (neg, pos), shape, args.cfg, device)  # warm-up
    times = timed(lambda: reference_sampling(model, sigmas, (neg, pos), shape, args.cfg, device), device, args.repeats)
    r["rollout_s"] = median(times)
    r["rollout_images_per_s"] = B / r["rollout_s"]
    base, counter = flops_counter(args, 0), flops_counter(args, args.rank)
    r["rollout_mfu"] = base.mfu(base.rollout_flops(B, args.steps, args.cfg), r["rollout_s"])
    r["rollout_peak_gb"] = peak_gb(device)
    print(f"[reference] eager diffusers loop {r['rollout_images_per_s']:.2f} img/s, MFU {r['rollout_mfu']:.3f}", flush=True)

    lora.attach_lora(model, rank=args.rank, alpha=float(args.rank), dropout=0.0, target_modules=SD3Adapter.lora_target_modules)
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    for p in params:
        p.requires_grad_(True)
    model.train()
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    reset_peak(device)
    reference_lora_step(model, optimizer, params, (neg, pos), shape, args.cfg, 0.7, device, 0)  # warm-up
    times = timed(lambda: reference_lora_step(model, optimizer, params, (neg, pos), shape, args.cfg, 0.7, device, 1), device, args.repeats)
    r["train_step_s"] = median(times)
    r["train_mfu"] = counter.mfu(counter.train_flops(B, 1, args.cfg), r["train_step_s"])
    r["train_executed_units"] = executed_train_units(args, False)
    r["train_mfu_executed"] = counter.mfu(r["train_executed_units"] * counter.forward_flops(B), r["train_step_s"])
    r["train_peak_gb"] = peak_gb(device)
    print(f"[reference] eager peft LoRA step {r['train_step_s']:.3f} s, MFU {r['train_mfu']:.3f}", flush=True)
    del model, optimizer, params
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# -- main ---------------------------------------------------------------------------------------------
def sdpa_priority(name: str):
    if name == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = {
        "cudnn": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
        "flash": [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    }[name]
    try:
        return sdpa_kernel(order, set_priority=True)
    except TypeError:  # torch without priorities: restrict to the first choice and its fall-backs
        return sdpa_kernel(order)


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
        return head + ("+uncommitted" if dirty else "")
    except Exception:  # noqa: BLE001 - the copy on the GPU machine may have no git
        return "unknown"


def table(results: dict) -> str:
    rows = [("variant", "rollout img/s", "rollout MFU", "train MFU (counted / executed)", "e2e traj/s", "max|Δlogp|", "peak GB")]
    for label in ("reference", "diffrl_eager", "diffrl_compiled", "diffrl_compiled_batched_cfg"):
        r = results.get(label)
        if not r:
            continue
        f = lambda k, fmt="{:.2f}": fmt.format(r[k]) if r.get(k) is not None else "–"  # noqa: E731
        peak = max([v for k, v in r.items() if k.endswith("peak_gb") and v is not None] or [0.0])
        rows.append((label, f("rollout_images_per_s"), f("rollout_mfu", "{:.3f}"),
                     f"{f('train_mfu', '{:.3f}')} / {f('train_mfu_executed', '{:.3f}')}", f("e2e_trajectories_per_s"),
                     f("max_abs_dlogp", "{:.2e}"), f"{peak:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(" | ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a 2-layer model at 64 px, batch 4, 3 steps (CPU smoke test)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="benchmarks/results/gpu_speed.json")
    p.add_argument("--batch", type=int, default=16, help="prompts per rollout batch (the CFG forward runs 2× this)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--cfg", type=float, default=4.5)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--n-text", type=int, default=333)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--e2e-iters", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=767.0, help="bf16 matmul rate MFU divides by")
    p.add_argument("--sdpa", default="cudnn", choices=["cudnn", "flash", "default"])
    p.add_argument("--compile-backend", default=None, help="default: inductor (aot_eager with --tiny)")
    p.add_argument("--logp-tol", type=float, default=None, help="max |Δlogp| allowed (default 1e-3 in bf16, 0 in fp32 tiny)")
    p.add_argument("--skip", default="", help="comma list of sections to skip: reference,eager,compiled")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count-only", action="store_true", help="print the FLOP counts (meta tensors, any machine) and exit")
    p.add_argument("--compare-cfg", action="store_true", help="also measure compiled diffrl with the other SD3 cfg_mode (batched)")
    p.add_argument("--commit", default=None, help="commit to record (the GPU machine's copy has no .git)")
    p.add_argument("--logp-only", action="store_true", help="stop each diffrl section after the warm-up and the log-prob check")
    p.add_argument("--done-file", default=None, help="write this file once a section's warm-up is done")
    p.add_argument("--wait-file", default=None, help="time nothing until this file exists (another process shares the GPU)")
    args = p.parse_args(argv)
    args.config = dict(TINY if args.tiny else SD35_MEDIUM)
    if args.tiny:
        args.batch, args.steps, args.size, args.n_text, args.repeats, args.e2e_iters = 4, 3, 64, 10, 1, 1
        args.compile_backend = args.compile_backend or "aot_eager"
    args.compile_backend = args.compile_backend or "inductor"
    args.logp_tol = 1e-3 if args.logp_tol is None else args.logp_tol
    skip = set(filter(None, args.skip.split(",")))
    if args.count_only:
        counts = {
            "forward_gflop_per_image_analytic": flops_counter(args, args.rank).forward_flops(1) / 1e9,
            "train_units_batched_cfg": executed_train_units(args, False),
            "train_units_split_cfg": executed_train_units(args, True),
            "train_units_diffrl_flops_convention": flops_counter(args, args.rank).train_flops(1, 1, args.cfg) / flops_counter(args, args.rank).forward_flops(1),
        }
        print(json.dumps(counts, indent=2))
        return counts
    device = args.device
    if torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True

    results = {
        "date": time.strftime("%Y-%m-%d"), "commit": args.commit or git_commit(), "torch": torch.__version__, "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if torch.device(device).type == "cuda" else "cpu",
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in args.config.items()},
        "settings": {k: getattr(args, k) for k in ("batch", "steps", "cfg", "rank", "size", "n_text", "repeats", "e2e_iters", "peak_tflops", "sdpa", "compile_backend")},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out.write_text(json.dumps(results, indent=2))

    try:
        import diffusers

        results["diffusers"] = diffusers.__version__
        results["matmul_tflops_measured"] = (matmul_peak(device) or 0.0) / 1e12
        print(f"{results['device']} torch {torch.__version__} diffusers {diffusers.__version__}; "
              f"bf16 matmul {results['matmul_tflops_measured']:.0f} TFLOP/s", flush=True)
        results["forward_gflop_per_image"] = flops_counter(args, 0).forward_flops(1) / 1e9
        with sdpa_priority(args.sdpa):
            if "reference" not in skip:
                measure_reference(args, results, device)
                save()
            if "compiled" not in skip:
                measure_diffrl(args, "diffrl_compiled", True, results, device)
                save()
            if args.compare_cfg:
                measure_diffrl(args, "diffrl_compiled_batched_cfg", True, results, device, cfg_mode="batched")
                save()
            if "eager" not in skip:
                measure_diffrl(args, "diffrl_eager", False, results, device)
    finally:
        ref, fast = results.get("reference", {}), results.get("diffrl_compiled", {})
        if ref.get("rollout_images_per_s") and fast.get("rollout_images_per_s"):
            results["rollout_speedup_vs_reference"] = fast["rollout_images_per_s"] / ref["rollout_images_per_s"]
        save()
    print(table(results))
    if "rollout_speedup_vs_reference" in results:
        print(f"rollout speed-up of diffrl compiled over the eager reference: {results['rollout_speedup_vs_reference']:.2f}×")
    print(f"forward GFLOP per image: {results.get('forward_gflop_per_image')}; JSON: {out}")
    return results


if __name__ == "__main__":
    main()
