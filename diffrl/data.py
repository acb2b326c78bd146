"""Data a run reads: built-in prompt sets and prompt files, editing records, each step's prompts, offline preference pairs.

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

from diffrl.prompt_sets import is_prompt_set, load_prompt_set, prompt_set_names
from diffrl.sampling.seeding import Stream, generator
from pipelines.base import EditPrompt, resize_sources, split_prompts

EDIT_RECORD_KEYS = ("source", "instruction")
SOURCE_KEYS = ("source", "file_name", "image")  # an editing record's source image (diffrl, Hugging Face image folder, flow_grpo)
TEXT_KEYS = ("instruction", "prompt")
ROW_KEYS = (*SOURCE_KEYS, *TEXT_KEYS, "metadata")


def read_prompt_file(path: str | Path) -> list[str]:
    """Prompts of a text file, one per line (blank lines skipped)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist (trainer.prompts): give a file of one prompt per line, or a "
                                f"built-in set: {', '.join(prompt_set_names())}")
    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts")
    return prompts


def _records_file(path: Path) -> Path:
    return path / "metadata.jsonl" if path.is_dir() else path


def read_rows(path: str | Path) -> list[tuple[int, dict]]:
    """``(line number, row)`` of a JSONL file (or a folder's ``metadata.jsonl``); a line that is not a JSON object is a
    one-line error naming it."""
    file = _records_file(Path(path))
    if not file.is_file():
        raise FileNotFoundError(f"prompt records {file} do not exist (trainer.prompts: a JSONL file of {{prompt, metadata}} or "
                                f"{{source, instruction}} rows, or a folder with metadata.jsonl; built-in sets: {', '.join(prompt_set_names())})")
    return jsonl_rows(file)


