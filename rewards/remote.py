"""``remote``: a reward served over HTTP by ``diffrl serve-reward`` (:mod:`diffrl.tools.reward_server`).

Wire protocol (JSON, UTF-8; images as base64 PNG, never pickle):

* ``GET /health`` → ``200 {"status": "ok", "reward": name, "unit", "scale", "batch_size", "input", "protocol": 1}``
  (no token needed: it reveals nothing but the reward's declaration).
* ``POST /score`` with ``Authorization: Bearer <token>``, ``Content-Type: application/json`` and body
  ``{"images": [base64 PNG, …], "prompts": [str, …], "metadata": <object, list or null>, "reward": <name or null>}``
  → ``200 {"reward": name, "scores": {key: [float, …], …}}``, the main output's key first.
* Errors answer ``{"error": message}`` with 400 (malformed body or image), 401 (missing or wrong token),
  404 (unknown path), 405 (wrong method), 408 (the body did not arrive within the server's body timeout;
  the connection is closed), 409 (``reward`` names another reward than the one served), 413 (over a size
  limit: body bytes, images per request, pixels per image or per request — pixels are read from the PNG
  headers before decoding), 415 (not ``application/json``), 422 (the reward refused the request's input:
  it raised ``ValueError``, e.g. a prompt outside its grammar or an image it cannot read; message included),
  500 (the reward failed otherwise; message included), 503 (busy: all request slots taken, ``Retry-After``;
  or, as plain text from uvicorn, too many connections). Request headers over 16 KiB get 400 on every route;
  malformed HTTP gets uvicorn's plain-text 400. The server keeps serving after each.

The client :class:`RemoteReward` sends at most ``batch_size`` images per request (``concurrency``
requests at a time), waits ``timeout`` seconds per socket operation and ``attempt_timeout`` for a whole
attempt, and retries connection failures, timeouts and 408/502/503/504 answers up to ``retries`` times,
sleeping ``backoff · 2^k`` before retry ``k``; then it raises :class:`~rewards.base.RewardError` naming the
server. Any other 4xx (422 included) or a 500 is not retried (the same request would fail again) and raises
at once with the server's message, as does an answer that does not hold one number per image.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import ipaddress
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPException
from typing import TYPE_CHECKING, Any

import torch

from rewards.base import (  # noqa: F401  (the wire format)
    TOKEN_ENV,
    Reward,
    RewardError,
    decode_png,
    encode_png,
    from_pil,
    register_reward,
    slice_metadata,
)

if TYPE_CHECKING:
    from typing_extensions import Self

PROTOCOL = 1
RETRY_STATUSES = (408, 502, 503, 504)
MAX_ANSWER_BYTES = 64 << 20  # an answer longer than this is not a reward server's


def as_uint8(images: Any) -> torch.Tensor:
    """A uint8 ``[B, 3, H, W]`` tensor as is, or a list of PIL images converted to one."""
    if isinstance(images, torch.Tensor):
        if images.dtype != torch.uint8 or images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"expected uint8 images [B, 3, H, W], got {images.dtype} {tuple(images.shape)}")
        return images
    return from_pil(list(images))


def _is_loopback(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Answer(Exception):
    """A non-2xx HTTP answer: ``status`` and the server's message."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


class _Deadline:
    """Shuts the sockets of one attempt down once it has taken ``seconds`` in all.

    ``timeout`` bounds each socket operation only, so a server that trickles its answer a byte at a time
    would hold the client forever; this bounds the whole attempt (connect, send, wait, read).
    """

    def __init__(self, seconds: float):
        self.seconds, self.passed = seconds, False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> Self:
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            if self.passed:
                _shut(sock)

    def _expire(self) -> None:
        with self._lock:
            self.passed = True
            for sock in self._sockets:
                _shut(sock)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv/send on it
    except OSError:
        pass


class _Watched:
    """Mixin for ``http.client`` connections: the deadline watches the socket once connected."""

    def __init__(self, *args, deadline: _Deadline, **kwargs):
        super().__init__(*args, **kwargs)
        self.deadline = deadline

    def connect(self) -> None:
        super().connect()
        self.deadline.watch(self.sock)


