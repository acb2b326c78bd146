"""``diffrl serve-reward``: serve any registered reward over HTTP (the ``remote`` reward is its client).

    diffrl serve-reward reward=<name> [reward.options.<key>=<value> ...] [--host 127.0.0.1] [--port 8765]
                        [--token T | --token-file F | $DIFFRL_REWARD_TOKEN | --no-token]

The wire protocol (JSON with base64 PNG images, bearer token, status codes) is documented in
:mod:`rewards.remote`. The server is the standard library's ``ThreadingHTTPServer``: each connection is
parsed, authenticated and decoded on its own thread, then handed to one scoring thread that merges
requests arriving within ``batch_wait_s`` of each other (same image size and metadata, up to
``max_batch`` images) into one reward call through :func:`rewards.base.call_reward` — so the reward's
``batch_size``/``input`` are honoured, its output is checked, and the model is never entered by two
threads at once. If a merged call fails, each request is re-run alone so that an error reaches only
the request that caused it. Every failure answers a JSON ``{"error": …}`` and the server keeps serving.
"""

from __future__ import annotations

import hmac
import json
import os
import queue
import sys
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from rewards.base import TOKEN_ENV, build_reward, call_reward, decode_png, reward_spec

DEFAULT_PORT = 8765


class _Job:
    """One request's images waiting for the scoring thread."""

    def __init__(self, images, prompts: list[str], metadata: Any):
        self.images, self.prompts, self.metadata = images, prompts, metadata
        self.done = threading.Event()
        self.result: dict | None = None
        self.error: BaseException | None = None


class _Batcher:
    """The single scoring thread: merges queued jobs into one reward call (see module docstring)."""

    def __init__(self, name: str, fn: Callable, max_batch: int, wait_s: float, stats: dict, lock: threading.Lock):
        self.name, self.fn, self.max_batch, self.wait_s = name, fn, max_batch, wait_s
        self.stats, self.lock = stats, lock
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=f"reward-{name}", daemon=True)
        self.thread.start()

    def submit(self, images, prompts: list[str], metadata: Any) -> dict:
        job = _Job(images, prompts, metadata)
        self.queue.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.result

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            jobs, count, stop = [job], len(job.prompts), False
            deadline = time.monotonic() + self.wait_s
            while count < self.max_batch:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    nxt = self.queue.get(timeout=remaining)
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                jobs.append(nxt)
                count += len(nxt.prompts)
            groups: dict[tuple, list[_Job]] = defaultdict(list)
            for j in jobs:
                groups[(tuple(j.images.shape[2:]), json.dumps(j.metadata, sort_keys=True))].append(j)
            for group in groups.values():
                self._run(group)
            if stop:
                return

    def _call(self, images, prompts, metadata) -> dict:

        with self.lock:
            self.stats["reward_calls"] += 1
        return call_reward(self.name, self.fn, images, prompts, metadata)

    def _run(self, group: list[_Job]) -> None:
        import torch

        if len(group) > 1:
            try:
                result = self._call(torch.cat([j.images for j in group]), [p for j in group for p in j.prompts], group[0].metadata)
            except Exception:  # attribute the error: re-run each request alone below
                pass
            else:
                start = 0
                for j in group:
                    stop = start + len(j.prompts)
                    j.result = {key: value[start:stop] for key, value in result.items()}
                    start = stop
                    j.done.set()
                return
        for j in group:
            try:
                j.result = self._call(j.images, j.prompts, j.metadata)
            except BaseException as exc:  # handed to the request's thread, which answers 500
                j.error = exc
            j.done.set()


