"""Remote rewards and the VLM judge against real HTTP servers on 127.0.0.1 (started by the tests).

Every loop is bounded and every socket has a timeout; nothing leaves the loopback interface.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from diffrl.tools.cli import main
from diffrl.tools.reward_server import RewardServer, parse_reward_args
from rewards.base import RewardError, build_reward, score, to_pil
from rewards.remote import RemoteReward, encode_png

TOKEN = "s3cret-token"
ROOT = Path(__file__).resolve().parents[1]


def _images(batch: int, seed: int, size: int = 16) -> torch.Tensor:
    return torch.randint(0, 256, (batch, 3, size, size), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def _post(url: str, body: bytes, headers: dict, path: str = "/score") -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("POST", path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def _body(images: torch.Tensor, prompts: list[str], **extra) -> bytes:
    return json.dumps({"images": [encode_png(im) for im in images], "prompts": prompts, **extra}).encode()


AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def jpeg_server():
    with RewardServer(build_reward("jpeg_compressibility"), port=0, token=TOKEN, max_request_bytes=200_000) as server:
        yield server


def test_sixteen_concurrent_clients_get_local_scores():
    """16 clients (batch sizes 1..4, 6 images each) at once against a ``digits`` server == the reward called locally."""
    from rewards.digits.data import all_prompts

    local = build_reward("digits")
    prompts_all = all_prompts()
    with RewardServer(build_reward("digits"), port=0, token=TOKEN, batch_wait_s=0.02) as server:
        assert RemoteReward(server.url).health() == {"status": "ok", "protocol": 1, "reward": "digits", "unit": "probability in [0, 1]",
                                                     "scale": None, "batch_size": None, "input": "uint8"}

        def one_client(i: int):
            client = build_reward("remote", url=server.url, token=TOKEN, reward="digits", batch_size=1 + i % 4, timeout=20, retries=0)
            images = _images(6, seed=100 + i)
            prompts = [prompts_all[(7 * i + k) % len(prompts_all)] for k in range(6)]
            return images, prompts, score({"remote": (client, 1.0)}, images, prompts, {"step": i % 2}), client.stats

        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(one_client, range(16)))
        stats = dict(server.stats)
    for images, prompts, remote, client_stats in results:
        expected = local(images, prompts)["digits"]
        torch.testing.assert_close(remote["reward/digits"], expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(remote["rewards"], expected, rtol=0, atol=1e-6)
        assert client_stats["retries"] == 0 and client_stats["failures"] == 0
    requests = sum(-(-6 // (1 + i % 4)) for i in range(16))  # ceil(6 / batch_size) per client
    assert stats["requests"] == requests + 1 and stats["images"] == 96 and not stats["errors"]  # + the health check
    assert stats["reward_calls"] <= requests  # concurrent requests of equal metadata may share a call


def test_bad_requests_get_4xx_and_server_keeps_serving(jpeg_server):
    url = jpeg_server.url
    images, prompts = _images(3, seed=1), ["a", "b", "c"]
    expected = build_reward("jpeg_compressibility")(images, prompts)["jpeg_compressibility"].tolist()
    good = _body(images, prompts)
    not_png = base64.b64encode(b"GIF89a not a png").decode()
    cases = [
        ({"Content-Type": "application/json"}, good, 401, "missing or wrong bearer token"),
        ({"Authorization": "Bearer wrong"}, good, 401, "missing or wrong bearer token"),
        (AUTH, b"{not json", 400, "not valid JSON"),
        (AUTH, b"[1, 2]", 400, "must be a JSON object"),
        (AUTH, json.dumps({"images": [], "prompts": []}).encode(), 400, "at least 1"),
        (AUTH, json.dumps({"images": ["x"], "prompts": ["a", "b"]}).encode(), 400, "1 images and 2 prompts"),
        (AUTH, json.dumps({"images": ["%%%"], "prompts": ["a"]}).encode(), 400, "not valid base64"),
        (AUTH, json.dumps({"images": [not_png], "prompts": ["a"]}).encode(), 400, "not a PNG"),
        (AUTH, json.dumps({"images": [], "prompts": [], "pickle": "no"}).encode(), 400, "unknown fields"),
        (AUTH, _body(images, prompts, reward="digits"), 409, "serves reward 'jpeg_compressibility', not 'digits'"),
        (AUTH, b"x" * 300_000, 413, "exceeds this server's limit of 200000 bytes"),
    ]
    for headers, body, status, message in cases:
        got_status, answer = _post(url, body, headers)
        assert (got_status, message in answer["error"]) == (status, True), (status, answer)
        # the server still answers a good request correctly after each bad one
        assert _post(url, good, AUTH) == (200, {"reward": "jpeg_compressibility", "scores": {"jpeg_compressibility": expected}})
    assert _post(url, good, AUTH, path="/nope")[0] == 404
    errors = dict(jpeg_server.stats["errors"])
    assert errors[401] >= 2 and errors[400] >= 7 and errors[409] >= 1 and errors[413] >= 1
    # the client: a wrong token fails at once (no retry), naming the server and the fix
    client = RemoteReward(url, token="wrong", retries=3, backoff=0.01)
    with pytest.raises(RewardError, match=rf"reward server at {re.escape(url)}/score answered HTTP 401.*check the token"):
        client(images, prompts)
    assert client.stats == {"requests": 1, "attempts": 1, "retries": 0, "failures": 1}


def test_reward_error_is_500_with_message_not_retried():
    def nan_for_bad(images, prompts, metadata=None):
        return {"flaky": torch.tensor([float("nan") if p == "bad" else 0.25 for p in prompts])}

    with RewardServer(nan_for_bad, name="flaky", port=0, token=TOKEN) as server:
        client = RemoteReward(server.url, token=TOKEN, retries=2, backoff=0.01)
        with pytest.raises(RewardError, match=r"HTTP 500: reward 'flaky' failed: RewardError: reward 'flaky' returned nan for sample 1"):
            client(_images(3, seed=0), ["ok", "bad", "ok"])
        assert client.stats["attempts"] == 1  # a reward error is not retried
        assert client(_images(2, seed=0), ["ok", "ok"])["flaky"].tolist() == [0.25, 0.25]


def test_concurrent_requests_merge_into_one_call_and_errors_stay_with_their_request():
    """4 requests within the merge window: one reward call, each answer its own slice; a NaN in one
    request makes the merged call fail, the server re-runs each alone and only that request gets 500."""
    calls: list[int] = []

    def mean_or_nan(images, prompts, metadata=None):
        calls.append(images.shape[0])
        return {"mean": torch.tensor([float("nan") if p == "bad" else float(v) for p, v in zip(prompts, images.float().mean(dim=(1, 2, 3)))])}

    with RewardServer(mean_or_nan, name="mean", port=0, token=TOKEN, batch_wait_s=0.5) as server:
        batches = [(_images(k + 1, seed=k), [f"p{k}"] * (k + 1)) for k in range(4)]

        def send(batch):
            return RemoteReward(server.url, token=TOKEN, retries=0)(*batch)["mean"]

        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(send, batches))
        assert calls == [1 + 2 + 3 + 4]
        for (images, _), out in zip(batches, outs):
            torch.testing.assert_close(out, images.float().mean(dim=(1, 2, 3)), rtol=0, atol=1e-5)
        calls.clear()
        batches[2] = (batches[2][0], ["p", "bad", "p"])
        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(send, batch) for batch in batches]
        errors = [f.exception() for f in futures]
        assert calls[0] == 10 and sorted(calls[1:]) == [1, 2, 3, 4]  # merged call failed; each request re-run alone (arrival order)
        assert [e is None for e in errors] == [True, True, False, True]
        assert "returned nan for sample 1" in str(errors[2])  # the index within its own request
        torch.testing.assert_close(futures[3].result(), batches[3][0].float().mean(dim=(1, 2, 3)), rtol=0, atol=1e-5)


def test_the_rewards_input_rejections_get_422_with_its_message_and_are_not_retried():
    """A prompt outside the reward's grammar and a 10,000-character prompt are the client's input: the reward's
    ValueError answers 422 with its message (cut in the middle when it quotes a long prompt), the client raises at
    once, and the server keeps serving; the reward's own faults stay 500 (test_reward_error_is_500_…)."""
    with RewardServer(build_reward("digits"), port=0, token=TOKEN) as server:
        good = _images(1, seed=0)
        grammar = "is not of the form 'a <colour> <digit>'"
        status, answer = _post(server.url, _body(good, ["the quick brown fox"]), AUTH)
        assert status == 422 and answer["error"].startswith("reward 'digits' rejected the request: ValueError: digits prompt 'the quick brown fox' "
                                                            + grammar), answer
        status, answer = _post(server.url, _body(good, ["a red seven " + "x" * 9_988]), AUTH)
        assert status == 422 and answer["error"].startswith("reward 'digits' rejected the request: ValueError: digits prompt 'a red seven xxx"), answer
        assert grammar in answer["error"] and "characters left out" in answer["error"] and len(answer["error"]) < 2_200
        assert _post(server.url, _body(good, ["a red seven"]), AUTH)[0] == 200  # still serving
        client = RemoteReward(server.url, token=TOKEN, retries=3, backoff=0.01)
        with pytest.raises(RewardError, match=r"answered HTTP 422: reward 'digits' rejected the request: ValueError: digits prompt 'a blue ban"):
            client(good, ["a blue banana"])
        assert client.stats == {"requests": 1, "attempts": 1, "retries": 0, "failures": 1}
        assert server.stats["errors"][422] == 3 and 500 not in server.stats["errors"]


