"""``diffrl serve-reward``: serve any registered reward over HTTP (the ``remote`` reward is its client).

    diffrl serve-reward reward=<name> [reward.options.<key>=<value> ...] [--host 127.0.0.1] [--port 8765]
                        [--token-file F | $DIFFRL_REWARD_TOKEN | --no-token (loopback only)] [limits, see --help]

The wire protocol (JSON with base64 PNG images, bearer token, status codes) is documented in
:mod:`rewards.remote`. HTTP is served by uvicorn (h11) with a starlette app on one event loop. A request
is authenticated, checked against :class:`ServerLimits` (body bytes, images, pixels read from each PNG
header before any pixel is decoded), read under a deadline, then parsed and decoded on a worker thread
and handed to one scoring thread that merges requests arriving within ``batch_wait_s`` of each other
(same image size and metadata, up to ``max_batch`` images) into one reward call through
:func:`rewards.base.call_reward` — so the reward's ``batch_size``/``input`` are honoured, its output is
checked, and the model is never entered by two threads at once. If a merged call fails, each request is
re-run alone so that an error reaches only the request that caused it: 422 when the reward refused the
request's input (it raised ``ValueError``: a prompt outside its grammar, an image it cannot read), 500 for
any other failure. Every failure answers a JSON ``{"error": …}`` and the server keeps serving; slow or idle
clients are cut by the timeouts below, and a request head (request line and headers) over
:data:`MAX_HEADER_BYTES` gets 400 on every route.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import io
import ipaddress
import json
import os
import queue
import socket
import struct
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import uvicorn
import yaml
from PIL import Image
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from rewards.base import TOKEN_ENV, build_reward, call_reward, reward_spec

if TYPE_CHECKING:
    from typing_extensions import Self

DEFAULT_PORT = 8765
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_HEADER_BYTES = 16 << 10
"""Largest request head (request line and headers). h11 refuses a longer head that arrives in pieces (uvicorn's
plain-text 400); one that arrives whole is parsed, so the app checks its size too (JSON 400) on every route."""
MAX_ERROR_CHARS = 2000
"""A reward's error message longer than this (one that quotes a 10,000-character prompt) is cut in the middle."""


def _doc(text: str, default: Any) -> Any:
    return field(default=default, metadata={"doc": text})


@dataclass(kw_only=True)
class ServerLimits:
    """What clients may cost the server; every limit answers a JSON error and the server keeps serving.

    Memory held by requests is bounded by about ``max_inflight · (3 · max_request_bytes + 3 · max_request_pixels)``
    bytes (body, its JSON strings and decoded PNG bytes; uint8 RGB pixels); slow or idle connections by the timeouts.
    """

    max_request_bytes: int = _doc("largest request body (413 beyond; a larger Content-Length is refused unread)", 64 << 20)
    max_images: int = _doc("most images in one request (413 beyond)", 1024)
    max_image_pixels: int = _doc("most pixels of one image, read from its PNG header before decoding (413 beyond)", 4096 * 4096)
    max_request_pixels: int = _doc("most pixels of all images of one request, checked before any is decoded (413 beyond)", 1 << 26)
    max_batch: int = _doc("most images merged from concurrent requests into one reward call", 256)
    batch_wait_s: float = _doc("how long the scoring thread waits for more requests to merge", 0.005)
    max_inflight: int = _doc("requests read, decoded and scored at once; more wait up to queue_timeout_s, then 503", 16)
    queue_timeout_s: float = _doc("how long a request waits for one of the max_inflight slots before 503", 30.0)
    max_connections: int = _doc("open connections (and requests in progress) before uvicorn answers 503", 256)
    body_timeout_s: float = _doc("seconds to receive a whole request body (408 and the connection closed beyond)", 60.0)
    header_timeout_s: float = _doc("seconds from connecting, or from the last answer, to a request's complete headers (closed beyond)", 10.0)
    keep_alive_s: float = _doc("an idle keep-alive connection is closed after this many seconds", 5.0)
    shutdown_timeout_s: float = _doc("on shutdown, requests in progress get this long to finish before they are cancelled", 30.0)

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"RewardServer: {f.name} must be > 0, got {getattr(self, f.name)!r}")


class _Reject(Exception):
    """An answer other than 200: ``status``, the reason sent as ``{"error": reason}``, and whether to close."""

    def __init__(self, status: int, reason: str, *, close: bool = False, headers: dict | None = None):
        super().__init__(reason)
        self.status, self.reason, self.close, self.headers = status, reason, close, headers or {}


