"""One GPU, two processes: the actor and one rollout replica side by side at SD3.5-M shape, against the
colocated loop (issue 19). Written for the H200; not yet run there.

Three sections, each in fresh processes (so that every peak-memory number is its own):

* **colocated**: today's loop in one process: sample a Flow-GRPO batch (``sample_trajectories``), score it
  (a brightness stand-in reward), train on it (``DiffusionEngine.train_batch``, flow_grpo), repeat;
* **split k=0**: an actor process and a replica process on the same GPU; the replica samples with the
  weights it holds, hands the trajectories over (host memory), the actor trains, and the LoRA goes back
  through ``diffrl.distributed.weight_sync`` (bucketed broadcasts of a gloo group: NCCL refuses two ranks on
  one GPU, so the buckets travel through host memory) before the next batch — synchronous, as
  ``distributed.max_staleness=0``;
* **split k=1**: the same with the replica one batch ahead (``distributed.max_staleness=1``): it samples batch
  ``i + 1`` while the actor trains on batch ``i``; the loss takes the truncated importance weights of the
  one-step-old trajectories (one optimizer step per batch: the training forward is the proximal policy).

Each reports iterations (sample + score + train, and the sync where there is one) per second in the steady
state, trajectories per second, the rollout and training times, each process's peak GPU memory
(``torch.cuda.max_memory_allocated``) and the device's used memory at the end of the timed loop
(``torch.cuda.mem_get_info``), the sync's time on both ends, bytes and buckets, and whether the replica's
LoRA hash equals the actor's after every sync. Sync times start when both ends are in the sync (a one-element
broadcast first), so they exclude one end waiting for the other (reported apart as ``sync_actor_wait_s``). The model is ``gpu_speed.build_adapter``'s random
SD3.5-M-shaped transformer (bf16, 512 px, CFG 4.5, LoRA rank 32, 10 steps, batch 16).

    # the GPU run (device tool, carry .whl: diffusers, tensordict, hydra/omegaconf wheels; no Ray needed)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
    python3 benchmarks/speed/replica_gpu.py --out $OUT/replica_gpu.json --commit <hash>
    # CPU smoke test of every code path (a 2-layer model, 1 thread per process)
    PYTHONPATH=. python benchmarks/speed/replica_gpu.py --tiny --device cpu --out /tmp/replica_gpu_tiny.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import queue
import socket
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpu_speed import (
    SD35_MEDIUM,
    TINY,
    add_advantages,
    build_adapter,
    diffrl_rollout,
    git_commit,
    median,
    sync,
)

from diffrl.algorithms.losses import make_step_loss
from diffrl.config import LoraConfig, ModelConfig, OptimConfig, SamplerConfig
from diffrl.distributed import weight_sync
from diffrl.engine.engine import DiffusionEngine


def build_engine(args, device: str):
    """The random SD3.5-M-shaped adapter and its engine with LoRA attached (same seed in every process)."""
    prompts = [f"random prompt {i}" for i in range(args.batch)]
    adapter = build_adapter(args.config, device, args.seed, prompts, args.n_text)
    settings = SamplerConfig(num_steps=args.steps, kind="flow_sde", noise_level=0.7, guidance_scale=args.cfg, height=args.size, width=args.size)
    model = ModelConfig(lora=LoraConfig(rank=args.rank, alpha=float(args.rank)), compile=args.compile, compile_backend=args.compile_backend)
    engine = DiffusionEngine(adapter, model=model, optim=OptimConfig(lr=1e-5), sampler=settings)
    engine.initialize()
    group = 4
    rl_prompts = [p for p in prompts[: args.batch // group] for _ in range(group)]
    return adapter, engine, settings, rl_prompts


def memory(device: str) -> dict:
    if torch.device(device).type != "cuda":
        return {"peak_gb": None, "device_used_gb": None}
    free, total = torch.cuda.mem_get_info()
    return {"peak_gb": torch.cuda.max_memory_allocated() / 2**30, "device_used_gb": (total - free) / 2**30}


def setup_process(args) -> None:
    torch.set_num_threads(args.threads)
    if torch.device(args.device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True


# -- colocated ------------------------------------------------------------------------------------------
def colocated(args, results_queue) -> None:
    try:
        setup_process(args)
        device = args.device
        adapter, engine, settings, prompts = build_engine(args, device)
        loss_fn = make_step_loss("flow_grpo", clip_range=1e-4)
        times, rollout_s, train_s = [], [], []
        for i in range(args.warmup + args.iters):
            if i == args.warmup and torch.device(device).type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            sync(device)
            t0 = time.perf_counter()
            td = add_advantages(diffrl_rollout(adapter, settings, prompts, args.seed + i))
            sync(device)
            t1 = time.perf_counter()
            engine.train_batch(td, loss_fn)
            sync(device)
            t2 = time.perf_counter()
            if i >= args.warmup:
                times.append(t2 - t0)
                rollout_s.append(t1 - t0)
                train_s.append(t2 - t1)
        it = median(times)
        results_queue.put({"iteration_s": it, "trajectories_per_s": len(prompts) / it, "rollout_s": median(rollout_s), "train_s": median(train_s),
                           "iterations": times, **memory(device)})
    except BaseException:
        results_queue.put({"error": traceback.format_exc()})
        raise


# -- split: actor and replica processes -----------------------------------------------------------------
def replica(args, staleness: int, port: int, trajectories, results_queue, actor_done) -> None:
    """Samples batch i with the weights it holds, hands it over, and joins the sync after each update.

    It stays alive until the actor is done: a CPU tensor put on the queue travels as a file descriptor that
    the receiver fetches from the sending process, so the sender must outlive the last ``get``."""
    try:
        setup_process(args)
        device = args.device
        adapter, engine, settings, prompts = build_engine(args, device)
        channel = weight_sync.WeightSyncChannel("gloo", "127.0.0.1", port, 1, 2, args.timeout)
        bucket = int(args.bucket_mb * 2**20)
        n = args.warmup + args.iters
        version, rollout_s, receives = 0, [], []
        for i in range(n):
            if i == args.warmup and torch.device(device).type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            if i > staleness:  # batch i is sampled with the weights after batch i − 1 − staleness (version i − staleness)
                receives.append(weight_sync.receive_weights(engine, channel, bucket))
                version += 1
            sync(device)
            t0 = time.perf_counter()
            td = add_advantages(diffrl_rollout(adapter, settings, prompts, args.seed + i))
            sync(device)
            rollout_s.append(time.perf_counter() - t0)
            td["weights_version"] = torch.full((td.shape[0],), version, dtype=torch.long)
            trajectories.put(td.cpu())
        for _ in range(staleness):  # the actor sends after each of its first n − 1 batches: take the last ones too
            receives.append(weight_sync.receive_weights(engine, channel, bucket))
        results_queue.put({"role": "replica", "rollout_s": median(rollout_s[args.warmup:]), "receives": receives, **memory(device)})
        actor_done.wait(args.timeout)
    except BaseException:
        results_queue.put({"role": "replica", "error": traceback.format_exc()})
        raise


def actor(args, staleness: int, port: int, trajectories, results_queue, actor_done) -> None:
    """Trains on each batch as it arrives (truncated importance weights for a stale one) and sends the LoRA."""
    try:
        setup_process(args)
        device = args.device
        _, engine, _, prompts = build_engine(args, device)
        channel = weight_sync.WeightSyncChannel("gloo", "127.0.0.1", port, 0, 2, args.timeout)
        bucket = int(args.bucket_mb * 2**20)
        loss_fn = make_step_loss("flow_grpo", clip_range=1e-4)
        n = args.warmup + args.iters
        times, train_s, wait_s, sends, staleness_seen = [], [], [], [], []
        last = None
        for i in range(n):
            if i == args.warmup and torch.device(device).type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            td = trajectories.get(timeout=args.timeout)
            wait_s.append(time.perf_counter() - t0)
            versions = td.pop("weights_version")
            staleness_seen.append(i - int(versions.min()))
            if int(versions.min()) < i:
                td["proximal_is_current"] = torch.ones(td.shape[0], dtype=torch.bool)
            sync(device)
            t1 = time.perf_counter()
            engine.train_batch(td, loss_fn)
            sync(device)
            train_s.append(time.perf_counter() - t1)
            if i < n - 1:
                sends.append(weight_sync.send_weights(engine, channel, bucket))
            now = time.perf_counter()
            if last is not None and i > args.warmup:
                times.append(now - last)
            last = now
        it = median(times)
        results_queue.put({"role": "actor", "iteration_s": it, "trajectories_per_s": len(prompts) / it, "train_s": median(train_s[args.warmup:]),
                           "wait_for_rollout_s": median(wait_s[args.warmup:]), "sends": sends, "staleness": staleness_seen,
                           "iterations": times, **memory(device)})
    except BaseException:
        results_queue.put({"role": "actor", "error": traceback.format_exc()})
        raise
    finally:
        actor_done.set()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_split(args, staleness: int) -> dict:
    ctx = mp.get_context("spawn")
    trajectories, results_queue, actor_done = ctx.Queue(maxsize=staleness + 1), ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=fn, args=(args, staleness, port, trajectories, results_queue, actor_done)) for fn in (actor, replica)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + args.timeout * 4
    while len(got) < 2 and time.monotonic() < deadline:
        try:
            r = results_queue.get(timeout=5)
        except queue.Empty:  # keep waiting unless a process died
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            continue
        got[r.pop("role")] = r
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    a, r = got.get("actor", {"error": "no answer"}), got.get("replica", {"error": "no answer"})
    if "error" in a or "error" in r:
        return {"error": {"actor": a.get("error"), "replica": r.get("error")}}
    pairs = list(zip(a["sends"], r["receives"]))
    return {
        **{k: a[k] for k in ("iteration_s", "trajectories_per_s", "train_s", "wait_for_rollout_s", "staleness", "iterations")},
        "rollout_s": r["rollout_s"], "actor_peak_gb": a["peak_gb"], "replica_peak_gb": r["peak_gb"],
        "device_used_gb": max(filter(None, [a["device_used_gb"], r["device_used_gb"]]), default=None),
        "sync_send_s": median([s["seconds"] for s in a["sends"]]), "sync_receive_s": median([x["seconds"] for x in r["receives"]]),
        "sync_actor_wait_s": median([s["wait_seconds"] for s in a["sends"]]),
        "sync_hash_s": median([s["hash_seconds"] for s in a["sends"]]), "sync_bytes": a["sends"][0]["bytes"], "sync_buckets": a["sends"][0]["buckets"],
        "syncs": len(pairs), "hashes_equal": len(a["sends"]) == len(r["receives"]) and all(s["hash"] == x["hash"] for s, x in pairs),
    }


def run_colocated(args) -> dict:
    ctx = mp.get_context("spawn")
    results_queue = ctx.Queue()
    p = ctx.Process(target=colocated, args=(args, results_queue))
    p.start()
    result = results_queue.get(timeout=args.timeout * 4)
    p.join(timeout=60)
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a 2-layer model at 64 px, batch 4, 3 steps (CPU smoke test)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="benchmarks/results/replica_gpu.json")
    p.add_argument("--batch", type=int, default=16, help="trajectories per RL step (groups of 4)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--cfg", type=float, default=4.5)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--n-text", type=int, default=333)
    p.add_argument("--iters", type=int, default=4, help="timed iterations per section")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations first (compilation)")
    p.add_argument("--bucket-mb", type=float, default=64.0)
    p.add_argument("--compile", action="store_true", help="model.compile in every process")
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for a rendezvous, a queue wait and each broadcast")
    p.add_argument("--skip", default="", help="comma list of sections to skip: colocated,split0,split1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", default=None, help="commit to record (the GPU machine's copy has no .git)")
    args = p.parse_args(argv)
    args.config = dict(TINY if args.tiny else SD35_MEDIUM)
    if args.tiny:
        args.batch, args.steps, args.size, args.n_text, args.iters, args.warmup = 4, 3, 64, 10, 2, 1
    skip = set(filter(None, args.skip.split(",")))
    results = {
        "date": datetime.date.today().isoformat(), "commit": args.commit or git_commit(), "torch": torch.__version__, "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "cpu",
        "settings": {k: getattr(args, k) for k in ("batch", "steps", "cfg", "rank", "size", "n_text", "iters", "warmup", "bucket_mb", "compile", "threads")},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name, fn in (("colocated", lambda: run_colocated(args)), ("split0", lambda: run_split(args, 0)), ("split1", lambda: run_split(args, 1))):
        if name in skip:
            continue
        start = time.perf_counter()
        results[name] = fn()
        results[name]["section_s"] = time.perf_counter() - start
        out.write_text(json.dumps(results, indent=2))
        r = results[name]
        if "error" in r:
            print(f"[{name}] failed:\n{r['error']}", flush=True)
            continue
        line = f"[{name}] {r['trajectories_per_s']:.2f} trajectories/s (iteration {r['iteration_s']:.2f} s; rollout {r['rollout_s']:.2f} s, train {r['train_s']:.2f} s)"
        if "sync_send_s" in r:
            line += (f"; sync {r['sync_send_s'] * 1e3:.1f} ms sent, {r['sync_receive_s'] * 1e3:.1f} ms received ({r['sync_bytes'] / 2**20:.1f} MiB in {r['sync_buckets']} buckets, "
                     f"{r['syncs']} syncs, hashes equal: {r['hashes_equal']}); staleness {r['staleness']}")
        print(line, flush=True)
    print(f"JSON: {out}")
    return results


if __name__ == "__main__":
    main()
