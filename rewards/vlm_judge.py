"""``vlm_judge``: a vision-language model, behind any OpenAI-compatible ``/chat/completions`` endpoint
(vLLM, SGLang, TGI, llama.cpp server, OpenAI …), rates how well each image matches its prompt.

Per image, one request (``concurrency`` in flight)::

    {"model": model, "temperature": 0, "max_tokens": 16,
     "messages": [{"role": "system", "content": system_prompt},            # only if given
                  {"role": "user", "content": [
                      {"type": "text", "text": prompt_template with {prompt}, {min_score}, {max_score} filled},
                      {"type": "image_url", "image_url": {"url": "data:image/png;base64,…"}}]}]}

The reply text (``choices[0].message.content``) is searched with each pattern of ``score_regex`` in
turn; the first match's group 1 is the raw score ``s``, and the reward is
``(s − min_score) / (max_score − min_score)`` ∈ [0, 1]. A reply with no match, or a value outside
``[min_score, max_score]``, is a *parse failure*: it is counted (``stats["parse_failures"]``), flagged
per sample in the output ``"<name>_parse_failures"`` (1.0 = failed), and scored ``failure_score``
(default: the mean of the successfully parsed scores of the same call, so it does not move the group
mean). If more than ``max_failure_rate`` of a call's samples fail (or all do), the call raises
:class:`~rewards.base.RewardError` quoting replies — never a silent 0.
"""

from __future__ import annotations

import base64
import io
import os
import re
import threading
from typing import Any

import torch

from rewards.base import Reward, RewardError, register_reward, to_pil
from rewards.remote import post_json

DEFAULT_TEMPLATE = (
    'Rate how well this image matches the description "{prompt}" on a scale from {min_score} to {max_score}, '
    "where {max_score} means a perfect match. Answer with \"Score: <number>\" and nothing else."
)
DEFAULT_SCORE_REGEX = (r"(?i)score\s*[:=]?\s*\**\s*(-?\d+(?:\.\d+)?)", r"^\s*(-?\d+(?:\.\d+)?)\s*(?:/\s*\d+(?:\.\d+)?)?\s*\.?\s*$")
RETRY_STATUSES = (408, 429, 500, 502, 503, 504)