# -- the scoring thread ------------------------------------------------------------------------------------

class _Job:
    """One request's images waiting for the scoring thread; ``future`` gets its scores or its error."""

    def __init__(self, images: torch.Tensor, prompts: list[str], metadata: Any):
        self.images, self.prompts, self.metadata = images, prompts, metadata
        self.future: Future = Future()


class _Batcher:
    """The single scoring thread: merges queued jobs into one reward call (see module docstring)."""

    def __init__(self, name: str, fn: Callable, max_batch: int, wait_s: float, stats: dict, lock: threading.Lock):
        self.name, self.fn, self.max_batch, self.wait_s = name, fn, max_batch, wait_s
        self.stats, self.lock = stats, lock
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=f"reward-{name}", daemon=True)
        self.thread.start()

    def submit(self, images: torch.Tensor, prompts: list[str], metadata: Any) -> Future:
        job = _Job(images, prompts, metadata)
        self.queue.put(job)
        return job.future

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
                groups[(tuple(j.images.shape[1:]), json.dumps(j.metadata, sort_keys=True))].append(j)
            for group in groups.values():
                self._run(group)
            if stop:
                return

    def _call(self, images: torch.Tensor, prompts: list[str], metadata: Any) -> dict:
        with self.lock:
            self.stats["reward_calls"] += 1
        return call_reward(self.name, self.fn, images, prompts, metadata)

    def _run(self, group: list[_Job]) -> None:
        if len(group) > 1:
            try:
                result = self._call(torch.cat([j.images for j in group]), [p for j in group for p in j.prompts], group[0].metadata)
            except Exception:  # noqa: BLE001, S110 (attribute the error: each request is re-run alone below)
                pass
            else:
                start = 0
                for j in group:
                    stop = start + len(j.prompts)
                    j.future.set_result({key: value[start:stop] for key, value in result.items()})
                    start = stop
                return
        for j in group:
            try:
                j.future.set_result(self._call(j.images, j.prompts, j.metadata))
            except BaseException as exc:  # noqa: BLE001 (handed to the request, which answers 422 or 500)
                j.future.set_exception(exc if isinstance(exc, Exception) else RuntimeError(f"{type(exc).__name__}: {exc}"))


# -- the body: JSON fields and PNG images within the limits ---------------------------------------------

def png_size(data: bytes, index: int) -> tuple[int, int]:
    """``(width, height)`` from a PNG's IHDR chunk, read without decoding a pixel."""
    if not data.startswith(PNG_SIGNATURE):
        raise _Reject(400, f"image {index} is not a PNG (send PNG, lossless; JPEG would change the pixels)")
    if len(data) < 33 or data[12:16] != b"IHDR":
        raise _Reject(400, f"image {index} is a corrupt PNG (its first chunk is not a complete IHDR header)")
    width, height = struct.unpack(">II", data[16:24])
    if not width or not height:
        raise _Reject(400, f"image {index} is a corrupt PNG (its header says {width}x{height} pixels)")
    return width, height


def decode_images(texts: list, limits: ServerLimits) -> torch.Tensor:
    """base64 PNGs → uint8 ``[B, 3, H, W]``; every size limit is checked on the PNG headers before decoding."""
    blobs = []
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise _Reject(400, f"image {i} must be a base64 PNG string, got {type(text).__name__}")
        try:
            blobs.append(base64.b64decode(text, validate=True))
        except ValueError as exc:
            raise _Reject(400, f"image {i} is not valid base64 ({exc})") from None
    sizes = [png_size(blob, i) for i, blob in enumerate(blobs)]
    if len(set(sizes)) > 1:
        raise _Reject(400, f"images have different sizes {sorted(set(sizes))} (width, height); send one size per request")
    width, height = sizes[0]
    per_image = min(limits.max_image_pixels, Image.MAX_IMAGE_PIXELS or limits.max_image_pixels)  # PIL's bomb limit too
    if width * height > per_image:
        raise _Reject(413, f"images of {width}x{height} pixels exceed this server's limit of {per_image} pixels per image (--max-image-pixels)")
    if width * height * len(blobs) > limits.max_request_pixels:
        raise _Reject(413, f"{len(blobs)} images of {width}x{height} exceed this server's limit of {limits.max_request_pixels} pixels per "
                           "request; send fewer images per request (client option batch_size) or raise --max-request-pixels")
    out = np.empty((len(blobs), height, width, 3), dtype=np.uint8)
    for i, blob in enumerate(blobs):
        try:
            with Image.open(io.BytesIO(blob), formats=["PNG"]) as im:
                if im.size != (width, height):
                    raise _Reject(400, f"image {i} is a corrupt PNG (decoder size {im.size} differs from its header)")
                out[i] = np.asarray(im.convert("RGB"))
        except Image.DecompressionBombError as exc:
            raise _Reject(413, f"image {i} is over PIL's decompression-bomb limit ({exc})") from None
        except _Reject:
            raise
        except Exception as exc:  # noqa: BLE001 (any decoder failure on client bytes is a malformed request)
            raise _Reject(400, f"image {i} is a corrupt PNG ({type(exc).__name__}: {exc})") from None
    return torch.from_numpy(out).permute(0, 3, 1, 2).contiguous()