def test_an_image_the_reward_cannot_read_gets_422():
    """A 1×1 PNG to a reward that checks its input size (ValueError): 422 with the reward's message."""
    with RewardServer(build_reward("digits_gold2"), port=0, token=TOKEN) as server:
        status, answer = _post(server.url, _body(_images(1, seed=0, size=1), ["a red seven"]), AUTH)
        assert (status, answer) == (422, {"error": "reward 'digits_gold2' rejected the request: ValueError: digits_gold2 reads uint8 images "
                                                   "[B, 3, 16, 16], got torch.uint8 (1, 3, 1, 1)"})
        assert _post(server.url, _body(_images(1, seed=0), ["a red seven"]), AUTH)[0] == 200


def test_a_one_pixel_png_to_digits_gets_422():
    with RewardServer(build_reward("digits"), port=0, token=TOKEN) as server:
        status, answer = _post(server.url, _body(_images(1, seed=0, size=1), ["a red seven"]), AUTH)
        assert status == 422 and answer["error"].startswith("reward 'digits' rejected the request: ValueError:"), (status, answer)


def _head(method: str, path: str, size: int) -> bytes:
    """A request head of exactly ``size`` bytes (an ``X-Pad`` header fills it)."""
    start, end = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: ".encode(), b"\r\n\r\n"
    return start + b"p" * (size - len(start) - len(end)) + end