class RewardServer:
    """An HTTP server for one reward callable.

    Args:
        reward: the reward (any callable of the reward protocol; its declared attributes are honoured).
        name: its name (default: ``reward.name``).
        host, port: where to listen (``port=0``: a free port; see :attr:`url`).
        token: the bearer token clients must send; ``None``: no authentication (trusted networks only).
        max_request_bytes: larger bodies answer 413 before they are read.
        max_images: most images in one request (400 beyond).
        max_batch: most images merged into one reward call (a larger single request runs alone).
        batch_wait_s: how long the scoring thread waits for more requests to merge.
        log_requests: log every request to stderr (errors are always logged).
    """

    def __init__(self, reward: Callable, *, name: str | None = None, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 token: str | None, max_request_bytes: int = 64 << 20, max_images: int = 1024, max_batch: int = 256,
                 batch_wait_s: float = 0.005, log_requests: bool = False):

        if token is not None and not token:
            raise ValueError("RewardServer: token is empty; give a non-empty token, or None to serve without authentication")
        self.name = name or getattr(reward, "name", None) or "reward"
        self.spec = reward_spec(reward, self.name)
        self.token = token
        self.max_request_bytes, self.max_images, self.log_requests = int(max_request_bytes), int(max_images), log_requests
        self.stats: dict[str, Any] = {"requests": 0, "images": 0, "reward_calls": 0, "errors": defaultdict(int)}
        self._lock = threading.Lock()
        handler = type("RewardRequestHandler", (_Handler,), {"app": self})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self._batcher = _Batcher(self.name, reward, max_batch, batch_wait_s, self.stats, self._lock)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def health(self) -> dict:
        return {"status": "ok", "protocol": 1, "reward": self.name, **{k: self.spec[k] for k in ("unit", "scale", "batch_size", "input")}}

    def start(self) -> "RewardServer":
        """Serve on a background thread (tests, notebooks); returns ``self``."""
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="reward-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def shutdown(self) -> None:
        """Stop accepting, close the socket and stop the scoring thread."""
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(timeout=10)
        self.httpd.server_close()
        self._batcher.stop()

    def __enter__(self) -> "RewardServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def score_body(self, body: Any) -> tuple[int, dict]:
        """Validate a decoded JSON body and score it: ``(status, answer)``."""

        if not isinstance(body, dict):
            return 400, {"error": f"the body must be a JSON object, got {type(body).__name__}"}
        unknown = set(body) - {"images", "prompts", "metadata", "reward"}
        if unknown:
            return 400, {"error": f"unknown fields {sorted(unknown)}; expected images, prompts, metadata, reward"}
        images, prompts = body.get("images"), body.get("prompts")
        if not isinstance(images, list) or not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            return 400, {"error": "the body needs 'images' (list of base64 PNG) and 'prompts' (list of str)"}
        if len(images) != len(prompts) or not images:
            return 400, {"error": f"got {len(images)} images and {len(prompts)} prompts; need the same number, at least 1"}
        if len(images) > self.max_images:
            return 400, {"error": f"{len(images)} images in one request; this server takes at most {self.max_images}"}
        wanted = body.get("reward")
        if wanted is not None and wanted != self.name:
            return 409, {"error": f"this server serves reward {self.name!r}, not {wanted!r}"}
        try:
            decoded = [decode_png(text) for text in images]
        except ValueError as exc:
            return 400, {"error": str(exc)}
        if len({tuple(im.shape) for im in decoded}) > 1:
            return 400, {"error": f"images have different sizes {sorted({tuple(im.shape) for im in decoded})}; send one size per request"}
        import torch

        try:
            result = self._batcher.submit(torch.stack(decoded), prompts, body.get("metadata"))
        except Exception as exc:
            return 500, {"error": f"reward {self.name!r} failed: {type(exc).__name__}: {exc}"}
        main = self.name if self.name in result else next(iter(result))
        scores = {main: result[main].tolist(), **{k: v.tolist() for k, v in result.items() if k != main}}
        with self._lock:
            self.stats["images"] += len(prompts)
        return 200, {"reward": self.name, "scores": scores}


class _Handler(BaseHTTPRequestHandler):
    app: RewardServer
    server_version = "diffrl-reward/1"
    timeout = 120  # seconds a client may stall mid-request before its connection is dropped

    def _send(self, status: int, answer: dict) -> None:
        data = json.dumps(answer).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        with self.app._lock:
            self.app.stats["requests"] += 1
            if status >= 400:
                self.app.stats["errors"][status] += 1

    def _drain(self, length: int) -> None:
        """Read (and drop) up to ``length`` unread body bytes so that the client sees our answer, not a reset."""
        self.connection.settimeout(1.0)
        try:
            while length > 0:
                chunk = self.rfile.read(min(length, 1 << 16))
                if not chunk:
                    break
                length -= len(chunk)
        except OSError:
            pass

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        if self.path.rstrip("/") == "/health":
            self._send(200, self.app.health())
        else:
            self._send(404, {"error": f"unknown path {self.path!r}; use GET /health or POST /score"})

    def do_POST(self) -> None:  # noqa: N802
        self.close_connection = True
        try:
            length = int(self.headers.get("Content-Length", ""))
            if length < 0:
                raise ValueError
        except ValueError:
            self._send(400, {"error": "a Content-Length header is required"})
            return
        if self.path.rstrip("/") != "/score":
            self._drain(min(length, self.app.max_request_bytes))
            self._send(404, {"error": f"unknown path {self.path!r}; use POST /score"})
            return
        if self.app.token is not None:
            sent = self.headers.get("Authorization", "")
            if not sent.startswith("Bearer ") or not hmac.compare_digest(sent[7:].encode(), self.app.token.encode()):
                self._drain(min(length, self.app.max_request_bytes))
                self._send(401, {"error": "missing or wrong bearer token (header 'Authorization: Bearer <token>')"})
                return
        if length > self.app.max_request_bytes:
            self._drain(min(length, 16 << 20))
            self._send(413, {"error": f"request body of {length} bytes exceeds this server's limit of {self.app.max_request_bytes} bytes; "
                                      "send fewer images per request (client option batch_size) or raise --max-request-mb"})
            return
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw)
        except ValueError as exc:
            self._send(400, {"error": f"the body is not valid JSON ({exc})"})
            return
        status, answer = self.app.score_body(body)
        self._send(status, answer)

    def log_request(self, code: Any = "-", size: Any = "-") -> None:
        if self.app.log_requests or (isinstance(code, int) and code >= 400):
            super().log_request(code, size)


