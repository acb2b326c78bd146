"""FP8 rollouts on the GPU (issue 38): ``torch._scaled_mm``'s rowwise product against the emulated formula on fresh
random inputs, and the linear layer's time in bf16 against FP8 (activation quantisation included) at the shapes
of SD3.5-M, FLUX.1-dev and Qwen-Image blocks (tokens × in → out), eager and compiled.

    python3 benchmarks/speed/fp8_gpu_check.py --out $OUT/fp8_check.json
    # CPU smoke test (torch's CPU kernel; timings meaningless there)
    PYTHONPATH=. python benchmarks/speed/fp8_gpu_check.py --device cpu --small --out /tmp/fp8_check.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from diffrl.engine.fp8 import fp8_linear, quantize, rowwise_scale

# (name, rows = batch·tokens of one CFG-split forward, in, out)
SHAPES = [
    ("sd35m_qkv_b32", 32 * (1024 + 333), 1536, 3 * 1536),
    ("sd35m_mlp_up_b32", 32 * (1024 + 333), 1536, 4 * 1536),
    ("flux_mlp_up_b16", 16 * (1024 + 512), 3072, 4 * 3072),
    ("qwen_mlp_up_b16", 16 * (1024 + 64), 3072, 4 * 3072),
]


def bench(fn, device, iters: int = 20) -> float:
    """Median milliseconds of ``fn`` (CUDA events on a GPU, wall clock on a CPU), after 3 warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="shapes divided by 16 (CPU smoke test)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kernel = "scaled_mm"
    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__, "shapes": {}}
    for name, m, k, n in SHAPES:
        if args.small:
            m, k, n = m // 16, k // 16 * 1, n // 16
            k = max(16, k // 16 * 16)
        g = torch.Generator(device=device).manual_seed(hash(name) % 2**31)
        x = torch.randn(m, k, generator=g, device=device, dtype=dtype)
        w = torch.randn(n, k, generator=g, device=device, dtype=dtype) / k**0.5
        b = torch.randn(n, generator=g, device=device, dtype=dtype)
        scale = rowwise_scale(w)
        q = quantize(w, scale)
        fast = fp8_linear(x, q, scale, b, kernel)
        emul = fp8_linear(x, q, scale, b, "emulate")
        exact = x.double() @ w.double().t() + b.double()
        rel = lambda y: float((y.double() - exact).norm() / exact.norm())  # noqa: E731
        r = {"rows": m, "in": k, "out": n, "rel_err_scaled_mm_vs_emulate": float((fast.double() - emul.double()).norm() / emul.double().norm()),
             "rel_err_fp8_vs_exact": rel(fast), "rel_err_bf16_vs_exact": rel(F.linear(x, w, b))}
        flops = 2 * m * k * n
        r["bf16_ms"] = bench(lambda: F.linear(x, w, b), device)
        r["fp8_ms"] = bench(lambda: fp8_linear(x, q, scale, b, kernel), device)
        if device.type == "cuda":
            compiled = torch.compile(lambda x: fp8_linear(x, q, scale, b, kernel))
            r["fp8_compiled_ms"] = bench(lambda: compiled(x), device)
            # the same with the bias added after the kernel (diffrl before 2026-12-05's second lease): one more pass
            compiled_after = torch.compile(lambda x: (fp8_linear(x, q, scale, None, kernel).float() + b.float()).to(x.dtype))
            r["fp8_compiled_bias_after_ms"] = bench(lambda: compiled_after(x), device)
            x_q, x_s = quantize(x, rowwise_scale(x)), rowwise_scale(x)
            w_t, s_t = q.t(), scale.t().contiguous()
            r["fp8_gemm_only_ms"] = bench(lambda: torch._scaled_mm(x_q, w_t, scale_a=x_s, scale_b=s_t, out_dtype=torch.bfloat16), device)
        for key in [k_ for k_ in r if k_.endswith("_ms")]:
            r[key.replace("_ms", "_tflops")] = flops / (r[key] * 1e-3) / 1e12
        r["speedup_fp8_vs_bf16"] = r["bf16_ms"] / r.get("fp8_compiled_ms", r["fp8_ms"])
        out["shapes"][name] = r
        print(name, {k_: (round(v, 4) if isinstance(v, float) else v) for k_, v in r.items()}, flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
