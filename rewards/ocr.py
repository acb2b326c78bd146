"""Text rendering reward (Flow-GRPO's OCR task): does the image show the text quoted in the prompt?

The target is the text between double quotes in the prompt (``'a sign that says "HELLO"'`` → ``HELLO``;
straight ``"…"`` or curly ``“…”`` quotes; several quoted parts are joined with a space), or, when ``metadata``
is a list of per-sample dicts with a ``"text"`` key (the ``ocr`` prompt set's rows), that text. The image is
read by the PP-OCRv4 detection + recognition models (and the direction classifier) that ship inside the
``rapidocr-onnxruntime`` wheel: real models, offline, nothing is downloaded. The recognised lines (in
reading order, each with recognition confidence ≥ ``min_confidence``) are joined into one string.

Both strings are compared after :func:`normalise_text` (lower case, whitespace removed, as Flow-GRPO's
OCR scorer does). With ``d`` the Levenshtein distance between them and ``n`` the target's length::

    ocr = 1 − min(d, n) / n        ∈ [0, 1]   (1: exact match, 0: nothing of the target is there)

A prompt without quoted text has no target: :class:`OcrReward` raises ``ValueError`` naming the prompt
(the fix is to quote the text to render, or to use another reward for that prompt set).

>>> edit_distance("kitten", "sitting"), ocr_score("hell o", "HELLO"), ocr_score("", "HELLO")
(3, 1.0, 0.0)
"""

from __future__ import annotations

import re
from typing import Any

import torch

from rewards.base import Reward, register_reward

_QUOTED = re.compile(r'"([^"]*)"|“([^”]*)”')


def quoted_text(prompt: str) -> str:
    """The text between double quotes in ``prompt`` (parts joined by a space).

    Raises:
        ValueError: naming the prompt when it quotes no (non-empty) text.
    """
    parts = [a if a is not None and a != "" else b for a, b in _QUOTED.findall(prompt)]
    parts = [p.strip() for p in parts if p and p.strip()]
    if not parts:
        raise ValueError(
            f"the ocr reward needs the text to render in double quotes in the prompt, e.g. "
            f"'a sign that says \"HELLO\"'; prompt {prompt!r} quotes no text. Quote the text in the prompt "
            "file (trainer.prompts) or use another reward for these prompts."
        )
    return " ".join(parts)


def metadata_texts(metadata: Any, n: int) -> list[str] | None:
    """The targets given as metadata: a list/tuple of ``n`` dicts, each with a non-empty string ``"text"``;
    None otherwise (then the quoted text of each prompt is the target)."""
    if not isinstance(metadata, (list, tuple)) or len(metadata) != n:
        return None
    if not all(isinstance(m, dict) and isinstance(m.get("text"), str) and m["text"].strip() for m in metadata):
        return None
    return [m["text"] for m in metadata]


def normalise_text(text: str) -> str:
    """Lower case with all whitespace removed (OCR splits and spaces words unreliably)."""
    return "".join(text.lower().split())


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions each cost 1), two-row dynamic programme."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_score(recognised: str, target: str) -> float:
    """``1 − min(d, n) / n`` with ``d`` the edit distance of the normalised strings and ``n`` the target's length."""
    recognised, target = normalise_text(recognised), normalise_text(target)
    if not target:
        raise ValueError("the OCR target text is empty after removing whitespace")
    return 1.0 - min(edit_distance(recognised, target), len(target)) / len(target)


@register_reward("ocr")
class OcrReward(Reward):
    """``1 − normalised edit distance`` between the PP-OCRv4 reading of the image and the prompt's quoted text.

    Args:
        min_confidence: recognised lines below this recognition confidence are dropped (RapidOCR's ``text_score``).
        threads: onnxruntime intra-op threads (``None``: torch's current thread count, ``trainer.threads``).
        use_direction_classifier: run the 0°/180° text direction classifier before recognition.
        det_limit_type: how the text detector sizes an image: ``"max"`` (default) reads it at its own size (rounded to
            a multiple of 32; PaddleOCR's default for images up to 960 px, the reading Flow-GRPO's OCR reward runs);
            ``"min"`` (RapidOCR's own default) first upscales its shorter side to 736 px: a 512² image costs ~2× the
            detector, a 32² test image ~500×, and the readings differ slightly.
    """

    unit = "1 − normalised edit distance, in [0, 1]"
    scale = (0.0, 1.0)
    input = "uint8"

    def __init__(self, min_confidence: float = 0.5, threads: int | None = None, use_direction_classifier: bool = True,
                 det_limit_type: str = "max"):
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "the ocr reward needs the rapidocr-onnxruntime wheel (it ships the PP-OCRv4 models): "
                "pip install rapidocr-onnxruntime"
            ) from exc
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], got {min_confidence}")
        if det_limit_type not in ("max", "min"):
            raise ValueError(f"det_limit_type must be 'max' or 'min', got {det_limit_type!r}")
        kwargs: dict[str, Any] = {"text_score": float(min_confidence), "use_cls": bool(use_direction_classifier), "det_limit_type": det_limit_type}
        threads = torch.get_num_threads() if threads is None else int(threads)
        if threads < 1:
            raise ValueError(f"threads must be ≥ 1, got {threads}")
        kwargs.update(intra_op_num_threads=threads, inter_op_num_threads=1)
        self.engine = RapidOCR(**kwargs)
        self.min_confidence = float(min_confidence)

    def read(self, image: torch.Tensor) -> str:
        """The text PP-OCRv4 reads in one uint8 ``[3, H, W]`` RGB image (lines joined by spaces, reading order)."""
        if image.dtype != torch.uint8 or image.ndim != 3 or image.shape[0] != 3:
            raise ValueError(f"expected a uint8 [3, H, W] image, got {image.dtype} {tuple(image.shape)}")
        bgr = image.permute(1, 2, 0).flip(-1).contiguous().cpu().numpy()  # RapidOCR takes arrays as BGR (OpenCV)
        result, _ = self.engine(bgr, text_score=self.min_confidence)
        if not result:
            return ""
        return " ".join(str(text) for _box, text, _confidence in result)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> dict[str, torch.Tensor]:
        if images.ndim != 4 or images.shape[1] != 3 or images.dtype != torch.uint8:
            raise ValueError(f"ocr reward: expected uint8 images [B, 3, H, W], got {images.dtype} {tuple(images.shape)}")
        if len(prompts) != images.shape[0]:
            raise ValueError(f"ocr reward: {len(prompts)} prompts for {images.shape[0]} images")
        targets = metadata_texts(metadata, len(prompts))  # per-sample {"text": …} rows (diffrl.prompt_sets.ocr)
        if targets is None:
            targets = [quoted_text(p) for p in prompts]  # fail before running the models
        scores = [ocr_score(self.read(image), target) for image, target in zip(images, targets)]
        return {self.name: torch.tensor(scores, dtype=torch.float32)}