def test_request_headers_over_16_kib_get_400_on_every_route(jpeg_server):
    """docs/rewards.md: request headers over 16 KiB get 400, whatever the route, whether they arrive whole (the
    app's JSON answer) or in pieces (h11's limit, uvicorn's plain text); the server keeps serving."""
    from diffrl.tools.reward_server import MAX_HEADER_BYTES
    from tests.faults.reward_server_attacks import read_raw

    host, port = jpeg_server.url.removeprefix("http://").split(":")
    assert MAX_HEADER_BYTES == 16 * 1024

    def send(data: bytes) -> tuple[int, bytes]:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(data)
            return read_raw(sock)

    # GET /health with a 64 KiB header, as a client library sends it
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", "/health", headers={"X-Big": "a" * (64 << 10)})
        response = conn.getresponse()
        assert response.status == 400, response.read()
    finally:
        conn.close()
    for method, path in [("GET", "/health"), ("POST", "/score"), ("GET", "/nope"), ("PUT", "/health")]:
        status, body = send(_head(method, path, MAX_HEADER_BYTES + 1))
        assert status == 400 and b"over this server's limit of 16384 bytes" in body, (method, path, status, body)
    assert send(_head("GET", "/health", MAX_HEADER_BYTES))[0] == 200  # the limit itself is allowed
    # the first 20,000 bytes of a longer head, no end in sight: h11 refuses the incomplete head
    assert send(_head("GET", "/health", 64 << 10)[:20_000]) == (400, b"Invalid HTTP request received.")
    assert _post(jpeg_server.url, _body(_images(1, seed=0), ["a"]), AUTH)[0] == 200


