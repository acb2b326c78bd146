"""The reward server under hostile input, and the remote-reward client under failing servers.

Server side: every case of :mod:`tests.faults.reward_server_attacks` (malformed bodies, PNG bombs, limits,
auth, slowloris, floods) against a real uvicorn on 127.0.0.1 must get its status and reason, and a valid
request right after each must still get the same scores as the reward called locally. Client side: a
server that drops connections, hangs, trickles its answer, answers 5xx or answers nonsense gives bounded
retries with backoff and then a ``RewardError`` naming the server — never a silent score.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
import torch
from PIL import Image

from diffrl.tools import reward_server
from diffrl.tools.reward_server import RewardServer
from tests.faults.reward_server_attacks import ATTACK_LIMITS, good_request, run_attacks
from rewards.base import RewardError, build_reward
from rewards.remote import RemoteReward

pytestmark = pytest.mark.exact  # messages, files and configs: no floats from different code paths (conftest.py)

TOKEN = "attack-test-token"

# case → the status it must get (0: the connection is closed without an answer)
EXPECTED = {
    "bad_json": 400, "json_array": 400, "json_string": 400, "invalid_utf8": 400, "deep_nesting": 400, "unknown_field": 400,
    "missing_images": 400, "images_not_list": 400, "image_not_string": 400, "prompts_not_list": 400, "prompt_not_string": 400,
    "metadata_scalar": 400, "reward_not_string": 400, "length_mismatch": 400, "empty_lists": 400, "bad_base64": 400, "not_png": 400,
    "truncated_png": 400, "zero_size_png": 400, "garbage_idat": 400, "bomb_header_30000x30000": 413, "bomb_real_8000x8000": 413,
    "mixed_sizes": 400, "too_many_images": 413, "request_pixel_budget": 413, "oversize_content_length": 413, "oversize_chunked": 413,
    "wrong_content_type": 415, "missing_content_type": 415, "missing_auth": 401, "wrong_token": 401, "basic_auth_scheme": 401,
    "unknown_path": 404, "wrong_method": 405, "reward_mismatch": 409, "bad_content_length": 400, "garbage_request_line": 400,
    "header_flood_32kb": 400, "slow_body_trickle": 408, "slow_header_trickle": 0, "slots_held_by_slow_body": 503,
    "connection_flood": 503, "client_abort_mid_body": 0,
}


def test_every_attack_gets_its_answer_and_the_server_keeps_scoring(monkeypatch):
    opened: list[int] = []  # pixels of every image PIL opened in the server: a bomb must never get that far
    real_open = Image.open

    def recording_open(*args, **kwargs):
        image = real_open(*args, **kwargs)
        opened.append(image.width * image.height)
        return image

    monkeypatch.setattr(reward_server.Image, "open", recording_open)
    with RewardServer(build_reward("jpeg_compressibility"), port=0, token=TOKEN, **ATTACK_LIMITS) as server:
        start = time.perf_counter()
        rows, reference = run_attacks(server.url, TOKEN)
        seconds = time.perf_counter() - start
        errors = dict(server.stats["errors"])
    images, prompts, _ = good_request()
    local = build_reward("jpeg_compressibility")(images, prompts)["jpeg_compressibility"].tolist()
    assert reference == {"reward": "jpeg_compressibility", "scores": {"jpeg_compressibility": local}}
    by_case = {row["case"]: row for row in rows}
    assert len(rows) == len(by_case) == len(EXPECTED) >= 20
    assert {case: row["status"] for case, row in by_case.items()} == EXPECTED
    assert [row["case"] for row in rows if not row["ok"]] == []  # each status with its reason (slow body: 408, or closed)
    assert [row["case"] for row in rows if not row["then_valid"]] == []  # the valid request right after each: the same scores
    assert Counter(EXPECTED.values()) == {400: 24, 413: 6, 401: 3, 415: 2, 503: 2, 0: 2, 404: 1, 405: 1, 409: 1, 408: 1}
    # the slow clients are cut by the timeouts, not by the client giving up
    assert by_case["slow_body_trickle"]["seconds"] < ATTACK_LIMITS["body_timeout_s"] + 1.0
    assert by_case["slow_header_trickle"]["seconds"] < ATTACK_LIMITS["header_timeout_s"] + 1.0
    assert by_case["slots_held_by_slow_body"]["seconds"] < 0.2 + ATTACK_LIMITS["queue_timeout_s"] + 1.0
    # the app answered every JSON error it is expected to (uvicorn answers malformed HTTP and the connection flood itself;
    # the two aborted bodies count as 400)
    assert errors == {400: 21 + 2, 413: 6, 401: 3, 415: 2, 404: 1, 405: 1, 409: 1, 408: 1, 503: 1}
    assert max(opened) <= ATTACK_LIMITS["max_image_pixels"]  # no image over the limit was even opened by PIL
    assert seconds < 20


def test_graceful_shutdown_finishes_requests_in_progress():
    """A request being scored when shutdown starts still gets its scores; afterwards the port refuses."""
    def slow_mean(images, prompts, metadata=None):
        time.sleep(0.5)
        return {"mean": images.float().mean(dim=(1, 2, 3))}

    images = torch.randint(0, 256, (2, 3, 8, 8), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    server = RewardServer(slow_mean, name="mean", port=0, token=TOKEN).start()
    client = RemoteReward(server.url, token=TOKEN, retries=0, timeout=10)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(client, images, ["a", "b"])
        time.sleep(0.2)
        start = time.perf_counter()
        server.shutdown()
        assert time.perf_counter() - start < 5
        torch.testing.assert_close(future.result(timeout=10)["mean"], images.float().mean(dim=(1, 2, 3)))
    with pytest.raises(RewardError, match="failed after 1 attempts .*cannot connect"):
        client(images, ["a", "b"])


# ---------------------------------------------------------------------------------------------- client side

class _Scripted(BaseHTTPRequestHandler):
    """Plays ``script`` one entry per POST: an int status (JSON error), ``"drop"`` (close unanswered), ``"trickle"``
    (headers, then one body byte every 0.1 s), ``("sleep", s)`` then 200, or a dict answered with 200; then 200."""

    script: ClassVar[list] = []
    seen = 0

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        step = cls.script[cls.seen] if cls.seen < len(cls.script) else 200
        cls.seen += 1
        if step == "drop":
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if step == "trickle":
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            for _ in range(100):
                try:
                    self.wfile.write(b" ")
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.1)
            return
        if isinstance(step, tuple):
            time.sleep(step[1])
            step = 200
        status, answer = (200, step) if isinstance(step, dict) else \
            (step, {"reward": "x", "scores": {"x": [0.5] * len(body["prompts"])}} if step == 200 else {"error": f"scripted {step}"})
        data = json.dumps(answer).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client gave up first (the hang case)
            self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted():
    _Scripted.script, _Scripted.seen = [], 0
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _call(url: str, **options) -> tuple[dict | Exception, dict, float]:
    client = RemoteReward(url, token="t", backoff=0.05, **options)
    start = time.perf_counter()
    try:
        out = client(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), ["a", "b"])
    except RewardError as exc:
        out = exc
    return out, client.stats, time.perf_counter() - start


def test_transient_failures_are_retried_with_backoff_then_scored(scripted):
    """408, a dropped connection, 502, 503, 504, then a slow but timely answer: 6 attempts, backoff 0.05·(1+2+4+8+16) s."""
    _Scripted.script = [408, "drop", 502, 503, 504, ("sleep", 0.3)]
    out, stats, seconds = _call(scripted, retries=5, timeout=2)
    assert out["x"].tolist() == [0.5, 0.5]
    assert stats == {"requests": 1, "attempts": 6, "retries": 5, "failures": 0}
    assert 0.05 * 31 + 0.3 <= seconds < 5


@pytest.mark.parametrize(("script", "options", "message", "attempts", "max_seconds"), [
    (["drop"] * 5, {"retries": 2, "timeout": 2}, r"failed after 3 attempts \(2 retries\): connection failed \(RemoteDisconnected", 3, 3),
    ([503] * 5, {"retries": 3, "timeout": 2}, r"failed after 4 attempts \(3 retries\): HTTP 503: scripted 503", 4, 3),
    (["trickle"] * 3, {"retries": 1, "timeout": 0.5, "attempt_timeout": 0.8},
     r"failed after 2 attempts \(1 retries\): no complete answer within 0.8 s \(attempt_timeout\)", 2, 4),
    ([("sleep", 2.0)] * 3, {"retries": 1, "timeout": 0.3}, r"failed after 2 attempts \(1 retries\): timed out after 0.3 s", 2, 3),
    ([500], {"retries": 3, "timeout": 2}, r"answered HTTP 500: scripted 500", 1, 1),
    ([{"reward": "x", "scores": {"x": [0.5]}}], {"retries": 3, "timeout": 2}, r"returned 'x' with 1 values for 2 images", 1, 1),
    ([{"reward": "x", "scores": {"x": ["high", 0.5]}}], {"retries": 3, "timeout": 2}, r"values that are not numbers", 1, 1),
    ([{"reward": "other", "scores": {"x": [0.5, 0.5]}}], {"retries": 3, "timeout": 2, "reward": "x"}, r"answered for reward 'other', not 'x'", 1, 1),
    ([{"error": "no scores"}], {"retries": 3, "timeout": 2}, r"answered without scores", 1, 1),
])
def test_failing_server_gives_bounded_retries_then_a_named_error(scripted, script, options, message, attempts, max_seconds):
    """Dropped connections, persistent 503, a trickled answer (cut by attempt_timeout), a hang (timeout), a 500 and
    nonsense answers: at most ``retries + 1`` attempts, then a RewardError naming the server; never a score."""
    _Scripted.script = script
    out, stats, seconds = _call(scripted, **options)
    assert isinstance(out, RewardError), out
    assert f"reward server at {scripted}" in str(out)
    assert stats["attempts"] == attempts and stats["retries"] == attempts - 1
    assert re.search(message, str(out)), str(out)
    assert seconds < max_seconds


def test_busy_server_answers_503_and_the_client_retries_into_a_slot():
    """max_inflight=1: a second request waits queue_timeout_s, gets 503 + Retry-After, and the client's retry is scored."""
    def slow_mean(images, prompts, metadata=None):
        time.sleep(0.6)
        return {"mean": images.float().mean(dim=(1, 2, 3))}

    images = torch.randint(0, 256, (1, 3, 8, 8), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    with RewardServer(slow_mean, name="mean", port=0, token=TOKEN, max_inflight=1, queue_timeout_s=0.2) as server:
        clients = [RemoteReward(server.url, token=TOKEN, retries=4, backoff=0.3, timeout=10) for _ in range(2)]
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda c: c(images, ["a"])["mean"], clients))
        errors = dict(server.stats["errors"])
    for out in outs:
        torch.testing.assert_close(out, images.float().mean(dim=(1, 2, 3)))
    assert errors.get(503, 0) >= 1 and set(errors) == {503}
    assert sum(c.stats["retries"] for c in clients) == errors[503] and all(c.stats["failures"] == 0 for c in clients)