def head_bytes(scope: dict) -> int:
    """Bytes of an HTTP request's head as sent: ``METHOD target HTTP/x\\r\\n``, each ``name: value\\r\\n``, the blank line."""
    target = len(scope.get("raw_path") or scope["path"].encode("utf-8")) + (1 + len(scope["query_string"]) if scope.get("query_string") else 0)
    line = len(scope["method"]) + 1 + target + len(f" HTTP/{scope.get('http_version', '1.1')}\r\n")
    return line + sum(len(name) + len(value) + 4 for name, value in scope["headers"]) + 2


def _clip(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text``, or its start and end around a note of how much was left out when it is longer than ``limit``."""
    if len(text) <= limit:
        return text
    head, tail = limit * 2 // 3, limit // 3
    return f"{text[:head]} … ({len(text) - head - tail} characters left out) … {text[-tail:]}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()


class _GuardedH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on request headers: a connection that has not sent a
    request's complete headers ``header_timeout_s`` after connecting (or after its last answer) is closed,
    so clients that trickle headers, or an endless body after an early answer, cannot hold a connection."""

    header_timeout_s = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._header_deadline_passed)

    def _header_deadline_passed(self) -> None:
        idle = self.cycle is None or self.cycle.response_complete
        if idle and not self.transport.is_closing():
            self.transport.close()


# -- the server ---------------------------------------------------------------------------------------------

