"""``diffrl prompts convert --format geneval|ocr|counting-edit IN OUT``: flow_grpo's prompt datasets as diffrl records.

What each format reads (flow_grpo's ``dataset/`` folders; IN is a file, or the folder with ``--split`` choosing
``<split>_metadata.jsonl`` / ``<split>.txt``) and what it writes (JSONL, one record a line; ``trainer.prompts=OUT``):

* ``geneval`` — ``dataset/geneval/{train,test}_metadata.jsonl``, GenEval rows ``{"tag", "include", "exclude"?, "prompt"}``
  → ``{"prompt", "metadata": {tag, include, exclude}}``. (The rows themselves also work as ``trainer.prompts``.)
* ``ocr`` — ``dataset/ocr/{train,test}.txt``, one prompt a line with the text to render in double quotes
  → ``{"prompt", "metadata": {"text": <the quoted text>}}`` (the ``ocr`` reward's target; a line without quoted text
  is a one-line error naming it).
* ``counting-edit`` — ``dataset/counting_edit/{train,test}_metadata.jsonl``, rows ``{"prompt": <instruction>, "image":
  <source, relative to the folder>, "tag", "include", "exclude"}`` (the images come from ``generated_images.zip`` of
  ``jieliu/counting_edit``, unzipped into the folder) → editing records ``{"source", "instruction", "metadata"}``,
  sources relative to OUT's folder. A missing source image is a one-line error naming the row and the zip.

Nothing here imports torch: it reads and writes text.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from diffrl.data import jsonl_rows

FORMATS = ("geneval", "ocr", "counting-edit")
_QUOTED = re.compile(r'"([^"]*)"|“([^”]*)”')
GENEVAL_KEYS = ("tag", "include", "exclude")


def add_parser(sub) -> dict:
    """Add ``prompts`` (``prompts convert``) to ``sub``; return ``{name: handler(args) -> exit status}``."""
    p = sub.add_parser("prompts", help="convert flow_grpo's prompt datasets (GenEval, OCR, counting edits) to diffrl records",
                       description=__doc__.split("\n\n")[0])
    action = p.add_subparsers(dest="action", required=True)
    convert = action.add_parser("convert", help="flow_grpo's GenEval / OCR / counting-edit files → diffrl JSONL records",
                                description="write diffrl records (JSONL) from one of flow_grpo's dataset files; trainer.prompts=OUT")
    convert.add_argument("--format", required=True, choices=FORMATS, help="the dataset IN holds")
    convert.add_argument("--split", default="train", choices=["train", "test"], help="with IN a folder: its <split> file (default train)")
    convert.add_argument("--overwrite", action="store_true", help="replace OUT when it exists")
    convert.add_argument("source", metavar="IN", help="the dataset file, or flow_grpo's dataset folder (dataset/geneval, dataset/ocr, dataset/counting_edit)")
    convert.add_argument("out", metavar="OUT", help="the records file to write (.jsonl)")
    return {"prompts": run_prompts}


def run_prompts(args) -> int:
    rows = convert(args.format, args.source, args.out, split=args.split, overwrite=args.overwrite)
    print(json.dumps({"out": str(args.out), "format": args.format, "records": rows, "use": f"trainer.prompts={args.out}"}), flush=True)
    return 0


def _input_file(fmt: str, source: Path, split: str) -> Path:
    if source.is_dir():
        source = source / (f"{split}.txt" if fmt == "ocr" else f"{split}_metadata.jsonl")
    if not source.is_file():
        raise FileNotFoundError(f"{source} does not exist: give flow_grpo's {fmt} file, or its dataset folder with --split train|test")
    return source


def _geneval_row(file: Path, line: int, row: dict, fmt: str) -> dict:
    missing = [k for k in ("prompt", "tag", "include") if k not in row]
    if missing:
        raise ValueError(f"{file}: line {line} lacks {', '.join(missing)}: not a GenEval row of flow_grpo's {fmt} set ({{prompt, tag, include, exclude}})")
    return {k: row[k] for k in GENEVAL_KEYS if k in row}


def quoted_text(prompt: str) -> str | None:
    """The text between double quotes (straight or curly; several parts joined by a space), None when there is none."""
    parts = [(a or b).strip() for a, b in _QUOTED.findall(prompt)]
    parts = [p for p in parts if p]
    return " ".join(parts) if parts else None


def convert(fmt: str, source: str | Path, out: str | Path, *, split: str = "train", overwrite: bool = False) -> int:
    """Convert flow_grpo's ``fmt`` dataset at ``source`` to diffrl records at ``out``; returns the number of records.

    Raises:
        ValueError / FileNotFoundError: one line naming the file and the line that cannot be converted, before ``out``
            is written.
    """
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt}: not one of {', '.join(FORMATS)}")
    file, out = _input_file(fmt, Path(source), split), Path(out)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} exists; choose another OUT or add --overwrite")
    records = []
    if fmt == "ocr":
        for i, line in enumerate(file.read_text(encoding="utf-8").splitlines()):
            if not line.strip():
                continue
            text = quoted_text(line)
            if text is None:
                raise ValueError(f"{file}: line {i + 1} quotes no text to render ({line.strip()[:80]!r}); OCR prompts put their target in double quotes")
            records.append({"prompt": line.strip(), "metadata": {"text": text}})
    elif fmt == "geneval":
        records = [{"prompt": row["prompt"], "metadata": _geneval_row(file, line, row, fmt)} for line, row in jsonl_rows(file)]
    else:
        for line, row in jsonl_rows(file):
            meta = _geneval_row(file, line, row, fmt)
            if "image" not in row:
                raise ValueError(f"{file}: line {line} lacks image: not a row of flow_grpo's counting_edit set ({{prompt, image, tag, include, exclude}})")
            image = file.parent / row["image"]
            if not image.is_file():
                raise FileNotFoundError(f"{file}: line {line} names source image {image}, which does not exist: unzip generated_images.zip of "
                                        f"`hf download jieliu/counting_edit --repo-type dataset` into {file.parent}")
            source_path = os.path.relpath(image.resolve(), out.resolve().parent)
            records.append({"source": source_path, "instruction": row["prompt"], "metadata": meta})
    if not records:
        raise ValueError(f"{file} holds no rows to convert")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return len(records)
