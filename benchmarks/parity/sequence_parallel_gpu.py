"""Sequence parallelism on two GPUs with NCCL: ``k = 2`` against ``k = 1`` at Wan2.1-1.3B width, and its speed.

Two processes (``cuda:0``, ``cuda:1``) split each video's tokens (``diffrl.engine.sequence_parallel``); rank 0 then runs
the same model whole on its own GPU. Reported per dtype (fp32 with TF32 off, bf16): the max |Δ| of the outputs and of
the LoRA gradients (summed over the group) over the largest value, and the seconds of one forward + backward at
``k = 1`` and ``k = 2``. The model is Wan2.1-T2V-1.3B's transformer config (12 heads × 128, random weights) cut to
``--layers`` blocks, with a LoRA of rank 16 on the attention projections (B random, so both factors have gradients).

    python benchmarks/parity/sequence_parallel_gpu.py --out results.json [--frames 33 --height 480 --width 832]

Needs 2 GPUs, torch, diffusers, peft, tensordict (the CPU version of these checks is tests/test_sequence_parallel.py).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch
import torch.multiprocessing as mp

WAN_1_3B = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
                freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)


def build(layers: int, dtype: torch.dtype, device: str, sp=None):
    from diffusers import WanTransformer3DModel

    from diffrl.engine import lora, sequence_parallel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = WanTransformer3DModel(**{**WAN_1_3B, "num_layers": layers})
        lora.attach_lora(model, rank=16, alpha=16.0, dropout=0.0, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in sorted(model.named_parameters()):
                if "lora_B" in name:
                    p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    model = model.to(device, dtype)
    if sp is not None:
        sequence_parallel.apply_wan(model, sp)
    return model


def inputs(args, dtype, device):
    gen = torch.Generator().manual_seed(2)
    frames = (args.frames - 1) // 4 + 1
    latents = torch.randn(1, 16, frames, args.height // 8, args.width // 8, generator=gen)
    text = torch.randn(1, 512, 4096, generator=gen)
    cotangent = torch.randn(1, 16, frames, args.height // 8, args.width // 8, generator=gen)
    return latents.to(device, dtype), text.to(device, dtype), torch.tensor([700.0], device=device), cotangent.to(device)


def run(model, latents, text, timestep, cotangent, repeats: int):
    """Outputs and LoRA gradients of one forward + backward, the median seconds of ``repeats`` more and the peak GiB."""
    times = []
    torch.cuda.reset_peak_memory_stats(latents.device)
    for i in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model(hidden_states=latents, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]
        (out.float() * cotangent).sum().backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach().float(), grads, sorted(times[1:])[len(times[1:]) // 2], torch.cuda.max_memory_allocated(latents.device) / 2**30


def rank_main(rank: int, args, port: int) -> None:
    import torch.distributed as dist

    from diffrl.engine import parallel, sequence_parallel

    os.environ["LOCAL_RANK"] = str(rank)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    parallel.init_distributed(rank, 2, "127.0.0.1", port, "nccl", timeout_s=300)
    device = f"cuda:{rank}"
    sp = sequence_parallel.new_groups(2)
    report = {"tokens": None}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        latents, text, timestep, cotangent = inputs(args, dtype, device)
        _, _, f, h, w = latents.shape
        report["tokens"] = f * (h // 2) * (w // 2)
        out2, grads2, sec2, peak2 = run(build(args.layers, dtype, device, sp), latents, text, timestep, cotangent, args.repeats)
        for g in grads2.values():
            dist.all_reduce(g, group=sp.group)
        torch.cuda.empty_cache()
        dist.barrier()
        if rank == 0:
            out1, grads1, sec1, peak1 = run(build(args.layers, dtype, device), latents, text, timestep, cotangent, args.repeats)
            rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
            report[name] = {
                "output_max_abs": (out2 - out1).abs().max().item(), "output_max_rel": rel(out2, out1),
                "grad_worst_rel": max(rel(grads2[k], grads1[k]) for k in grads1), "lora_tensors": len(grads1),
                "seconds_k1": sec1, "seconds_k2": sec2, "peak_gib_k1": peak1, "peak_gib_k2_rank0": peak2,
            }
            print(name, json.dumps(report[name]), flush=True)
            torch.cuda.empty_cache()
        dist.barrier()
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump({**report, "layers": args.layers, "frames": args.frames, "size": [args.height, args.width],
                       "device": torch.cuda.get_device_name(0)}, fh, indent=2)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(rank_main, args=(args, port), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