def jsonl_rows(file: Path) -> list[tuple[int, dict]]:
    """``(line number, row)`` of an existing JSONL file, blank lines skipped; a line that is not a JSON object is a
    one-line error naming the file and line."""
    rows = []
    for i, line in enumerate(file.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{file}: line {i + 1} is not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{file}: line {i + 1} is not a JSON object")
        rows.append((i + 1, row))
    return rows


def is_edit_row(row: dict) -> bool:
    """An editing record names a source image (``source``, ``file_name`` or flow_grpo's ``image``)."""
    return any(key in row for key in SOURCE_KEYS)


def row_metadata(row: dict) -> dict | None:
    """A record's metadata: its ``metadata`` object, else every field besides the text and the source (a GenEval row's
    ``tag``, ``include``, ``exclude`` …, as flow_grpo's files hold them); None when there is none."""
    if "metadata" in row:
        return row["metadata"]
    rest = {k: v for k, v in row.items() if k not in ROW_KEYS}
    return rest or None


def _is_records(path: Path) -> bool:
    """A folder, a ``.jsonl`` file, or a file whose first non-blank line is a JSON object: records, not prompt lines."""
    if path.is_dir() or path.suffix == ".jsonl":
        return True
    if not path.is_file():
        return False
    with path.open() as f:
        first = next((line.strip() for line in f if line.strip()), "")
    return first.startswith("{")


def read_text_records(path: str | Path) -> list[str]:
    """Text-to-image prompts of a JSONL file whose rows hold ``prompt`` (a GenEval row ``{"prompt", "tag", "include", …}``
    or ``{"prompt", "metadata"}``); their metadata: :func:`read_metadata`."""
    file, prompts = _records_file(Path(path)), []
    for line, row in read_rows(path):
        if is_edit_row(row):
            raise ValueError(f"{file}: line {line} names a source image but earlier rows do not; give text prompts or editing records, not both")
        text = row.get("prompt", row.get("instruction"))
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{file}: line {line} lacks prompt; every row of a prompt file needs a 'prompt' text (GenEval rows: prompt, tag, include)")
        prompts.append(text.strip())
    if not prompts:
        raise ValueError(f"{file} holds no prompts")
    return prompts


def read_prompts(path: str | Path) -> list[str] | list[EditPrompt]:
    """``trainer.prompts``: a text file (one prompt per line, :func:`read_prompt_file`), or records: a JSONL file (or a
    folder with ``metadata.jsonl``) whose rows are editing records when they name a source image
    (:func:`read_edit_records`), else text prompts with metadata (:func:`read_text_records`). Rows are recognised by
    their fields, not by the file's extension."""
    path = Path(path)
    if not _is_records(path):
        return read_prompt_file(path)
    rows = read_rows(path)
    if path.is_dir() or (rows and is_edit_row(rows[0][1])):
        return read_edit_records(path)
    return read_text_records(path)


def read_metadata(path: str | Path) -> dict[str, dict]:
    """``{prompt or instruction: metadata}`` of a records file's rows that carry metadata (:func:`row_metadata`: a
    ``metadata`` object, or a GenEval row's own fields), e.g. the GenEval row the image should satisfy; the rewards
    receive it per sample. Two rows with one text must not carry different metadata. Empty for a text file."""
    path = Path(path)
    if not _is_records(path):
        return {}
    file, table = _records_file(path), {}
    for line, row in read_rows(path):
        meta, text = row_metadata(row), str(row.get("instruction", row.get("prompt")))
        if meta is None:
            continue
        if not isinstance(meta, dict):
            raise ValueError(f"{file}: line {line} has a metadata field that is not a JSON object")
        if table.get(text, meta) != meta:
            raise ValueError(f"{file}: line {line} repeats the prompt {text!r} with other metadata; rewards look metadata up by prompt")
        table[text] = meta
    return table


def prompt_texts(spec: str) -> tuple[list[str], dict[str, dict]]:
    """The texts (prompts, or editing instructions) and metadata of ``trainer.prompts`` without reading any image: for
    checks before anything is built (a reward that needs each prompt's metadata)."""
    if is_prompt_set(str(spec)):
        prompts, rows = load_prompt_set(str(spec), "train")
        return prompts, (dict(zip(prompts, rows)) if rows is not None else {})
    path = Path(spec)
    if not _is_records(path):
        return read_prompt_file(path), {}
    texts = [str(row.get("instruction", row.get("prompt"))) for _, row in read_rows(path)]
    return texts, read_metadata(path)


def load_prompts(spec: str, split: str) -> tuple[list, dict[str, dict]]:
    """``trainer.prompts`` / ``eval.prompts``: a prompt file or editing records (:func:`read_prompts`, no metadata;
    ``split`` does not apply), or a built-in prompt set's ``split`` (``train`` | ``test``, :mod:`diffrl.prompt_sets`)
    with each prompt's metadata (GenEval rows, OCR target texts).

    Returns:
        ``(prompts, {prompt: metadata row})``; the table is empty for a set without metadata and for files.
    """
    if not is_prompt_set(str(spec)):
        return read_prompts(spec), read_metadata(spec)
    prompts, rows = load_prompt_set(str(spec), split)
    return prompts, (dict(zip(prompts, rows)) if rows is not None else {})


def run_prompts(cfg) -> tuple[list | None, list | None, dict[str, dict]]:
    """:func:`load_run_prompts` of a run's whole config (``cfg.trainer``, ``cfg.eval``), for the commands that read a run's
    config.yaml."""
    return load_run_prompts(cfg.trainer, cfg.eval)


def load_run_prompts(train, evaluation) -> tuple[list | None, list | None, dict[str, dict]]:
    """A run's training prompts, evaluation prompts and the metadata of both (``train`` = its ``TrainerConfig``,
    ``evaluation`` its ``EvalConfig``): ``trainer.prompts`` (a set's train split or a file); ``eval.prompts`` (a set's
    test split or a file), else the test split of ``trainer.prompts`` when it names a set, else ``trainer.prompts``; the
    first ``eval.num_prompts`` of them when set. ``None`` where the family's built-in prompts apply."""
    eval_spec = evaluation.prompts or (train.prompts if train.prompts and is_prompt_set(str(train.prompts)) else None)
    loaded = {split: load_prompts(spec, split) for split, spec in (("train", train.prompts), ("test", eval_spec)) if spec}
    prompts, table = loaded.get("train", (None, {}))
    eval_prompts, eval_table = loaded.get("test", (prompts, {}))
    return prompts, eval_subset(eval_prompts, evaluation), {**table, **eval_table}


def eval_subset(prompts: list | None, evaluation) -> list | None:
    """The evaluation prompts of ``prompts`` (a run's, or the family's built-in ones): the first
    ``eval.num_prompts`` of them when set, else all (``evaluation`` = the run's ``EvalConfig``)."""
    if prompts is None or not evaluation.num_prompts:
        return prompts
    return prompts[: int(evaluation.num_prompts)]


def sample_metadata(prompts: list[str], table: dict[str, dict], **shared) -> list[dict] | dict:
    """The ``metadata`` argument of a reward call: one row per sample (its prompt's metadata plus ``shared``) when
    every prompt has metadata, else ``shared`` alone."""
    if table and all(p in table for p in prompts):
        return [{**table[p], **shared} for p in prompts]
    return dict(shared)


def read_edit_records(path: str | Path) -> list[EditPrompt]:
    """Editing prompts: a JSONL file whose rows hold ``source`` (an image path, relative to the file; ``file_name`` and
    flow_grpo's ``image`` are accepted for it) and ``instruction`` (``prompt`` is accepted for it), or a folder holding
    such a ``metadata.jsonl`` (the Hugging Face image-folder layout).

    Every image is checked before anything is trained: a missing file or key is a one-line error naming the
    row. Sources are read as RGB uint8; the trainer resizes them to the sampler's size.
    """
    file = _records_file(Path(path))
    if not file.is_file():
        raise FileNotFoundError(f"editing prompts {file} do not exist (trainer.prompts: a JSONL file of {{source, instruction}} rows, or a folder with metadata.jsonl)")
    records = []
    for line, row in read_rows(file):
        source = next((row[k] for k in SOURCE_KEYS if k in row), None)
        instruction = row.get("instruction", row.get("prompt"))
        if source is None or instruction is None:
            raise ValueError(f"{file}: line {line} lacks {'source' if source is None else 'instruction'}; every row needs {list(EDIT_RECORD_KEYS)}")
        image = (file.parent / source) if not Path(source).is_absolute() else Path(source)
        if not image.is_file():
            raise FileNotFoundError(f"{file}: line {line} names source image {image}, which does not exist")
        records.append(EditPrompt(str(instruction), (_image(image) * 255.0).round().to(torch.uint8), name=str(source)))
    if not records:
        raise ValueError(f"{file} holds no editing records")
    return records


def check_edit_prompts(prompts: list, family: str, sampler, *, editing: bool) -> list:
    """The run's prompts checked against the model family before anything is built: an editing family (``editing``: its
    adapter class's ``editing``) takes :class:`~pipelines.base.EditPrompt` records (sources resized to the sampler's
    size), any other family text prompts; a mismatch is a one-line error naming the fix."""
    records = bool(prompts) and isinstance(prompts[0], EditPrompt)
    if editing and not records:
        raise ValueError(f"model family {family!r} edits images: trainer.prompts must be a JSONL file or folder of {{source, instruction}} records, not text prompts")
    if records and not editing:
        raise ValueError(f"trainer.prompts holds editing records (source images) but model family {family!r} is text-to-image; use an editing family (e.g. model.family=flux_kontext)")
    resized = resize_sources(prompts, int(sampler.height), int(sampler.width))
    split_prompts(resized)  # a mix of strings and records fails here
    return resized


def family_prompts(train, evaluation, family: str, sampler, *, editing: bool, offline_pairs: bool = False) -> tuple[list | None, list | None, dict[str, dict]]:
    """The run's data as the trainer takes it, read and checked against the model family in one pass: the training and
    evaluation prompts with their metadata (:func:`load_run_prompts`), each checked and resized (:func:`check_edit_prompts`;
    ``None`` where the family's built-in prompts apply, :func:`family_default_prompts`); offline preference pairs
    (``offline_pairs``: ``algorithm.preference_pairs``) need a text-to-image family (they hold no source images;
    ``editing``: the family's adapter class's ``editing``)."""
    prompts, eval_prompts, table = load_run_prompts(train, evaluation)
    if prompts is not None:
        prompts, eval_prompts = (check_edit_prompts(p, family, sampler, editing=editing) for p in (prompts, eval_prompts))
    if offline_pairs and editing:
        raise ValueError(f"algorithm.preference_pairs (offline DPO pairs) has no source images, and model family {family!r} edits images; "
                         "train it with online pairs (unset algorithm.preference_pairs) or another algorithm")
    return prompts, eval_prompts, table


def family_default_prompts(prompts: list | None, evaluation, family: str, sampler, *, editing: bool) -> tuple[list | None, list | None]:
    """The model family's built-in prompts (its adapter's ``default_prompts``) as the run's training prompts, checked
    (:func:`check_edit_prompts`), and their evaluation subset (:func:`eval_subset`)."""
    if prompts:
        prompts = check_edit_prompts(prompts, family, sampler, editing=editing)
    return prompts, eval_subset(prompts, evaluation)


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
