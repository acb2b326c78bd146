"""Load on ``diffrl serve-reward``: many concurrent ``remote`` clients against the digits reward, every answer checked.

The server runs as ``diffrl serve-reward reward=digits`` in a subprocess on 127.0.0.1 (token from the
environment). ``--clients`` threads each send ``--requests`` requests of ``--images`` random 16×16 images
through :class:`rewards.remote.RemoteReward` (no retries: any failure counts as an error). The images come
from a pool of ``--pool`` distinct sets whose scores were computed once by the digits reward in this
process; each answer must equal the local scores of its own set (a mixed-up or merged-wrongly answer
fails), within 1e-5. Reports p50/p99 latency per request, requests/s and images/s, writes
``benchmarks/results/reward_server_load.json`` and prints a markdown row. Then (unless ``--skip-attacks``)
it runs the malformed-request table of :mod:`tests.faults.reward_server_attacks` against an in-process
server and writes ``benchmarks/results/reward_server_attacks.json``.

    PYTHONPATH=. python benchmarks/faults/reward_server_load.py --clients 32 --requests 200 --images 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import secrets
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version
from pathlib import Path

import torch

from diffrl.tools.reward_server import RewardServer
from tests.faults.reward_server_attacks import ATTACK_LIMITS, run_attacks
from rewards.base import TOKEN_ENV, RewardError, build_reward
from rewards.digits.data import all_prompts
from rewards.remote import RemoteReward

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def start_server(token: str, threads: int) -> tuple[subprocess.Popen, str]:
    """``diffrl serve-reward reward=digits --port 0`` with the token in its environment; returns the process and URL."""
    env = {**os.environ, TOKEN_ENV: token, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "diffrl.tools.cli", "serve-reward", "reward=digits", "--port", "0"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()  # the server prints its URL once it listens
    match = re.search(r"at (http://127\.0\.0\.1:\d+)", line)
    if not match:
        proc.kill()
        raise RuntimeError(f"reward server did not start: {line!r}; run `diffrl serve-reward reward=digits --port 0` by hand to see why")
    return proc, match.group(1)


def image_pool(count: int, images: int, seed: int) -> list[tuple[torch.Tensor, list[str], torch.Tensor]]:
    """``count`` distinct request bodies (images, prompts) and the digits reward's local scores of each."""
    reward, prompts_all, generator = build_reward("digits"), all_prompts(), torch.Generator().manual_seed(seed)
    pool = []
    for k in range(count):
        batch = torch.randint(0, 256, (images, 3, 16, 16), generator=generator, dtype=torch.uint8)
        prompts = [prompts_all[(k * images + i) % len(prompts_all)] for i in range(images)]
        pool.append((batch, prompts, reward(batch, prompts)["digits"]))
    return pool


def run_load(url: str, token: str, pool: list, clients: int, requests: int, max_seconds: float) -> dict:
    """``clients`` threads × ``requests`` requests; every answer compared with its set's local scores."""
    stop_at = time.monotonic() + max_seconds
    lock = threading.Lock()
    outcomes: Counter = Counter()
    first_errors: list[str] = []

    def client(index: int) -> list[float]:
        remote = RemoteReward(url, token=token, reward="digits", timeout=30, retries=0, batch_size=64)
        latencies = []
        for j in range(requests):
            if time.monotonic() > stop_at:
                with lock:
                    outcomes["not sent (time limit)"] += requests - j
                break
            images, prompts, expected = pool[(index * 31 + j) % len(pool)]
            start = time.perf_counter()
            try:
                got = remote(images, prompts)["digits"]
            except RewardError as exc:
                outcome = f"error: {str(exc)[:120]}"
            else:
                outcome = "match" if torch.allclose(got, expected, rtol=0, atol=1e-5) else "wrong scores"
            latencies.append(time.perf_counter() - start)
            with lock:
                outcomes[outcome] += 1
                if outcome != "match" and len(first_errors) < 5:
                    first_errors.append(outcome)
        return latencies

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as executor:
        latencies = sorted(t for per_client in executor.map(client, range(clients)) for t in per_client)
    wall = time.perf_counter() - start
    sent = len(latencies)

    def quantile(q: float) -> float:
        return latencies[min(sent - 1, int(q * sent))] * 1000 if sent else float("nan")

    return {"requests_sent": sent, "matches": outcomes["match"], "errors": sent - outcomes["match"], "outcomes": dict(outcomes),
            "first_errors": first_errors, "wall_seconds": round(wall, 2), "p50_ms": round(quantile(0.50), 2),
            "p99_ms": round(quantile(0.99), 2), "max_ms": round(latencies[-1] * 1000, 2) if sent else None,
            "requests_per_s": round(sent / wall, 1), "images_per_s": round(sent * len(pool[0][1]) / wall, 1)}


def machine() -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "uvicorn": version("uvicorn"), "starlette": version("starlette"), "commit": commit}


def run_attack_table(path: Path) -> dict:
    """The malformed-request table against an in-process server with ATTACK_LIMITS; written to ``path``."""
    token = secrets.token_hex(16)
    with RewardServer(build_reward("jpeg_compressibility"), port=0, token=token, **ATTACK_LIMITS) as server:
        rows, _ = run_attacks(server.url, token)
    summary = {"cases": len(rows), "ok": sum(r["ok"] and r["then_valid"] for r in rows),
               "statuses": dict(Counter(str(r["status"]) for r in rows)), "limits": ATTACK_LIMITS, "machine": machine(), "rows": rows}
    path.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32, help="concurrent client threads")
    parser.add_argument("--requests", type=int, default=200, help="requests per client")
    parser.add_argument("--images", type=int, default=4, help="16×16 images per request")
    parser.add_argument("--pool", type=int, default=256, help="distinct image sets (scored locally once)")
    parser.add_argument("--server-threads", type=int, default=1, help="torch threads of the server process")
    parser.add_argument("--max-seconds", type=float, default=600, help="stop sending after this long (unsent requests are reported)")
    parser.add_argument("--skip-attacks", action="store_true", help="do not run the malformed-request table")
    parser.add_argument("--out", type=Path, default=RESULTS / "reward_server_load.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    token = secrets.token_hex(16)
    pool = image_pool(args.pool, args.images, seed=0)
    proc, url = start_server(token, args.server_threads)
    try:
        load = run_load(url, token, pool, args.clients, args.requests, args.max_seconds)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    result = {"clients": args.clients, "requests_per_client": args.requests, "images_per_request": args.images, "image_size": "16x16",
              "reward": "digits", "server_threads": args.server_threads, **load, "machine": machine()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("| clients × requests | images/request | errors | p50 ms | p99 ms | requests/s | images/s | machine |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {args.clients} × {args.requests} | {args.images} (16×16) | {load['errors']} of {load['requests_sent']} | {load['p50_ms']} | "
          f"{load['p99_ms']} | {load['requests_per_s']} | {load['images_per_s']} | {os.cpu_count()}-core CPU, server + clients |")
    failed = load["errors"] or load["requests_sent"] < args.clients * args.requests
    if not args.skip_attacks:
        attacks = run_attack_table(RESULTS / "reward_server_attacks.json")
        print(f"attacks: {attacks['ok']}/{attacks['cases']} answered as expected, then a valid request scored; statuses {attacks['statuses']}")
        failed = failed or attacks["ok"] != attacks["cases"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