class _Flaky503(BaseHTTPRequestHandler):
    """Answers 503 to the first ``fail_first`` POSTs, then 200 with score = 1000 · (request number)."""

    fail_first = 2
    count = 0

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).count += 1
        status, answer = (503, {"error": "warming up"}) if type(self).count <= self.fail_first else \
            (200, {"reward": "x", "scores": {"x": [1000.0 * type(self).count] * len(body["prompts"])}})
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_transient_503_is_retried_with_backoff():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky503)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        client = RemoteReward(f"http://127.0.0.1:{httpd.server_address[1]}", token="", retries=3, backoff=0.1)
        start = time.perf_counter()
        out = client(_images(2, seed=0), ["a", "b"])
        elapsed = time.perf_counter() - start
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert out["x"].tolist() == [3000.0, 3000.0]  # the third request is the first answered
    assert client.stats == {"requests": 1, "attempts": 3, "retries": 2, "failures": 0}
    assert 0.1 + 0.2 <= elapsed < 3.0  # backoff 0.1 · 2^0 + 0.1 · 2^1


def _read_line(stream, deadline_s: float) -> str:
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(deadline_s)
    return out[0] if out else ""


@pytest.mark.exact  # a served JPEG reward against the same in-process one, bit for bit; messages: not in the numerics rerun (conftest.py)
def test_killed_server_retries_then_fails_clearly(tmp_path):
    """``diffrl serve-reward`` in a subprocess; scored once; killed; the client retries twice and raises."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "diffrl.tools.cli", "serve-reward", "reward=jpeg_compressibility", "reward.options.quality=80",
                             "--port", "0", "--token-file", str(token_file)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = _read_line(proc.stdout, 60)
        match = re.search(r"at (http://127\.0\.0\.1:\d+)", line)
        assert match, (line, proc.poll())
        url = match.group(1)
        client = build_reward("remote", url=url, token=TOKEN, reward="jpeg_compressibility", timeout=5, retries=2, backoff=0.05)
        images, prompts = _images(4, seed=3), ["a"] * 4
        expected = build_reward("jpeg_compressibility", quality=80)(images, prompts)["jpeg_compressibility"]
        assert torch.equal(client(images, prompts)["jpeg_compressibility"], expected)
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
    start = time.perf_counter()
    with pytest.raises(RewardError, match=rf"reward server at {re.escape(url)}/score failed after 3 attempts \(2 retries\): cannot connect"):
        client(images, prompts)
    assert time.perf_counter() - start < 5.0
    assert client.stats == {"requests": 2, "attempts": 4, "retries": 2, "failures": 1}


def test_hanging_server_hits_the_timeout():
    """A server that accepts connections and never answers: each attempt times out after ``timeout`` seconds."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        client = RemoteReward(f"http://127.0.0.1:{listener.getsockname()[1]}", token=TOKEN, timeout=0.3, retries=1, backoff=0.05)
        start = time.perf_counter()
        with pytest.raises(RewardError, match=r"failed after 2 attempts \(1 retries\): timed out after 0.3 s"):
            client(_images(1, seed=0), ["a"])
        elapsed = time.perf_counter() - start
    finally:
        stop.set()
        thread.join(5)
        for conn in held:
            conn.close()
        listener.close()
    assert 2 * 0.3 + 0.05 <= elapsed < 3.0
    assert client.stats["attempts"] == 2 and len(held) == 2


