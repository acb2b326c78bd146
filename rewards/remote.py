"""``remote``: a reward served over HTTP by ``diffrl serve-reward`` (:mod:`diffrl.tools.reward_server`).

Wire protocol (JSON, UTF-8; images as base64 PNG, never pickle):

* ``GET /health`` → ``200 {"status": "ok", "reward": name, "unit", "scale", "batch_size", "input", "protocol": 1}``
  (no token needed: it reveals nothing but the reward's declaration).
* ``POST /score`` with ``Authorization: Bearer <token>`` and body
  ``{"images": [base64 PNG, …], "prompts": [str, …], "metadata": <JSON or null>, "reward": <name or null>}``
  → ``200 {"reward": name, "scores": {key: [float, …], …}}``, the main output's key first.
* Errors answer ``{"error": message}`` with 400 (malformed body), 401 (missing or wrong token),
  404 (unknown path), 409 (``reward`` names another reward than the one served), 413 (body over the
  server's limit), 500 (the reward raised; message included). The server keeps serving after each.

The client :class:`RemoteReward` sends at most ``batch_size`` images per request (``concurrency``
requests at a time), waits ``timeout`` seconds per socket operation, and retries connection failures,
timeouts and 502/503/504 answers up to ``retries`` times, sleeping ``backoff · 2^k`` before retry ``k``;
then it raises :class:`~rewards.base.RewardError` naming the server. A 4xx or 500 answer is not retried
(the same request would fail again) and raises at once with the server's message.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.client import HTTPException
from typing import Any

import torch

from rewards.base import TOKEN_ENV, Reward, RewardError, decode_png, encode_png, from_pil, register_reward, slice_metadata  # noqa: F401  (the wire format)

PROTOCOL = 1
RETRY_STATUSES = (502, 503, 504)


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


def post_json(url: str, body: dict, *, headers: dict | None = None, timeout: float, retries: int, backoff: float,
              retry_statuses: tuple[int, ...] = RETRY_STATUSES, stats: dict | None = None, lock: threading.Lock | None = None,
              what: str = "server") -> dict:
    """POST ``body`` as JSON to ``url`` and return the decoded JSON answer, retrying transient failures.

    Attempt ``k = 0..retries``; before attempt ``k ≥ 1`` it sleeps ``backoff · 2^(k-1)``. Transient:
    connection refused/reset, timeouts (``timeout`` seconds per socket operation), a dropped connection,
    and statuses in ``retry_statuses``. Any other non-2xx answer raises at once.

    Raises:
        RewardError: naming ``what`` and ``url`` (never the token), the status and message or the last
        transport error, and how many attempts were made.
    """
    data = json.dumps(body).encode("utf-8")
    all_headers = {"Content-Type": "application/json", "Accept": "application/json", **(headers or {})}
    # Loopback servers are reached directly even when http_proxy is set; others follow the environment.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({})) if _is_loopback(url) else urllib.request.build_opener()
    last = "no attempt"
    for attempt in range(retries + 1):
        if attempt:
            _count(stats, lock, "retries")
            time.sleep(backoff * 2 ** (attempt - 1))
        _count(stats, lock, "attempts")
        try:
            with opener.open(urllib.request.Request(url, data=data, headers=all_headers, method="POST"), timeout=timeout) as response:
                raw = response.read()
            try:
                return json.loads(raw)
            except ValueError as exc:
                raise RewardError(f"{what} at {url} answered 200 with a body that is not JSON ({exc}): {raw[:200]!r}") from exc
        except urllib.error.HTTPError as exc:
            message = _error_message(exc)
            if exc.code not in retry_statuses:
                _count(stats, lock, "failures")
                hint = " (check the token: --token of the server, `token` option or $" + TOKEN_ENV + " of the client)" if exc.code == 401 else ""
                raise RewardError(f"{what} at {url} answered HTTP {exc.code}: {message}{hint}") from None
            last = f"HTTP {exc.code}: {message}"
        except (TimeoutError, socket.timeout) as exc:
            last = f"timed out after {timeout} s ({exc})"
        except urllib.error.URLError as exc:
            reason = exc.reason
            last = f"timed out after {timeout} s" if isinstance(reason, (TimeoutError, socket.timeout)) else f"cannot connect ({reason})"
        except (ConnectionError, HTTPException, OSError) as exc:
            last = f"connection failed ({type(exc).__name__}: {exc})"
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


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        raw = exc.read()
    except Exception:  # the body may be gone with the connection
        return exc.reason or ""
    try:
        return str(json.loads(raw).get("error", raw[:300].decode("utf-8", "replace")))
    except (ValueError, AttributeError):
        return raw[:300].decode("utf-8", "replace")


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
        retries: retries after the first attempt of each request (bounded; 0: none).
        backoff: seconds before the first retry, doubled for each further retry.
        batch_size: most images per request.
        concurrency: requests in flight at once (chunks of one call).
        send_metadata: send ``metadata`` (must then be JSON-serialisable) or ``null``.
    """

    unit = "as served"

    def __init__(self, url: str, token: str | None = None, reward: str | None = None, timeout: float = 60.0, retries: int = 3,
                 backoff: float = 0.5, batch_size: int = 64, concurrency: int = 1, send_metadata: bool = True):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"remote reward url must look like http://host:port, got {url!r}")
        if timeout <= 0 or retries < 0 or backoff < 0 or batch_size < 1 or concurrency < 1:
            raise ValueError(f"remote reward: need timeout > 0, retries >= 0, backoff >= 0, batch_size >= 1, concurrency >= 1; "
                             f"got {timeout}, {retries}, {backoff}, {batch_size}, {concurrency}")
        self.url = url.rstrip("/")
        self.token = os.environ.get(TOKEN_ENV, "") if token is None else token
        self.remote_name = reward
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self.batch_size, self.concurrency, self.send_metadata = int(batch_size), int(concurrency), bool(send_metadata)
        self.stats = {"requests": 0, "attempts": 0, "retries": 0, "failures": 0}
        self._lock = threading.Lock()

    def health(self) -> dict:
        """``GET /health`` of the server (one attempt, ``timeout``)."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({})) if _is_loopback(self.url) else urllib.request.build_opener()
        try:
            with opener.open(f"{self.url}/health", timeout=self.timeout) as response:
                return json.loads(response.read())
        except (OSError, ValueError, HTTPException) as exc:
            raise RewardError(f"reward server at {self.url}/health is not healthy ({exc})") from exc

    def _request(self, images: torch.Tensor, prompts: list[str], metadata: Any) -> dict[str, torch.Tensor]:
        body = {"images": [encode_png(im) for im in images], "prompts": list(prompts), "metadata": metadata if self.send_metadata else None,
                "reward": self.remote_name}
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        _count(self.stats, self._lock, "requests")
        answer = post_json(f"{self.url}/score", body, headers=headers, timeout=self.timeout, retries=self.retries, backoff=self.backoff,
                           stats=self.stats, lock=self._lock, what="reward server")
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(scores, dict) or not scores:
            raise RewardError(f"reward server at {self.url} answered without scores: {str(answer)[:200]}")
        out = {}
        for key, values in scores.items():
            if not isinstance(values, list) or len(values) != len(prompts):
                raise RewardError(f"reward server at {self.url} returned {key!r} with {len(values) if isinstance(values, list) else values!r} "
                                  f"values for {len(prompts)} images")
            out[key] = torch.tensor([float("nan") if v is None else v for v in values], dtype=torch.float32)
        return out

    def __call__(self, images, prompts: list[str], metadata: Any = None) -> dict[str, torch.Tensor]:
        images = as_uint8(images)
        if self.send_metadata and metadata is not None:
            try:
                json.dumps(metadata)
            except (TypeError, ValueError) as exc:
                raise RewardError(f"remote reward: metadata must be JSON-serialisable to send it ({exc}); or set send_metadata=false") from exc
        starts = list(range(0, images.shape[0], self.batch_size))
        total = images.shape[0]
        jobs = [(images[s:s + self.batch_size], list(prompts[s:s + self.batch_size]), slice_metadata(metadata, s, s + self.batch_size, total))
                for s in starts]
        if self.concurrency > 1 and len(jobs) > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(min(self.concurrency, len(jobs))) as pool:
                results = list(pool.map(lambda job: self._request(*job), jobs))
        else:
            results = [self._request(*job) for job in jobs]
        if not results:
            return {self.remote_name or self.name: torch.zeros(0)}
        if any(set(r) != set(results[0]) for r in results):
            raise RewardError(f"reward server at {self.url} returned different keys for different batches: {[sorted(r) for r in results]}")
        return {key: torch.cat([r[key] for r in results]) for key in results[0]}
