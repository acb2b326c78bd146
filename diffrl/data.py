"""Data a run reads: prompt files, each step's prompts, offline preference pairs.

Nothing here touches a model: offline pairs are read as images and prompts, and the workers encode them
(``ActorRolloutRefWorker.encode_pairs``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tensordict import NonTensorStack, TensorDict

from diffrl.sampling.seeding import Stream, generator


def read_prompt_file(path: str | Path) -> list[str]:
    """Prompts of a text file, one per line (blank lines skipped)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist (trainer.prompts)")
    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts")
    return prompts


def step_prompts(prompts: list[str], step: int, prompts_per_step: int, seed: int) -> list[str]:
    """RL step ``step``'s prompts: positions ``step·P … step·P + P − 1`` of a seeded permutation per pass
    over ``prompts`` (stream ``PROMPT_ORDER``)."""
    n, P = len(prompts), prompts_per_step
    chosen = []
    for pos in range(step * P, step * P + P):
        epoch, offset = divmod(pos, n)
        perm = torch.randperm(n, generator=generator(seed, Stream.PROMPT_ORDER, epoch))
        chosen.append(prompts[int(perm[offset])])
    return chosen


def _image(file: Path) -> torch.Tensor:
    return torch.from_numpy(np.array(Image.open(file).convert("RGB"))).permute(2, 0, 1).float() / 255.0


def read_preference_pairs(path: str | Path) -> TensorDict:
    """Pairs from a jsonl or parquet file with columns ``prompt``, ``image_0``, ``image_1`` (image paths,
    relative to the file) and ``label_0`` (1: image_0 preferred, 0: image_1 preferred; 0.5: a tie, skipped).

    Returns:
        ``images_w``, ``images_l`` float ``[N, 3, H, W]`` in [0, 1] (winner, loser) and non-tensor ``prompts``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"preference pair file {path} does not exist (algorithm.preference_pairs)")
    if path.suffix == ".parquet":
        import pandas as pd

        rows = pd.read_parquet(path).to_dict("records")
    else:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    needed = {"prompt", "image_0", "image_1", "label_0"}
    images_w, images_l, prompts = [], [], []
    for i, row in enumerate(rows):
        missing = needed - set(row)
        if missing:
            raise ValueError(f"{path}: row {i} lacks {sorted(missing)}; every row needs {sorted(needed)}")
        label = float(row["label_0"])
        if label == 0.5:
            continue
        if label not in (0.0, 1.0):
            raise ValueError(f"{path}: row {i} has label_0={row['label_0']!r}; use 1 (image_0 wins), 0 (image_1 wins) or 0.5 (tie)")
        first, second = (row["image_0"], row["image_1"]) if label == 1.0 else (row["image_1"], row["image_0"])
        for target, name in ((images_w, first), (images_l, second)):
            file = (path.parent / name) if not Path(name).is_absolute() else Path(name)
            if not file.is_file():
                raise FileNotFoundError(f"{path}: row {i} names image {file}, which does not exist")
            target.append(_image(file))
        prompts.append(str(row["prompt"]))
    if not prompts:
        raise ValueError(f"{path} holds no decided pairs (every label_0 is 0.5 or the file is empty)")
    td = TensorDict({"images_w": torch.stack(images_w), "images_l": torch.stack(images_l)}, batch_size=[len(prompts)])
    td["prompts"] = NonTensorStack(*prompts)
    return td