def png_data_uri(image) -> str:
    """A PIL image → ``data:image/png;base64,…``."""
    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def reply_text(answer: Any) -> str | None:
    """``choices[0].message.content`` of a chat-completions answer (a string or a list of text parts); ``None`` if absent."""
    try:
        content = answer["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        return None
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else None


@register_reward("vlm_judge")
class VLMJudge(Reward):
    """Image–prompt agreement rated by a VLM behind an OpenAI-compatible endpoint (see module docstring).

    Args:
        url: base URL of the API (``http://host:8000/v1``; ``/chat/completions`` is appended unless present).
        model: the model name the endpoint serves.
        api_key: bearer key; ``None``: ``$<api_key_env>`` if set, else no ``Authorization`` header.
        api_key_env: environment variable holding the key.
        prompt_template: user text; ``{prompt}``, ``{min_score}``, ``{max_score}`` are replaced (other braces kept).
        system_prompt: optional system message.
        min_score, max_score: the judge's rating scale, mapped linearly to [0, 1].
        score_regex: a pattern or list of patterns with one group (the number), tried in order.
        max_tokens, temperature: sampling settings sent with each request (``max_tokens=None``: not sent).
        extra_body: more JSON fields for each request (e.g. ``{"top_p": 1}``).
        timeout, retries, backoff: per request, as for the ``remote`` reward (429/5xx are retried).
        concurrency: requests in flight at once.
        max_failure_rate: the largest fraction of parse failures in one call before it raises.
        failure_score: score of a failed sample in [0, 1]; ``None``: the mean of the call's parsed scores.
        batch_size: most images per call (``None``: any).
    """

    unit = "judge rating mapped to [0, 1]"
    scale = (0.0, 1.0)
    input = "pil"

    def __init__(self, url: str, model: str, api_key: str | None = None, api_key_env: str = "OPENAI_API_KEY",
                 prompt_template: str = DEFAULT_TEMPLATE, system_prompt: str | None = None, min_score: float = 0.0,
                 max_score: float = 10.0, score_regex: str | list[str] | tuple[str, ...] = DEFAULT_SCORE_REGEX,
                 max_tokens: int | None = 16, temperature: float = 0.0, extra_body: dict | None = None, timeout: float = 60.0,
                 retries: int = 3, backoff: float = 1.0, concurrency: int = 8, max_failure_rate: float = 0.25,
                 failure_score: float | None = None, batch_size: int | None = None):
        if not max_score > min_score:
            raise ValueError(f"vlm_judge: need max_score > min_score, got [{min_score}, {max_score}]")
        if not 0.0 <= max_failure_rate <= 1.0:
            raise ValueError(f"vlm_judge: max_failure_rate must be in [0, 1], got {max_failure_rate}")
        if failure_score is not None and not 0.0 <= failure_score <= 1.0:
            raise ValueError(f"vlm_judge: failure_score must be in [0, 1] or None, got {failure_score}")
        if "{prompt}" not in prompt_template:
            raise ValueError("vlm_judge: prompt_template must contain {prompt}")
        patterns = [score_regex] if isinstance(score_regex, str) else list(score_regex)
        try:
            self.patterns = [re.compile(p) for p in patterns]
        except re.error as exc:
            raise ValueError(f"vlm_judge: bad score_regex ({exc})") from exc
        if not self.patterns or any(p.groups < 1 for p in self.patterns):
            raise ValueError("vlm_judge: every score_regex needs one capturing group around the number")
        base = url.rstrip("/")
        self.endpoint = base if base.endswith("/chat/completions") else base + "/chat/completions"
        self.model = model
        self.api_key = api_key if api_key is not None else os.environ.get(api_key_env)
        self.prompt_template, self.system_prompt = prompt_template, system_prompt
        self.min_score, self.max_score = float(min_score), float(max_score)
        self.max_tokens, self.temperature, self.extra_body = max_tokens, float(temperature), dict(extra_body or {})
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self.concurrency, self.max_failure_rate, self.failure_score = max(1, int(concurrency)), float(max_failure_rate), failure_score
        self.batch_size = batch_size
        self.stats = {"requests": 0, "attempts": 0, "retries": 0, "failures": 0, "parse_failures": 0}
        self._lock = threading.Lock()

    def _fmt(self, number: float) -> str:
        return f"{number:g}"

    def request_body(self, image, prompt: str) -> dict:
        """The chat-completions request for one PIL image and its prompt."""
        text = (self.prompt_template.replace("{prompt}", prompt)
                .replace("{min_score}", self._fmt(self.min_score)).replace("{max_score}", self._fmt(self.max_score)))
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages.append({"role": "user", "content": [{"type": "text", "text": text},
                                                     {"type": "image_url", "image_url": {"url": png_data_uri(image)}}]})
        body = {"model": self.model, "messages": messages, "temperature": self.temperature}
        if self.max_tokens is not None:
            body["max_tokens"] = int(self.max_tokens)
        body.update(self.extra_body)
        return body

    def parse(self, reply: str | None) -> float | None:
        """The reply's score mapped to [0, 1], or ``None`` (a parse failure)."""
        if reply is None:
            return None
        for pattern in self.patterns:
            match = pattern.search(reply)
            if match:
                try:
                    value = float(match.group(1))
                except ValueError:
                    return None
                if not self.min_score <= value <= self.max_score:
                    return None
                return (value - self.min_score) / (self.max_score - self.min_score)
        return None

    def _ask(self, job: tuple) -> str | None:
        image, prompt = job
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        with self._lock:
            self.stats["requests"] += 1
        answer = post_json(self.endpoint, self.request_body(image, prompt), headers=headers, timeout=self.timeout, retries=self.retries,
                           backoff=self.backoff, retry_statuses=RETRY_STATUSES, stats=self.stats, lock=self._lock, what="VLM judge endpoint")
        return reply_text(answer)

    def __call__(self, images, prompts: list[str], metadata: Any = None) -> dict[str, torch.Tensor]:
        pil = to_pil(images) if isinstance(images, torch.Tensor) else list(images)
        if len(pil) != len(prompts):
            raise ValueError(f"vlm_judge: got {len(prompts)} prompts for {len(pil)} images")
        jobs = list(zip(pil, prompts))
        if self.concurrency > 1 and len(jobs) > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(min(self.concurrency, len(jobs))) as pool:
                replies = list(pool.map(self._ask, jobs))
        else:
            replies = [self._ask(job) for job in jobs]
        parsed = [self.parse(r) for r in replies]
        failed = [i for i, v in enumerate(parsed) if v is None]
        with self._lock:
            self.stats["parse_failures"] += len(failed)
        if failed and (len(failed) == len(parsed) or len(failed) > self.max_failure_rate * len(parsed)):
            examples = "; ".join(f"sample {i}: {str(replies[i])[:80]!r}" for i in failed[:3])
            raise RewardError(f"vlm_judge: could not parse a score in [{self._fmt(self.min_score)}, {self._fmt(self.max_score)}] from "
                              f"{len(failed)} of {len(parsed)} replies of {self.endpoint} (limit max_failure_rate={self.max_failure_rate}): "
                              f"{examples}; adjust prompt_template / score_regex / min_score / max_score")
        good = [v for v in parsed if v is not None]
        fill = self.failure_score if self.failure_score is not None else (sum(good) / len(good) if good else 0.0)
        scores = torch.tensor([fill if v is None else v for v in parsed], dtype=torch.float32)
        flags = torch.zeros(len(parsed))
        flags[failed] = 1.0
        return {self.name: scores, f"{self.name}_parse_failures": flags}
