"""Malformed and hostile requests against a ``diffrl serve-reward`` server, each with the answer it must get.

:func:`run_attacks` sends every case of :func:`attack_cases` over a raw socket to a loopback server started
with :data:`ATTACK_LIMITS`, and after each one checks that a valid request is still answered with the same
scores. ``tests/faults/test_reward_server_attacks.py`` asserts every outcome; ``benchmarks/faults/reward_server_load.py``
records the table in ``benchmarks/results/reward_server_attacks.json``. Status ``0`` means the server closed
the connection without an answer (what a client trickling its headers gets).
"""

from __future__ import annotations

import base64
import json
import select
import socket
import struct
import time
import urllib.parse
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rewards.base import encode_png

# Small limits so that every limit can be hit with small requests; the timeouts keep the slow cases short.
ATTACK_LIMITS = {"max_request_bytes": 256 << 10, "max_images": 8, "max_image_pixels": 48 * 48, "max_request_pixels": 64 * 64,
                 "max_inflight": 1, "queue_timeout_s": 0.3, "max_connections": 16, "body_timeout_s": 1.0, "header_timeout_s": 1.0,
                 "keep_alive_s": 1.0}
Address = tuple[str, int]


@dataclass(frozen=True)
class Attack:
    """One hostile request: ``run(address) -> (status, reason)`` must give a status in ``expect`` and a reason containing ``reason``."""

    name: str
    expect: tuple[int, ...]
    reason: str
    run: Callable[[Address], tuple[int, str]]