class RewardServer:
    """An HTTP server for one reward callable.

    Args:
        reward: the reward (any callable of the reward protocol; its declared attributes are honoured).
        name: its name (default: ``reward.name``).
        host, port: where to listen (``port=0``: a free port; see :attr:`url`). The socket is bound here.
        token: the bearer token clients must send; ``None``: no authentication (loopback hosts only).
        log_requests: log every request to stderr (errors are always logged).
        **limits: fields of :class:`ServerLimits` (``max_request_bytes``, ``max_batch``, ``body_timeout_s``, …).
    """

    def __init__(self, reward: Callable, *, name: str | None = None, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
                 token: str | None, log_requests: bool = False, **limits: Any):
        if token is not None and not token:
            raise ValueError("RewardServer: token is empty; give a non-empty token, or None to serve without authentication")
        if token is None and not _is_loopback(host):
            raise ValueError(f"RewardServer: serving without a token is allowed on a loopback host only, not {host!r}; give a token")
        self.limits = ServerLimits(**limits)
        self.name = name or getattr(reward, "name", None) or "reward"
        self.spec = reward_spec(reward, self.name)
        self.token, self.log_requests = token, log_requests
        self._token_digest = _digest(token) if token is not None else None
        self.stats: dict[str, Any] = {"requests": 0, "images": 0, "reward_calls": 0, "errors": defaultdict(int)}
        self._lock = threading.Lock()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host.strip("[]"), port), family=family, backlog=1024)  # OSError: the caller says why
        self._slots = asyncio.Semaphore(self.limits.max_inflight)
        self._app = Starlette(routes=[Route("/health", self._health, methods=["GET"]), Route("/score", self._score, methods=["POST"])],
                              exception_handlers={HTTPException: self._http_error, Exception: self._crash})
        self._app.router.redirect_slashes = False
        protocol = type("RewardServerHTTP", (_GuardedH11,), {"header_timeout_s": self.limits.header_timeout_s})
        config = uvicorn.Config(self._checked_head, interface="asgi3", http=protocol, lifespan="off", log_config=None, log_level="warning",
                                access_log=False, proxy_headers=False, server_header=False, headers=[("server", "diffrl-reward/1")],
                                h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                                limit_concurrency=self.limits.max_connections, timeout_keep_alive=self.limits.keep_alive_s,
                                timeout_graceful_shutdown=self.limits.shutdown_timeout_s)
        self._uvicorn = uvicorn.Server(config)
        self._batcher = _Batcher(self.name, reward, self.limits.max_batch, self.limits.batch_wait_s, self.stats, self._lock)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._socket.getsockname()[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def health(self) -> dict:
        return {"status": "ok", "protocol": 1, "reward": self.name, **{k: self.spec[k] for k in ("unit", "scale", "batch_size", "input")}}

    def start(self) -> Self:
        """Serve on a background thread (tests, notebooks); returns ``self`` once uvicorn accepts requests."""
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [self._socket]}, name="reward-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("RewardServer: uvicorn did not start (see the log above); check the host and port")
            time.sleep(0.005)
        return self

    def serve_forever(self) -> None:
        """Serve on this thread until SIGINT/SIGTERM, then shut down gracefully (uvicorn's signal handling)."""
        self._uvicorn.run(sockets=[self._socket])

    def shutdown(self) -> None:
        """Stop accepting, let requests in progress finish (``shutdown_timeout_s``), stop the scoring thread."""
        if self._thread is not None:
            self._uvicorn.should_exit = True
            self._thread.join(timeout=self.limits.shutdown_timeout_s + 5)
        self._socket.close()
        self._batcher.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- the app (runs on uvicorn's event loop) --

    def _answer(self, request: Request, status: int, answer: dict, *, close: bool = False, headers: dict | None = None) -> Response:
        with self._lock:
            self.stats["requests"] += 1
            if status >= 400:
                self.stats["errors"][status] += 1
        if self.log_requests or status >= 400:
            client = request.client.host if request.client else "-"
            detail = f" {answer['error']}" if status >= 400 else ""
            print(f"{client} - [{time.strftime('%H:%M:%S')}] \"{request.method} {request.url.path}\" {status}{detail}", file=sys.stderr, flush=True)
        headers = {**(headers or {}), **({"Connection": "close"} if close else {})}
        return Response(json.dumps(answer).encode("utf-8"), status, headers=headers, media_type="application/json")

    async def _checked_head(self, scope: dict, receive: Callable, send: Callable) -> None:
        """The ASGI app uvicorn runs: a request whose head is over :data:`MAX_HEADER_BYTES` gets 400 (whatever its
        route) and its connection is closed; any other goes to the starlette app."""
        if scope["type"] == "http":
            size = head_bytes(scope)
            if size > MAX_HEADER_BYTES:
                response = self._answer(Request(scope), 400, {"error": f"the request headers take {size} bytes, over this server's limit of "
                                                                       f"{MAX_HEADER_BYTES} bytes; send shorter headers"}, close=True)
                await response(scope, receive, send)
                return
        await self._app(scope, receive, send)

    async def _health(self, request: Request) -> Response:
        return self._answer(request, 200, self.health())

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        where = "unknown path" if exc.status_code == 404 else f"method {request.method} not allowed on"
        return self._answer(request, exc.status_code, {"error": f"{where} {request.url.path!r}; use GET /health or POST /score"},
                            headers=exc.headers)

    async def _crash(self, request: Request, exc: Exception) -> Response:
        return self._answer(request, 500, {"error": f"the reward server failed: {type(exc).__name__}: {exc}"})

    async def _score(self, request: Request) -> Response:
        try:
            return self._answer(request, 200, await self._score_checked(request))
        except _Reject as exc:
            return self._answer(request, exc.status, {"error": exc.reason}, close=exc.close, headers=exc.headers)

    async def _score_checked(self, request: Request) -> dict:
        limits, headers = self.limits, request.headers
        if self._token_digest is not None:
            scheme, _, sent = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(_digest(sent.strip()), self._token_digest):
                raise _Reject(401, "missing or wrong bearer token (header 'Authorization: Bearer <token>')")
        length = headers.get("content-length")
        if length is not None and int(length) > limits.max_request_bytes:  # h11 has checked it is a number
            raise _Reject(413, f"request body of {length} bytes exceeds this server's limit of {limits.max_request_bytes} bytes; "
                               "send fewer images per request (client option batch_size) or raise --max-request-mb")
        if headers.get("content-type", "").partition(";")[0].strip().lower() != "application/json":
            raise _Reject(415, f"content type {headers.get('content-type')!r}; send the body as 'Content-Type: application/json'")
        try:
            await asyncio.wait_for(self._slots.acquire(), limits.queue_timeout_s)
        except asyncio.TimeoutError:
            raise _Reject(503, f"the server is busy ({limits.max_inflight} requests in progress for {limits.queue_timeout_s} s); retry later",
                          headers={"Retry-After": "1"}) from None
        try:
            try:
                raw = await asyncio.wait_for(self._read_body(request), limits.body_timeout_s)
            except asyncio.TimeoutError:
                raise _Reject(408, f"the request body did not arrive within {limits.body_timeout_s} s; send it at once", close=True) from None
            except ClientDisconnect:
                raise _Reject(400, "the client disconnected before sending the whole body") from None
            images, prompts, metadata = await run_in_threadpool(self.parse_body, raw)
            try:
                result = await asyncio.wrap_future(self._batcher.submit(images, prompts, metadata))
            except ValueError as exc:  # the reward refused this request's prompts or images: the client's input, not a fault here
                raise _Reject(422, f"reward {self.name!r} rejected the request: {type(exc).__name__}: {_clip(str(exc))}") from None
            except Exception as exc:  # noqa: BLE001 (any other error of the reward is reported to its request)
                raise _Reject(500, f"reward {self.name!r} failed: {type(exc).__name__}: {_clip(str(exc))}") from None
        finally:
            self._slots.release()
        main = self.name if self.name in result else next(iter(result))
        scores = {main: result[main].tolist(), **{k: v.tolist() for k, v in result.items() if k != main}}
        with self._lock:
            self.stats["images"] += len(prompts)
        return {"reward": self.name, "scores": scores}

    async def _read_body(self, request: Request) -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.limits.max_request_bytes:
                raise _Reject(413, f"request body exceeds this server's limit of {self.limits.max_request_bytes} bytes; "
                                   "send fewer images per request (client option batch_size) or raise --max-request-mb")
            chunks.append(chunk)
        return b"".join(chunks)

    def parse_body(self, raw: bytes) -> tuple[torch.Tensor, list[str], Any]:
        """Check a request body and decode its images (a worker thread): ``(images, prompts, metadata)``; ``_Reject`` if bad."""
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise _Reject(400, f"the body is not valid JSON ({exc})") from None
        if not isinstance(body, dict):
            raise _Reject(400, f"the body must be a JSON object, got {type(body).__name__}")
        unknown = set(body) - {"images", "prompts", "metadata", "reward"}
        if unknown:
            raise _Reject(400, f"unknown fields {sorted(unknown)}; expected images, prompts, metadata, reward")
        images, prompts = body.get("images"), body.get("prompts")
        if not isinstance(images, list) or not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise _Reject(400, "the body needs 'images' (list of base64 PNG) and 'prompts' (list of str)")
        if len(images) != len(prompts) or not images:
            raise _Reject(400, f"got {len(images)} images and {len(prompts)} prompts; need the same number, at least 1")
        if len(images) > self.limits.max_images:
            raise _Reject(413, f"{len(images)} images in one request; this server takes at most {self.limits.max_images} (--max-images)")
        wanted, metadata = body.get("reward"), body.get("metadata")
        if wanted is not None and not isinstance(wanted, str):
            raise _Reject(400, f"'reward' must be the expected reward's name or null, got {type(wanted).__name__}")
        if wanted is not None and wanted != self.name:
            raise _Reject(409, f"this server serves reward {self.name!r}, not {wanted!r}")
        if metadata is not None and not isinstance(metadata, (dict, list)):
            raise _Reject(400, f"'metadata' must be a JSON object, a list (one entry per image) or null, got {type(metadata).__name__}")
        return decode_images(images, self.limits), prompts, metadata


# -- the command line ---------------------------------------------------------------------------------------

def parse_reward_args(items: list[str]) -> tuple[str, dict]:
    """``["reward=jpeg_compressibility", "reward.options.quality=80"]`` → ``("jpeg_compressibility", {"quality": 80})``.

    Options are ``reward.options.<key>=<value>`` or, as in training configs, ``reward.options.<name>.<key>=<value>``;
    values are parsed as YAML (``80`` → int, ``null`` → None, ``[1, 2]`` → list, other text → str).
    """
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


def _token(args) -> str | None:
    """The bearer token from --token-file or $DIFFRL_REWARD_TOKEN (never argv: ``ps`` shows it to every user)."""
    if args.token is not None:
        raise ValueError(f"serve-reward: --token is refused (the process list shows it to every user); use --token-file F or ${TOKEN_ENV}")
    if args.no_token:
        if not _is_loopback(args.host):
            raise ValueError(f"serve-reward: --no-token is allowed on a loopback --host only, not {args.host!r}; "
                             f"give a token with --token-file F or ${TOKEN_ENV}")
        return None
    if args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as handle:
                token = handle.read().strip()
        except OSError as exc:
            raise ValueError(f"serve-reward: cannot read --token-file {args.token_file!r} ({exc.strerror or exc}); check the path") from exc
        if not token:
            raise ValueError(f"serve-reward: --token-file {args.token_file!r} is empty; write the token into it")
        return token
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise ValueError(f"serve-reward: give a bearer token (--token-file F or ${TOKEN_ENV}), or --no-token on a loopback --host")
    return token


_FLAGS = {  # flag → (ServerLimits field, the field's value of one flag unit)
    "--max-request-mb": ("max_request_bytes", 1 << 20), "--max-images": ("max_images", 1), "--max-image-pixels": ("max_image_pixels", 1),
    "--max-request-pixels": ("max_request_pixels", 1), "--max-batch": ("max_batch", 1), "--batch-wait-ms": ("batch_wait_s", 1e-3),
    "--max-inflight": ("max_inflight", 1), "--queue-timeout-s": ("queue_timeout_s", 1), "--max-connections": ("max_connections", 1),
    "--body-timeout-s": ("body_timeout_s", 1), "--header-timeout-s": ("header_timeout_s", 1), "--keep-alive-s": ("keep_alive_s", 1),
    "--shutdown-timeout-s": ("shutdown_timeout_s", 1),
}


def _serve(args) -> int:
    token = _token(args)
    name, options = parse_reward_args(args.overrides)
    reward = build_reward(name, **options)
    limits = {}
    for flag, (key, unit) in _FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_")) * unit
        limits[key] = int(value) if isinstance(getattr(ServerLimits, key), int) else float(value)
    try:
        server = RewardServer(reward, name=name, host=args.host, port=args.port, token=token, log_requests=args.log_requests, **limits)
    except OSError as exc:
        raise ValueError(f"serve-reward: cannot listen on {args.host}:{args.port} ({exc.strerror or exc}); choose another --port or --host") from exc
    auth = "bearer token required" if token else "NO authentication (loopback only)"
    print(f"diffrl serve-reward: serving {name!r} (unit {server.spec['unit']}) at {server.url} — POST /score, GET /health; {auth}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("diffrl serve-reward: stopped", file=sys.stderr, flush=True)
    finally:
        server.shutdown()
    return 0


def add_parsers(sub) -> dict:
    """Add ``serve-reward`` to ``sub``; return ``{name: handler(args) -> exit status}``."""
    p = sub.add_parser("serve-reward", help="serve a registered reward over HTTP",
                       description="serve a registered reward over HTTP (JSON + base64 PNG, bearer token); the 'remote' reward is the client")
    p.add_argument("overrides", nargs="*", help="reward=<name> and reward.options.<key>=<value>")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: a free one, printed)")
    p.add_argument("--token", default=None, help="refused: argv is visible in the process list; use --token-file or $" + TOKEN_ENV)
    p.add_argument("--token-file", default=None, help=f"read the bearer token from this file (default: ${TOKEN_ENV})")
    p.add_argument("--no-token", action="store_true", help="serve without authentication (loopback --host only)")
    docs = {f.name: f.metadata["doc"] for f in fields(ServerLimits)}
    for flag, (key, unit) in _FLAGS.items():
        default = getattr(ServerLimits, key) / unit
        kind = int if isinstance(getattr(ServerLimits, key), int) and unit == 1 else float
        shown = f"{default:g}" if kind is float else str(int(default))
        p.add_argument(flag, type=kind, default=kind(default), help=f"{docs[key]} (default {shown})")
    p.add_argument("--log-requests", action="store_true", help="log every request (errors are always logged)")
    return {"serve-reward": _serve}