def parse_reward_args(items: list[str]) -> tuple[str, dict]:
    """``["reward=jpeg_compressibility", "reward.options.quality=80"]`` → ``("jpeg_compressibility", {"quality": 80})``.

    Options are ``reward.options.<key>=<value>`` or, as in training configs, ``reward.options.<name>.<key>=<value>``;
    values are parsed as YAML (``80`` → int, ``null`` → None, ``[1, 2]`` → list, other text → str).
    """
    import yaml

    name, raw_options = None, []
    for item in items:
        key, sep, value = item.partition("=")
        key = key.lstrip("+")  # accept hydra's +key= / ++key= spellings too
        if not sep:
            raise ValueError(f"serve-reward: argument {item!r} is not key=value; use reward=<name> reward.options.<key>=<value>")
        if key == "reward":
            name = value
        elif key.startswith("reward.options.") and len(key) > len("reward.options."):
            raw_options.append((key[len("reward.options."):].split("."), value))
        else:
            raise ValueError(f"serve-reward: unknown key {key!r}; use reward=<name> and reward.options.<key>=<value>")
    if not name:
        raise ValueError("serve-reward: give the reward to serve as reward=<name> (a registered name, entry point or module:Class)")
    options: dict = {}
    for path, value in raw_options:
        if len(path) == 2 and path[0] == name:
            path = path[1:]
        if len(path) != 1:
            raise ValueError(f"serve-reward: option {'.'.join(path)!r} is nested; use reward.options.<key>=<value>")
        try:
            options[path[0]] = yaml.safe_load(value) if value != "" else ""
        except yaml.YAMLError:
            options[path[0]] = value
    return name, options


def _serve(args) -> int:

    name, options = parse_reward_args(args.overrides)
    if args.token_file:
        with open(args.token_file, encoding="utf-8") as handle:
            token = handle.read().strip()
    else:
        token = args.token or os.environ.get(TOKEN_ENV)
    if args.no_token:
        token = None
    elif not token:
        raise ValueError(f"serve-reward: give a bearer token (--token, --token-file or ${TOKEN_ENV}), or --no-token to serve without one")
    reward = build_reward(name, **options)
    try:
        server = RewardServer(reward, name=name, host=args.host, port=args.port, token=token, max_request_bytes=int(args.max_request_mb * (1 << 20)),
                              max_images=args.max_images, max_batch=args.max_batch, batch_wait_s=args.batch_wait_ms / 1000.0,
                              log_requests=args.log_requests)
    except OSError as exc:
        raise ValueError(f"serve-reward: cannot listen on {args.host}:{args.port} ({exc.strerror or exc}); choose another --port or --host") from exc
    auth = "bearer token required" if token else "NO authentication"
    print(f"diffrl serve-reward: serving {name!r} (unit {server.spec['unit']}) at {server.url} — POST /score, GET /health; {auth}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("diffrl serve-reward: stopped", file=sys.stderr, flush=True)
    finally:
        server.httpd.server_close()
    return 0


def add_parsers(sub) -> dict:
    """Add ``serve-reward`` to ``sub``; return ``{name: handler(args) -> exit status}``."""
    p = sub.add_parser("serve-reward", help="serve a registered reward over HTTP",
                       description="serve a registered reward over HTTP (JSON + base64 PNG, bearer token); the 'remote' reward is the client")
    p.add_argument("overrides", nargs="*", help="reward=<name> and reward.options.<key>=<value>")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: a free one, printed)")
    p.add_argument("--token", default=None, help="bearer token clients must send (default: $DIFFRL_REWARD_TOKEN)")
    p.add_argument("--token-file", default=None, help="read the token from this file (keeps it out of the process list)")
    p.add_argument("--no-token", action="store_true", help="serve without authentication (trusted networks only)")
    p.add_argument("--max-request-mb", type=float, default=64.0, help="largest request body in MiB (413 beyond)")
    p.add_argument("--max-images", type=int, default=1024, help="most images in one request (400 beyond)")
    p.add_argument("--max-batch", type=int, default=256, help="most images merged from concurrent requests into one reward call")
    p.add_argument("--batch-wait-ms", type=float, default=5.0, help="how long to wait for concurrent requests to merge")
    p.add_argument("--log-requests", action="store_true", help="log every request (errors are always logged)")
    return {"serve-reward": _serve}