def raw_request(body: bytes | None, headers: dict[str, str], *, method: str = "POST", path: str = "/score", length: bool = True) -> bytes:
    """The bytes of an HTTP/1.1 request (``Content-Length`` added unless ``length`` is False)."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers.items())]
    if body is not None and length:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


def read_raw(sock: socket.socket) -> tuple[int, bytes]:
    """One HTTP answer from ``sock``: ``(status, body)``; ``(0, b"")`` if the server closed (or reset) without one."""
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(1 << 16)
            if not chunk:
                return 0, b""
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers["content-length"]) if "content-length" in headers else None
        while length is None or len(body) < length:
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            body += chunk
    except ConnectionResetError:
        return 0, b""
    return int(lines[0].split()[1]), body


def read_answer(sock: socket.socket) -> tuple[int, str]:
    """One HTTP answer from ``sock``: ``(status, its error reason or body text)``; ``(0, …)`` if closed first."""
    status, body = read_raw(sock)
    if status == 0:
        return 0, "connection closed without an answer"
    try:
        answer = json.loads(body)
    except ValueError:
        return status, body.decode("utf-8", "replace")
    return status, str(answer.get("error", "")) if isinstance(answer, dict) else body.decode("utf-8", "replace")


def exchange(address: Address, payload: bytes, timeout: float = 10.0) -> tuple[int, str]:
    """Send ``payload`` on a new connection and read one answer."""
    with socket.create_connection(address, timeout=timeout) as sock:
        try:
            sock.sendall(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered early and closed; its answer may still be readable
        return read_answer(sock)


def _png_file(width: int, height: int, rows: bytes | None = None, *, idat: bytes | None = None) -> bytes:
    """A grayscale 8-bit PNG built chunk by chunk: ``rows`` (filter byte + pixels per row) compressed, or a given IDAT."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    if idat is None:
        compressor = zlib.compressobj(9)
        idat = b"".join(compressor.compress(rows[i:i + (1 << 20)]) for i in range(0, len(rows), 1 << 20)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def good_request() -> tuple[torch.Tensor, list[str], bytes]:
    """The valid request sent after every attack: 3 random 16×16 images (seed 0), their prompts, the JSON body."""
    images = torch.randint(0, 256, (3, 3, 16, 16), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    prompts = ["a", "b", "c"]
    return images, prompts, json.dumps({"images": [encode_png(im) for im in images], "prompts": prompts}).encode()


def attack_cases(token: str, limits: dict = ATTACK_LIMITS) -> list[Attack]:
    """The hostile requests, for a server with ``token`` and ``limits`` (see :data:`ATTACK_LIMITS`)."""
    auth = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    images, _, good = good_request()
    png = base64.b64decode(encode_png(images[0]))

    def body(**fields) -> bytes:
        return json.dumps({"images": [_b64(png)], "prompts": ["a"], **fields}).encode()

    def send(payload: bytes) -> Callable[[Address], tuple[int, str]]:
        return lambda address: exchange(address, payload)

    def score(data: bytes, headers: dict | None = None, **kwargs) -> Callable[[Address], tuple[int, str]]:
        return send(raw_request(data, auth if headers is None else headers, **kwargs))

    noisy = encode_png(torch.randint(0, 256, (3, 16, 16), generator=torch.Generator().manual_seed(1), dtype=torch.uint8))
    big = int(limits["max_request_bytes"] * 1.2)
    side = int((limits["max_request_pixels"] / limits["max_images"]) ** 0.5) + 1  # max_images images of side² pixels: over the budget
    per_image = encode_png(torch.zeros(3, side, side, dtype=torch.uint8))
    chunked = b"".join(b"%x\r\n%s\r\n" % (1 << 14, b"x" * (1 << 14)) for _ in range(big // (1 << 14) + 1)) + b"0\r\n\r\n"
    cases = [
        Attack("bad_json", (400,), "not valid JSON", score(b"{not json")),
        Attack("json_array", (400,), "must be a JSON object", score(b"[1, 2]")),
        Attack("json_string", (400,), "must be a JSON object", score(b'"images"')),
        Attack("invalid_utf8", (400,), "not valid JSON", score(b'{"images": "\xff\xfe"}')),
        Attack("deep_nesting", (400,), "not valid JSON", score(b"[" * 100_000 + b"]" * 100_000)),
        Attack("unknown_field", (400,), "unknown fields ['pickle']", score(body(pickle="cos\nsystem\n"))),
        Attack("missing_images", (400,), "needs 'images'", score(json.dumps({"prompts": ["a"]}).encode())),
        Attack("images_not_list", (400,), "needs 'images'", score(json.dumps({"images": _b64(png), "prompts": ["a"]}).encode())),
        Attack("image_not_string", (400,), "image 0 must be a base64 PNG string", score(json.dumps({"images": [123], "prompts": ["a"]}).encode())),
        Attack("prompts_not_list", (400,), "needs 'images'", score(json.dumps({"images": [_b64(png)], "prompts": "a"}).encode())),
        Attack("prompt_not_string", (400,), "needs 'images'", score(json.dumps({"images": [_b64(png)], "prompts": [7]}).encode())),
        Attack("metadata_scalar", (400,), "'metadata' must be a JSON object", score(body(metadata="step 3"))),
        Attack("reward_not_string", (400,), "'reward' must be the expected reward's name", score(body(reward=["x"]))),
        Attack("length_mismatch", (400,), "1 images and 2 prompts", score(json.dumps({"images": [_b64(png)], "prompts": ["a", "b"]}).encode())),
        Attack("empty_lists", (400,), "at least 1", score(json.dumps({"images": [], "prompts": []}).encode())),
        Attack("bad_base64", (400,), "not valid base64", score(json.dumps({"images": ["%%%"], "prompts": ["a"]}).encode())),
        Attack("not_png", (400,), "is not a PNG", score(json.dumps({"images": [_b64(b"GIF89a....")], "prompts": ["a"]}).encode())),
        Attack("truncated_png", (400,), "corrupt PNG", score(json.dumps({"images": [noisy[: len(noisy) * 3 // 5 // 4 * 4]], "prompts": ["a"]}).encode())),
        Attack("zero_size_png", (400,), "header says 0x16", score(json.dumps({"images": [_b64(_png_file(0, 16, idat=b""))], "prompts": ["a"]}).encode())),
        Attack("garbage_idat", (400,), "corrupt PNG", score(json.dumps({"images": [_b64(_png_file(16, 16, idat=b"\x78\x9c" + b"\xff" * 64))],
                                                                         "prompts": ["a"]}).encode())),
        Attack("bomb_header_30000x30000", (413,), "exceed this server's limit", score(json.dumps(
            {"images": [_b64(_png_file(30000, 30000, idat=zlib.compress(b"\x00" * 1024)))], "prompts": ["a"]}).encode())),
        Attack("bomb_real_8000x8000", (413,), "exceed this server's limit", score(json.dumps(
            {"images": [_b64(_png_file(8000, 8000, bytes(8001 * 8000)))], "prompts": ["a"]}).encode())),
        Attack("mixed_sizes", (400,), "different sizes", score(json.dumps({"images": [_b64(png), encode_png(images[0, :, :8, :8])],
                                                                           "prompts": ["a", "b"]}).encode())),
        Attack("too_many_images", (413,), f"at most {limits['max_images']}", score(json.dumps(
            {"images": [_b64(png)] * (limits["max_images"] + 1), "prompts": ["a"] * (limits["max_images"] + 1)}).encode())),
        Attack("request_pixel_budget", (413,), "pixels per request", score(json.dumps(
            {"images": [per_image] * limits["max_images"], "prompts": ["a"] * limits["max_images"]}).encode())),
        Attack("oversize_content_length", (413,), f"limit of {limits['max_request_bytes']} bytes", score(b"x" * big)),
        Attack("oversize_chunked", (413,), f"limit of {limits['max_request_bytes']} bytes",
               send(raw_request(None, {**auth, "Transfer-Encoding": "chunked"}) + chunked)),
        Attack("wrong_content_type", (415,), "Content-Type: application/json", score(good, {**auth, "Content-Type": "text/plain"})),
        Attack("missing_content_type", (415,), "Content-Type: application/json", score(good, {"Authorization": auth["Authorization"]})),
        Attack("missing_auth", (401,), "missing or wrong bearer token", score(good, {"Content-Type": "application/json"})),
        Attack("wrong_token", (401,), "missing or wrong bearer token", score(good, {**auth, "Authorization": f"Bearer {token}x"})),
        Attack("basic_auth_scheme", (401,), "missing or wrong bearer token", score(good, {**auth, "Authorization": f"Basic {token}"})),
        Attack("unknown_path", (404,), "unknown path '/admin'", score(good, path="/admin")),
        Attack("wrong_method", (405,), "method GET not allowed on '/score'", score(None, method="GET")),
        Attack("reward_mismatch", (409,), "not 'not_this_reward'", score(body(reward="not_this_reward"))),
        Attack("bad_content_length", (400,), "Invalid HTTP request", send(raw_request(good, {**auth, "Content-Length": "12abc"}, length=False))),
        Attack("garbage_request_line", (400,), "Invalid HTTP request", send(b"\x16\x03\x01 HELLO THERE\r\n\r\n")),
        Attack("header_flood_32kb", (400,), "Invalid HTTP request", send(raw_request(None, {f"X-Flood-{i}": "y" * 100 for i in range(300)})[:-2])),
        Attack("slow_body_trickle", (408, 0), "", lambda address: _trickle(address, raw_request(None, {**auth, "Content-Length": "1000"}),
                                                                      limits["body_timeout_s"])),
        Attack("slow_header_trickle", (0,), "closed", lambda address: _trickle(address, b"POST /score HTTP/1.1\r\n", limits["header_timeout_s"])),
        Attack("slots_held_by_slow_body", (503,), "the server is busy", lambda address: _busy(address, auth, good)),
        Attack("connection_flood", (503,), "Service Unavailable", lambda address: _flood(address, good, auth, limits["max_connections"])),
        Attack("client_abort_mid_body", (0,), "aborted", lambda address: _abort(address, auth)),
    ]
    return cases


def _trickle(address: Address, head: bytes, timeout_s: float) -> tuple[int, str]:
    """Send ``head``, then one byte every 0.1 s, until the server answers or closes (at most ``4·timeout_s + 2`` s)."""
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(head)
        stop = time.monotonic() + 4 * timeout_s + 2
        while time.monotonic() < stop:
            readable, _, _ = select.select([sock], [], [], 0.1)
            if readable:
                return read_answer(sock)
            try:
                sock.sendall(b"x")
            except (BrokenPipeError, ConnectionResetError):
                return 0, "connection closed by the server"
        return -1, "the server let the trickle go on"


def _busy(address: Address, auth: dict, good: bytes) -> tuple[int, str]:
    """Hold every request slot with a body that never arrives, then send a valid request: it must get 503."""
    with socket.create_connection(address, timeout=10) as slow:
        slow.sendall(raw_request(None, {**auth, "Content-Length": "1000"}) + b"{")
        time.sleep(0.2)
        return exchange(address, raw_request(good, auth))


def _flood(address: Address, good: bytes, auth: dict, connections: int) -> tuple[int, str]:
    """Open ``connections`` idle connections, then send a valid request: uvicorn must answer 503."""
    idle = [socket.create_connection(address, timeout=10) for _ in range(connections)]
    try:
        time.sleep(0.1)
        return exchange(address, raw_request(good, auth))
    finally:
        for sock in idle:
            sock.close()
        time.sleep(0.2)  # the server notices the closed connections


def _abort(address: Address, auth: dict) -> tuple[int, str]:
    """Send the headers and half a body, then close: nothing to read; the server must go on serving."""
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(raw_request(None, {**auth, "Content-Length": "1000"}) + b"{" * 500)
        time.sleep(0.1)
    time.sleep(0.1)
    return 0, "aborted by the client"


def _address(url: str) -> Address:
    parts = urllib.parse.urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def run_attacks(url: str, token: str, limits: dict = ATTACK_LIMITS) -> tuple[list[dict], dict]:
    """Every attack against the server at ``url`` (loopback), each followed by the valid request.

    Returns ``(rows, reference)``: per attack its expected and actual status, the reason, ``ok`` (status
    and reason as expected), ``then_valid`` (the valid request got 200 and ``reference``) and seconds;
    ``reference`` is the server's answer to the valid request before any attack.
    """
    address = _address(url)
    _, _, good = good_request()
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    reference = _json_answer(address, good, headers)
    if reference is None:
        raise RuntimeError(f"reward server at {url} does not score the valid request; start it with ATTACK_LIMITS and this token")
    rows = []
    for attack in attack_cases(token, limits):
        start = time.perf_counter()
        status, reason = attack.run(address)
        seconds = time.perf_counter() - start
        after = _json_answer(address, good, headers)
        rows.append({"case": attack.name, "expect": list(attack.expect), "status": status, "reason": reason[:200],
                     "ok": status in attack.expect and attack.reason in reason, "then_valid": after == reference, "seconds": round(seconds, 3)})
    return rows, reference


def _json_answer(address: Address, body: bytes, headers: dict) -> dict | None:
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(raw_request(body, headers))
        status, answer = read_raw(sock)
    return json.loads(answer) if status == 200 else None
