"""Built-in prompt sets with train/test splits, generated in-process (nothing is downloaded or read from disk).

``trainer.prompts=geneval`` names a set (:func:`is_prompt_set`); anything else is a prompt file. Training
draws from the ``train`` split and evaluation uses ``test``. Every set is made by a seeded generator of its
module (``geneval``, ``ocr``, ``general``): the same prompts on every call and machine, built once per process
(well under a second). How each set is made and what it stands in for: ``docs/prompts.md``.

These modules import nothing else from the project (they sit in the data layer, below rewards and pipelines).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from types import ModuleType

from diffrl.prompt_sets import general, geneval, ocr

SPLITS = ("train", "test")


@dataclass(frozen=True)
class PromptSetInfo:
    """What :data:`PROMPT_SETS` tells about a set: ``description``, ``provenance`` (one line: how it was made),
    ``splits`` (``{"train": size, "test": size}``) and ``metadata`` (whether rows come with per-prompt dicts)."""

    name: str
    description: str
    provenance: str
    splits: dict[str, int]
    metadata: bool
    module: ModuleType = field(repr=False, compare=False)


PROMPT_SETS: dict[str, PromptSetInfo] = {
    name: PromptSetInfo(name, module.DESCRIPTION, module.PROVENANCE, dict(module.SPLIT_SIZES), has_metadata, module)
    for name, module, has_metadata in (("geneval", geneval, True), ("ocr", ocr, True), ("general", general, False))
}


def prompt_set_names() -> list[str]:
    """The registered set names, sorted."""
    return sorted(PROMPT_SETS)


def is_prompt_set(name: str) -> bool:
    """True when ``name`` is a registered set (``trainer.prompts=geneval``); False for anything else (a path)."""
    return isinstance(name, str) and name in PROMPT_SETS


def load_prompt_set(name: str, split: str = "train") -> tuple[list[str], list[dict] | None]:
    """The prompts of ``split`` (``"train"`` or ``"test"``) of set ``name`` and one metadata dict per prompt
    (None for a set without metadata). Fresh lists and dicts on every call (the built sets are cached).

    Raises:
        ValueError: for an unknown name or split, naming the valid ones.
    """
    if not is_prompt_set(name):
        raise ValueError(f"unknown prompt set {name!r}; built-in sets: {', '.join(prompt_set_names())} (or give a prompt file path)")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} of prompt set {name!r}; splits: {', '.join(SPLITS)}")
    prompts, metadata = PROMPT_SETS[name].module.build()[split]
    return list(prompts), (None if metadata is None else [copy.deepcopy(row) for row in metadata])


__all__ = ["PROMPT_SETS", "PromptSetInfo", "SPLITS", "is_prompt_set", "load_prompt_set", "prompt_set_names"]
