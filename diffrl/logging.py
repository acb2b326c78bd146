"""Run logging: per-step JSONL metrics, image grids (PNG), a progress bar.

The JSONL file is appended and flushed line by line, so a run that stops early keeps every step it
finished.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch


class JsonlWriter:
    """Append one JSON object per line to ``path`` (flushed after each line)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fh = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._fh.write(json.dumps(record, default=float) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def image_grid(images: torch.Tensor, *, columns: int | None = None, scale: int = 1, padding: int = 1):
    """uint8 ``[N, 3, H, W]`` → a PIL image of the images on a grid (``scale``× nearest upsampling)."""
    from PIL import Image

    n, _, h, w = images.shape
    columns = columns or math.ceil(math.sqrt(n))
    rows = math.ceil(n / columns)
    canvas = torch.full((3, rows * (h + padding) + padding, columns * (w + padding) + padding), 64, dtype=torch.uint8)
    for i in range(n):
        r, c = divmod(i, columns)
        top, left = padding + r * (h + padding), padding + c * (w + padding)
        canvas[:, top : top + h, left : left + w] = images[i]
    img = Image.fromarray(canvas.permute(1, 2, 0).contiguous().numpy())
    if scale > 1:
        img = img.resize((img.width * scale, img.height * scale), Image.NEAREST)
    return img


def save_grid(images: torch.Tensor, path: str | Path, **kwargs) -> Path:
    """Write :func:`image_grid` to ``path`` (PNG) via a temporary file and rename."""
    import os

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.png")
    image_grid(images, **kwargs).save(tmp)
    os.replace(tmp, path)
    return path


class Progress:
    """A tqdm bar over RL steps showing the latest reward/loss (silent when disabled)."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, desc: str = "train"):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)

    def update(self, **postfix) -> None:
        if self.bar is not None:
            self.bar.set_postfix({k: f"{v:.4g}" if isinstance(v, float) else v for k, v in postfix.items()}, refresh=False)
            self.bar.update(1)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