class _WatchedHTTP(_Watched, http.client.HTTPConnection):
    pass


class _WatchedHTTPS(_Watched, http.client.HTTPSConnection):
    pass


class _WatchedHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_WatchedHTTP, deadline=self.deadline), req)


class _WatchedHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_WatchedHTTPS, deadline=self.deadline), req, context=self._context)


def _exchange(request: urllib.request.Request, *, timeout: float, deadline: _Deadline, loopback: bool) -> tuple[int, bytes, str]:
    """One HTTP exchange under ``deadline``: ``(status, body, reason)`` for any status; transport errors raise."""
    handlers = [_WatchedHTTPHandler(deadline), _WatchedHTTPSHandler(deadline)]
    # Loopback servers are reached directly even when http_proxy is set; others follow the environment.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}) if loopback else urllib.request.ProxyHandler(), *handlers)
    try:
        with opener.open(request, timeout=timeout) as response:
            return response.status, _read_capped(response), response.reason or ""
    except urllib.error.HTTPError as exc:
        try:
            raw = _read_capped(exc)
        except Exception:  # noqa: BLE001 (the body may be gone with the connection, or absurdly long: the status still counts)
            raw = b""
        with contextlib.suppress(Exception):
            exc.close()
        return exc.code, raw, str(exc.reason or "")


def _read_capped(response: Any) -> bytes:
    raw = response.read(MAX_ANSWER_BYTES + 1)
    if len(raw) > MAX_ANSWER_BYTES:
        raise RewardError(f"the answer is larger than {MAX_ANSWER_BYTES} bytes; is the URL that of a reward server?")
    if getattr(response, "length", None):  # http.client returns a body cut short by the connection's end as if complete
        raise http.client.IncompleteRead(raw, response.length)
    return raw


def post_json(url: str, body: dict, *, headers: dict | None = None, timeout: float, retries: int, backoff: float,
              retry_statuses: tuple[int, ...] = RETRY_STATUSES, stats: dict | None = None, lock: threading.Lock | None = None,
              what: str = "server", attempt_timeout: float | None = None) -> dict:
    """POST ``body`` as JSON to ``url`` and return the decoded JSON answer, retrying transient failures.

    Attempt ``k = 0..retries``; before attempt ``k ≥ 1`` it sleeps ``backoff · 2^(k-1)``. Transient:
    connection refused/reset, timeouts (``timeout`` seconds per socket operation; ``attempt_timeout``,
    default ``4 · timeout``, for the whole attempt), a dropped connection, and statuses in
    ``retry_statuses``. Any other non-2xx answer raises at once.

    Raises:
        RewardError: naming ``what`` and ``url`` (never the token), the status and message or the last
        transport error, and how many attempts were made.
    """
    data = json.dumps(body).encode("utf-8")
    all_headers = {"Content-Type": "application/json", "Accept": "application/json", **(headers or {})}
    attempt_timeout = 4 * timeout if attempt_timeout is None else attempt_timeout
    loopback = _is_loopback(url)
    last = "no attempt"
    for attempt in range(retries + 1):
        if attempt:
            _count(stats, lock, "retries")
            time.sleep(backoff * 2 ** (attempt - 1))
        _count(stats, lock, "attempts")
        deadline = _Deadline(attempt_timeout)
        request = urllib.request.Request(url, data=data, headers=all_headers, method="POST")
        try:
            with deadline:
                status, raw, reason = _exchange(request, timeout=timeout, deadline=deadline, loopback=loopback)
        except RewardError as exc:
            _count(stats, lock, "failures")
            raise RewardError(f"{what} at {url}: {exc}") from None
        except TimeoutError as exc:
            last = f"timed out after {timeout} s ({exc})"
            continue
        except urllib.error.URLError as exc:
            reason = exc.reason
            last = f"timed out after {timeout} s" if isinstance(reason, TimeoutError) else f"cannot connect ({reason})"
            if deadline.passed:
                last = f"no complete answer within {attempt_timeout} s (attempt_timeout)"
            continue
        except (ConnectionError, HTTPException, OSError) as exc:
            last = f"connection failed ({type(exc).__name__}: {exc})"
            if deadline.passed:
                last = f"no complete answer within {attempt_timeout} s (attempt_timeout)"
            continue
        if deadline.passed:  # a close-delimited body cut by the deadline reads as complete
            last = f"no complete answer within {attempt_timeout} s (attempt_timeout)"
            continue
        if 200 <= status < 300:
            try:
                return json.loads(raw)
            except ValueError as exc:
                _count(stats, lock, "failures")
                raise RewardError(f"{what} at {url} answered {status} with a body that is not JSON ({exc}): {raw[:200]!r}") from None
        message = _error_message(raw, reason)
        if status not in retry_statuses:
            _count(stats, lock, "failures")
            hint = f" (check the token: the server's --token-file or ${TOKEN_ENV}, the client's `token` option or ${TOKEN_ENV})" if status == 401 else ""
            raise RewardError(f"{what} at {url} answered HTTP {status}: {message}{hint}")
        last = f"HTTP {status}: {message}"
    _count(stats, lock, "failures")
    raise RewardError(f"{what} at {url} failed after {retries + 1} attempts ({retries} retries): {last}; is the server running and reachable?")


