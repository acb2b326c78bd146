"""Resuming a run from its folder: which checkpoint, whether it belongs to this configuration, and the records cut
back to it.

A run folder holds ``metrics.jsonl`` and ``checkpoints/step_N`` (``diffrl.checkpoint``: atomic, hashed). A run
whose folder already holds records continues (``trainer.resume=auto``) from its newest whole checkpoint written by
the same configuration (:func:`fingerprint`); damaged checkpoints newer than it are set aside, never deleted, and
the records of the steps after it are dropped (they are recomputed exactly: prompts and noise are functions of
``(seed, step)``). Anything else leaves the folder untouched and stops with a one-line error.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from diffrl import checkpoint
from diffrl.config import ModelConfig, TrainerConfig


class RunFolderError(FileExistsError):
    """The output folder cannot be used as asked (it holds another run, or nothing to resume from)."""


def fingerprint(model: ModelConfig, trainer: TrainerConfig, algorithm: str) -> dict:
    """The config values a checkpoint must share with a run that resumes from it: the model and its trained weights'
    shapes (``model``), the algorithm class (its registry name), and what fixes the prompts and noise of every step
    (``trainer``)."""
    m, t = model, trainer
    return {
        "model.family": m.family, "model.path": m.path, "model.lora.rank": int(m.lora.rank), "model.lora.alpha": float(m.lora.alpha),
        "model.lora.target_modules": list(m.lora.target_modules) if m.lora.target_modules else None, "algorithm.trainer": algorithm,
        "trainer.seed": int(t.seed), "trainer.prompts_per_step": int(t.prompts_per_step), "trainer.group_size": int(t.group_size),
    }


def checkpoint_path(output_dir: Path, step: int) -> Path | None:
    """Where the checkpoint of ``step`` is (``None`` for step 0: the base model has none)."""
    return output_dir / "checkpoints" / f"step_{step:06d}" if step > 0 else None


def pick_checkpoint(output_dir: Path, ours: dict, auto: bool, notices: list[str]) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest whole checkpoint of the run folder and the damaged ones newer than it (with why); ``(None, [])``
    when ``auto`` and the run stopped before its first checkpoint (it starts again; a notice says so).

    A checkpoint whose :func:`fingerprint` differs from ``ours`` (written under another model, LoRA or sampling
    config) stops the run with the keys that differ: its weights would not fit, or the run would not continue the
    same way."""
    found = checkpoint.list_checkpoints(output_dir / "checkpoints")
    if auto and not found:  # stopped before its first checkpoint: only the records of those steps exist; start again
        notices.append(f"{output_dir} has no checkpoint yet: starting again from step 0 (trainer.resume=auto)")
        return None, []
    if not auto or not found:
        why = "trainer.resume=auto continues it from its newest checkpoint" if found else "it has no complete checkpoint to resume from"
        raise RunFolderError(f"output folder {output_dir} already holds a run (metrics.jsonl); it is left untouched — choose another trainer.output_dir ({why})")
    damaged = []
    for path in reversed(found):
        problem = checkpoint.verify(path)
        if problem:
            damaged.append((path, problem))
            continue
        saved = json.loads((path / "state.json").read_text()).get("fingerprint")
        if saved is not None and saved != ours:
            diff = ", ".join(f"{k}: {saved.get(k)!r} in the checkpoint, {ours.get(k)!r} now" for k in sorted(set(saved) | set(ours)) if saved.get(k) != ours.get(k))
            raise RunFolderError(f"checkpoint {path} was written by another configuration ({diff}); resume with the run's own config.yaml or choose another trainer.output_dir")
        return path, damaged
    listed = "; ".join(f"{p.name}: {why}" for p, why in damaged)
    raise RunFolderError(f"output folder {output_dir} has no whole checkpoint to resume from ({listed}); it is left untouched — choose another trainer.output_dir")


def set_aside(output_dir: Path, damaged: list[tuple[Path, str]], notices: list[str]) -> None:
    """Move the damaged checkpoints aside (kept for inspection) and delete the partial writes a kill left."""
    for path, why in damaged:
        kept = checkpoint.set_aside(path)
        notices.append(f"skipped damaged checkpoint {path.name} ({why}); kept as {kept.name}")
    for tmp in (output_dir / "checkpoints").glob("step_*.tmp-*"):  # a write cut by a kill: partial, never used
        shutil.rmtree(tmp, ignore_errors=True)


def cut_records(output_dir: Path, step: int, eval_every: int, steps: int) -> tuple[dict, dict | None]:
    """Cut ``metrics.jsonl`` back to the records of steps ≤ ``step`` (a line cut by a kill dropped) and return the
    evaluation before training and the one at ``step`` (None when it is due there but did not finish: it runs again)."""
    path = output_dir / "metrics.jsonl"
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by the kill
            continue
        if record.get("step", 0) <= step:
            kept.append(record)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r, default=float) + "\n" for r in kept))
    os.replace(tmp, path)
    evals = [r for r in kept if r.get("kind") == "eval"]
    if not evals or evals[0]["step"] != 0:
        raise RunFolderError(f"{path} lacks the evaluation before training; the run cannot be resumed — start a new trainer.output_dir")
    strip = lambda r: {k: v for k, v in r.items() if k.startswith("eval/")}  # noqa: E731
    if step and ((eval_every and step % eval_every == 0) or step == steps) and evals[-1]["step"] != step:
        return strip(evals[0]), None  # the evaluation at the checkpoint's step did not finish: run it again
    return strip(evals[0]), strip(evals[-1])


__all__ = ["RunFolderError", "checkpoint_path", "cut_records", "fingerprint", "pick_checkpoint", "set_aside"]