def test_serve_reward_arguments():
    assert parse_reward_args(["reward=jpeg_compressibility", "reward.options.quality=80"]) == ("jpeg_compressibility", {"quality": 80})
    assert parse_reward_args(["reward=digits", "+reward.options.digits.path=/m", "reward.options.device=null"]) == \
        ("digits", {"path": "/m", "device": None})
    with pytest.raises(ValueError, match="unknown key 'reward.names'"):
        parse_reward_args(["reward.names=[digits]"])
    with pytest.raises(ValueError, match="give the reward to serve as reward=<name>"):
        parse_reward_args([])


def test_serve_reward_cli_errors(capsys, monkeypatch, tmp_path):
    """One-line errors: no token, a token in argv (visible in ``ps``), --no-token off loopback, an unknown reward, a busy port."""
    monkeypatch.delenv("DIFFRL_REWARD_TOKEN", raising=False)
    assert main(["serve-reward", "reward=jpeg_compressibility", "--port", "0"]) == 2
    assert "give a bearer token (--token-file F or $DIFFRL_REWARD_TOKEN)" in capsys.readouterr().err
    assert main(["serve-reward", "reward=jpeg_compressibility", "--port", "0", "--token", "t"]) == 2
    assert "--token is refused (the process list shows it to every user); use --token-file F or $DIFFRL_REWARD_TOKEN" in capsys.readouterr().err
    assert main(["serve-reward", "reward=jpeg_compressibility", "--host", "0.0.0.0", "--port", "0", "--no-token"]) == 2
    assert "--no-token is allowed on a loopback --host only, not '0.0.0.0'" in capsys.readouterr().err
    (tmp_path / "empty").write_text("\n")
    assert main(["serve-reward", "reward=jpeg_compressibility", "--port", "0", "--token-file", str(tmp_path / "empty")]) == 2
    assert "is empty; write the token into it" in capsys.readouterr().err
    assert main(["serve-reward", "reward=jpeg_compressibility", "--port", "0", "--token-file", str(tmp_path / "missing")]) == 2
    assert "cannot read --token-file" in capsys.readouterr().err
    monkeypatch.setenv("DIFFRL_REWARD_TOKEN", "t")
    assert main(["serve-reward", "reward=no_such_reward", "--port", "0"]) == 2
    assert "unknown reward 'no_such_reward'" in capsys.readouterr().err
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        assert main(["serve-reward", "reward=jpeg_compressibility", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    with pytest.raises(ValueError, match="without a token is allowed on a loopback host only, not '0.0.0.0'"):
        RewardServer(build_reward("jpeg_compressibility"), host="0.0.0.0", port=0, token=None)
    with pytest.raises(ValueError, match="body_timeout_s must be > 0"):
        RewardServer(build_reward("jpeg_compressibility"), port=0, token="t", body_timeout_s=0)


# ---------------------------------------------------------------------------------------------- VLM judge

class _FakeOpenAI(BaseHTTPRequestHandler):
    """``POST /v1/chat/completions``: replies by the prompt in the text (see REPLIES); records every request."""

    requests: ClassVar[list] = []
    throttle_first = 0

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        if type(self).throttle_first > 0:
            type(self).throttle_first -= 1
            status, answer = 429, {"error": {"message": "rate limited"}}
        else:
            text = body["messages"][-1]["content"][0]["text"]
            prompt = re.search(r'description "(.*?)"', text).group(1)
            status, answer = 200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": REPLIES[prompt]}}]}
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


REPLIES = {"a red seven": "Score: 7", "a blue one": "8/10", "a green two": "I cannot tell.", "a cat": "Score: 11",
           "a dog": "**Score:** 2.5 — blurry", "a car": "10"}


@pytest.fixture
def fake_openai():
    _FakeOpenAI.requests = []
    _FakeOpenAI.throttle_first = 0
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


def test_vlm_judge_request_format_parsing_and_failures(fake_openai):
    import numpy as np
    from PIL import Image

    judge = build_reward("vlm_judge", url=fake_openai, model="qwen-vl-test", api_key="sk-test", concurrency=4, max_failure_rate=0.5)
    prompts = ["a red seven", "a blue one", "a green two", "a cat", "a dog", "a car"]
    images = _images(6, seed=5, size=12)
    out = score({"vlm_judge": (judge, 1.0)}, images, prompts)
    parsed_mean = (0.7 + 0.8 + 0.25 + 1.0) / 4
    torch.testing.assert_close(out["reward/vlm_judge"], torch.tensor([0.7, 0.8, parsed_mean, parsed_mean, 0.25, 1.0]))
    assert out["reward/vlm_judge_parse_failures"].tolist() == [0, 0, 1, 1, 0, 0]  # no match; 11 is outside [0, 10]
    assert judge.stats["parse_failures"] == 2 and judge.stats["requests"] == 6
    # the request: OpenAI chat/completions with the template filled and the exact image as a PNG data URI
    assert len(_FakeOpenAI.requests) == 6
    by_prompt = {re.search(r'"(.*?)"', r["body"]["messages"][-1]["content"][0]["text"]).group(1): r for r in _FakeOpenAI.requests}
    request = by_prompt["a blue one"]
    assert request["path"] == "/v1/chat/completions" and request["auth"] == "Bearer sk-test"
    body = request["body"]
    assert (body["model"], body["temperature"], body["max_tokens"], len(body["messages"])) == ("qwen-vl-test", 0.0, 16, 1)
    text, image = body["messages"][0]["content"]
    assert text == {"type": "text", "text": 'Rate how well this image matches the description "a blue one" on a scale from 0 to 10, '
                                            'where 10 means a perfect match. Answer with "Score: <number>" and nothing else.'}
    assert image["type"] == "image_url" and image["image_url"]["url"].startswith("data:image/png;base64,")
    png = base64.b64decode(image["image_url"]["url"].split(",", 1)[1])
    decoded = torch.from_numpy(np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).copy()).permute(2, 0, 1)
    assert torch.equal(decoded, images[1])
    # beyond the failure threshold the call raises, quoting the replies
    strict = build_reward("vlm_judge", url=fake_openai, model="m", max_failure_rate=0.25, failure_score=0.0, system_prompt="Be strict.")
    with pytest.raises(RewardError, match=r"could not parse a score in \[0, 10\] from 2 of 6 replies.*sample 2: 'I cannot tell.'"):
        score({"vlm_judge": (strict, 1.0)}, images, prompts)
    assert _FakeOpenAI.requests[-1]["body"]["messages"][0] == {"role": "system", "content": "Be strict."}
    assert strict.stats["parse_failures"] == 2


def test_vlm_judge_retries_rate_limits_and_custom_scale(fake_openai):
    _FakeOpenAI.throttle_first = 2
    judge = build_reward("vlm_judge", url=fake_openai + "/chat/completions", model="m", api_key="", api_key_env="DIFFRL_NO_SUCH_ENV",
                         min_score=1, max_score=11, concurrency=1, backoff=0.01, retries=2)
    out = judge(to_pil(_images(2, seed=0)), ["a cat", "a car"])  # called directly with PIL images
    assert out["vlm_judge"].tolist() == pytest.approx([1.0, 0.9])  # (11 − 1)/10, (10 − 1)/10
    assert out["vlm_judge_parse_failures"].tolist() == [0.0, 0.0]
    assert judge.stats["retries"] == 2 and _FakeOpenAI.requests[0]["auth"] is None
    _FakeOpenAI.throttle_first = 5
    with pytest.raises(RewardError, match=r"VLM judge endpoint at .*/v1/chat/completions failed after 3 attempts .*HTTP 429"):
        judge(_images(1, seed=0), ["a car"])