def _count(stats: dict | None, lock: threading.Lock | None, key: str) -> None:
    if stats is None:
        return
    if lock is None:
        stats[key] = stats.get(key, 0) + 1
        return
    with lock:
        stats[key] = stats.get(key, 0) + 1


def _error_message(raw: bytes, reason: str) -> str:
    try:
        return str(json.loads(raw).get("error", raw[:300].decode("utf-8", "replace")))
    except (ValueError, AttributeError):
        return raw[:300].decode("utf-8", "replace") or reason


@register_reward("remote")
class RemoteReward(Reward):
    """Score images on a ``diffrl serve-reward`` server.

    Returns the server's outputs under their own keys (e.g. ``{"jpeg_compressibility": [B]}``, main
    output first); :func:`rewards.base.score` also files the main output under the configured name.
    To use two remote rewards at once, configure the second as ``rewards.remote:RemoteReward``.

    Args:
        url: the server's base URL, e.g. ``http://10.0.0.5:8765`` (``/score`` is appended).
        token: bearer token; ``None``: ``$DIFFRL_REWARD_TOKEN``; ``""``: send none.
        reward: name of the reward the server must serve (checked by the server: 409 if it serves another);
            ``None``: whatever it serves.
        timeout: seconds per socket operation of one attempt.
        attempt_timeout: seconds one attempt may take in all, however the server trickles its answer
            (``None``: ``4 · timeout``).
        retries: retries after the first attempt of each request (bounded; 0: none).
        backoff: seconds before the first retry, doubled for each further retry.
        batch_size: most images per request.
        concurrency: requests in flight at once (chunks of one call).
        send_metadata: send ``metadata`` (must then be JSON-serialisable) or ``null``.
    """

    unit = "as served"

    def __init__(self, url: str, token: str | None = None, reward: str | None = None, timeout: float = 60.0, retries: int = 3,
                 backoff: float = 0.5, batch_size: int = 64, concurrency: int = 1, send_metadata: bool = True,
                 attempt_timeout: float | None = None):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"remote reward url must look like http://host:port, got {url!r}")
        attempt_timeout = 4 * timeout if attempt_timeout is None else attempt_timeout
        if timeout <= 0 or attempt_timeout <= 0 or retries < 0 or backoff < 0 or batch_size < 1 or concurrency < 1:
            raise ValueError(f"remote reward: need timeout > 0, attempt_timeout > 0, retries >= 0, backoff >= 0, batch_size >= 1, "
                             f"concurrency >= 1; got {timeout}, {attempt_timeout}, {retries}, {backoff}, {batch_size}, {concurrency}")
        self.url = url.rstrip("/")
        self.token = os.environ.get(TOKEN_ENV, "") if token is None else token
        self.remote_name = reward
        self.timeout, self.attempt_timeout, self.retries, self.backoff = float(timeout), float(attempt_timeout), int(retries), float(backoff)
        self.batch_size, self.concurrency, self.send_metadata = int(batch_size), int(concurrency), bool(send_metadata)
        self.stats = {"requests": 0, "attempts": 0, "retries": 0, "failures": 0}
        self._lock = threading.Lock()

    def health(self) -> dict:
        """``GET /health`` of the server (one attempt, ``timeout`` per operation, ``attempt_timeout`` in all)."""
        deadline = _Deadline(self.attempt_timeout)
        try:
            with deadline:
                status, raw, reason = _exchange(urllib.request.Request(f"{self.url}/health"), timeout=self.timeout, deadline=deadline,
                                                loopback=_is_loopback(self.url))
            if status != 200 or deadline.passed:
                raise ValueError(f"HTTP {status}: {_error_message(raw, reason)}" if not deadline.passed else "no answer in time")
            return json.loads(raw)
        except (OSError, ValueError, HTTPException, RewardError) as exc:
            raise RewardError(f"reward server at {self.url}/health is not healthy ({exc})") from None

    def _request(self, images: torch.Tensor, prompts: list[str], metadata: Any) -> dict[str, torch.Tensor]:
        body = {"images": [encode_png(im) for im in images], "prompts": list(prompts), "metadata": metadata if self.send_metadata else None,
                "reward": self.remote_name}
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        _count(self.stats, self._lock, "requests")
        answer = post_json(f"{self.url}/score", body, headers=headers, timeout=self.timeout, retries=self.retries, backoff=self.backoff,
                           stats=self.stats, lock=self._lock, what="reward server", attempt_timeout=self.attempt_timeout)
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(scores, dict) or not scores:
            raise RewardError(f"reward server at {self.url} answered without scores: {str(answer)[:200]}")
        if self.remote_name is not None and answer.get("reward") != self.remote_name:
            raise RewardError(f"reward server at {self.url} answered for reward {answer.get('reward')!r}, not {self.remote_name!r}")
        out = {}
        for key, values in scores.items():
            if not isinstance(values, list) or len(values) != len(prompts):
                raise RewardError(f"reward server at {self.url} returned {key!r} with {len(values) if isinstance(values, list) else values!r} "
                                  f"values for {len(prompts)} images")
            if not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values):
                raise RewardError(f"reward server at {self.url} returned {key!r} with values that are not numbers: {str(values)[:200]}")
            out[key] = torch.tensor([float("nan") if v is None else v for v in values], dtype=torch.float32)
        return out

    def __call__(self, images, prompts: list[str], metadata: Any = None) -> dict[str, torch.Tensor]:
        images = as_uint8(images)
        if self.send_metadata and metadata is not None:
            if not isinstance(metadata, (dict, list, tuple)):
                raise RewardError(f"remote reward: metadata must be a dict, a list or None to send it, got {type(metadata).__name__}; "
                                  "or set send_metadata=false")
            try:
                json.dumps(metadata)
            except (TypeError, ValueError) as exc:
                raise RewardError(f"remote reward: metadata must be JSON-serialisable to send it ({exc}); or set send_metadata=false") from exc
        starts = list(range(0, images.shape[0], self.batch_size))
        total = images.shape[0]
        jobs = [(images[s:s + self.batch_size], list(prompts[s:s + self.batch_size]), slice_metadata(metadata, s, s + self.batch_size, total))
                for s in starts]
        if self.concurrency > 1 and len(jobs) > 1:
            with ThreadPoolExecutor(min(self.concurrency, len(jobs))) as pool:
                results = list(pool.map(lambda job: self._request(*job), jobs))
        else:
            results = [self._request(*job) for job in jobs]
        if not results:
            return {self.remote_name or self.name: torch.zeros(0)}
        if any(set(r) != set(results[0]) for r in results):
            raise RewardError(f"reward server at {self.url} returned different keys for different batches: {[sorted(r) for r in results]}")
        return {key: torch.cat([r[key] for r in results]) for key in results[0]}
