"""Checkpoints named by Hugging Face Hub id, resolved through ``huggingface_hub``'s cache.

Wherever diffrl takes weights (``model.path``, a reward's ``checkpoint``/``processor``/… options) it takes
either a local path, as before, or a Hub reference:

* ``org/name`` — a repository (a diffusers folder, a transformers model): :func:`resolve_folder` downloads the
  files the caller names (``allow_patterns``: a model family's components, not the repo's single-file copies)
  with ``snapshot_download`` and returns the snapshot folder;
* ``org/name/path/in/repo.ext`` — one file of a repository (an open_clip ``.pt``, an MLP head):
  :func:`resolve_file` returns it (``hf_hub_download``);
* either with ``@revision`` appended (a branch, tag or commit), or the revision given separately
  (``model.revision``).

A string that is an existing local path is always taken as that path. The cache is ``huggingface_hub``'s:
``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub`` (read at each call, so a process can
point it elsewhere); ``HF_HUB_OFFLINE=1`` never touches the network; tokens come from where
``huggingface_hub`` looks (``HF_TOKEN``, ``hf auth login``). Offline and not cached is a one-line
:class:`HubError` naming the repository, the revision and the command that fetches it.

This module is a leaf: it imports no other project module, so the plug-in packages (``pipelines``,
``rewards``) may use it (``tests/test_architecture.py`` checks both).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TRUE = {"1", "on", "yes", "true"}


class HubError(ValueError):
    """A Hub reference that cannot be resolved (not cached offline, unknown repository, bad reference)."""


@dataclass(frozen=True)
class HubRef:
    """A parsed Hub reference: the repository, a file inside it (or ``None`` for the whole repository) and
    the revision (``None``: the default branch)."""

    repo_id: str
    filename: str | None = None
    revision: str | None = None

    def __str__(self) -> str:
        text = self.repo_id + (f"/{self.filename}" if self.filename else "")
        return text + (f"@{self.revision}" if self.revision else "")


def parse_ref(ref: str, revision: str | None = None) -> HubRef | None:
    """The :class:`HubRef` of ``ref``, or ``None`` when ``ref`` is a local path (it exists, or it starts with
    ``/``, ``.`` or ``~``, or it has no ``/`` at all). ``revision`` applies unless ``ref`` ends in ``@rev``."""
    text = str(ref).strip()
    if not text or Path(text).expanduser().exists() or text[0] in "/.~" or "/" not in text or "\\" in text:
        return None
    if "@" in text:
        text, _, rev = text.rpartition("@")
        revision = rev or revision
    parts = text.split("/")
    repo_id, filename = "/".join(parts[:2]), "/".join(parts[2:]) or None
    if not _REPO_ID.match(repo_id) or (filename is not None and any(p in ("", ".", "..") for p in parts[2:])):
        return None
    return HubRef(repo_id, filename, revision or None)


def is_hub_ref(ref: str | None) -> bool:
    """Whether ``ref`` names a Hub repository or file (and not a local path)."""
    return ref is not None and parse_ref(str(ref)) is not None


def cache_dir() -> Path:
    """The hub cache in force now: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (read now, not at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def fetch_command(ref: HubRef, allow_patterns: list[str] | None = None) -> str:
    """The shell command that puts ``ref`` into the cache (``hf download``)."""
    parts = ["hf download", ref.repo_id]
    if ref.filename:
        parts.append(ref.filename)
    if ref.revision:
        parts.append(f"--revision {ref.revision}")
    if allow_patterns and not ref.filename:
        parts.append("--include " + " ".join(f"'{p}'" for p in allow_patterns))
    return " ".join(parts)


def _explain(exc: Exception, ref: HubRef, key: str, allow_patterns: list[str] | None) -> HubError:
    from huggingface_hub import errors

    where = f"{key}={ref}" if key else str(ref)
    revision = ref.revision or "main"
    if isinstance(exc, errors.GatedRepoError):
        why = f"the repository {ref.repo_id} is gated: accept its terms on the Hub and log in (`hf auth login` or HF_TOKEN)"
    elif isinstance(exc, errors.RepositoryNotFoundError):
        why = f"no repository {ref.repo_id} on the Hub (or it is private: log in with `hf auth login` or set HF_TOKEN)"
    elif isinstance(exc, errors.RevisionNotFoundError):
        why = f"the repository {ref.repo_id} has no revision {revision}"
    elif isinstance(exc, errors.LocalEntryNotFoundError) or offline():
        why = (f"{ref.repo_id}{'/' + ref.filename if ref.filename else ''} (revision {revision}) is not in the Hugging Face cache "
               f"{cache_dir()} (nor a local path), and {'HF_HUB_OFFLINE=1 forbids downloading' if offline() else 'the Hub cannot be reached'}; fetch it first "
               f"where the Hub is reachable: {fetch_command(ref, allow_patterns)} (HF_HOME={cache_dir().parent})")
    elif isinstance(exc, errors.EntryNotFoundError):
        why = f"the repository {ref.repo_id} (revision {revision}) has no file {ref.filename}"
    else:
        why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    return HubError(f"{where}: {why}")


def resolve_folder(ref: str, *, revision: str | None = None, allow_patterns: list[str] | None = None,
                   ignore_patterns: list[str] | None = None, key: str = "") -> Path:
    """A local folder for ``ref``: the path itself when it is local, else the cached snapshot of the Hub
    repository (downloading ``allow_patterns`` of it unless offline).

    Args:
        ref: a local folder, ``org/name`` or ``org/name@revision``.
        revision: the revision when ``ref`` names none (``None``: the default branch).
        allow_patterns / ignore_patterns: ``snapshot_download``'s file filters (glob patterns).
        key: the config key that named ``ref``, for the error message.

    Raises:
        HubError: one line naming the repository, the revision and the command that fetches it.
    """
    parsed = parse_ref(ref, revision)
    if parsed is None:
        return Path(str(ref)).expanduser()
    if parsed.filename:
        raise HubError(f"{key or 'reference'}={ref} names a file in {parsed.repo_id}; give the repository (org/name) for a folder")
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(parsed.repo_id, revision=parsed.revision, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns,
                                 cache_dir=str(cache_dir()), local_files_only=offline())
    except Exception as exc:  # every hub failure becomes one line naming the repository
        raise _explain(exc, parsed, key, allow_patterns) from None
    return Path(path)


def resolve_file(ref: str, *, revision: str | None = None, key: str = "") -> Path:
    """A local file for ``ref``: the path itself when it is local, else ``org/name/<file>`` from the cache
    (downloaded unless offline). Raises :class:`HubError` as :func:`resolve_folder`."""
    parsed = parse_ref(ref, revision)
    if parsed is None:
        return Path(str(ref)).expanduser()
    if not parsed.filename:
        raise HubError(f"{key or 'reference'}={ref} names a repository; give one file of it as {parsed.repo_id}/<file>")
    from huggingface_hub import hf_hub_download

    try:
        path = hf_hub_download(parsed.repo_id, parsed.filename, revision=parsed.revision, cache_dir=str(cache_dir()), local_files_only=offline())
    except Exception as exc:  # every hub failure becomes one line naming the repository
        raise _explain(exc, parsed, key, None) from None
    return Path(path)


def resolve(ref: str, *, revision: str | None = None, allow_patterns: list[str] | None = None, key: str = "") -> Path:
    """:func:`resolve_file` for ``org/name/<file>``, :func:`resolve_folder` for ``org/name``, the path itself for a local one."""
    parsed = parse_ref(ref, revision)
    if parsed is not None and parsed.filename:
        return resolve_file(ref, revision=revision, key=key)
    return resolve_folder(ref, revision=revision, allow_patterns=allow_patterns, key=key)


# what a transformers / diffusers component folder needs: configs, tokenizers, processors and safetensors weights
MODEL_FILES = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.safetensors"]
PROCESSOR_FILES = ["*.json", "*.txt", "*.model", "*.tiktoken"]
FILE_KINDS = ("model", "processor", "file")


# weights a diffusers repository often holds beside the safetensors a model family loads: never downloaded
HUB_IGNORE = ["*.ckpt", "*.bin", "*.pth", "*.msgpack", "*.onnx", "*.onnx_data", "*.h5", "*.pb", "*.gguf"]


def component_patterns(components: Sequence[str]) -> list[str] | None:
    """``allow_patterns`` of a Hub download of a model family's weights: its ``components`` (sub-folders of a diffusers
    repository, ``ModelAdapter.hub_components``) and ``model_index.json``; ``None``: the whole repository, for a family
    that declares no components."""
    return [f"{c}/*" for c in components] + ["model_index.json"] if components else None


def resolve_model_folder(ref: str, components: Sequence[str], revision: str | None = None) -> Path:
    """``model.path`` as a local folder (:func:`resolve_folder` with the family's :func:`component_patterns`, weights of
    other formats ignored)."""
    return resolve_folder(ref, revision=revision, allow_patterns=component_patterns(components), ignore_patterns=HUB_IGNORE, key="model.path")


def resolve_weights(ref: str, kind: str, *, revision: str | None = None, key: str = "") -> Path:
    """A reward's or encoder's weights as a local path: ``kind`` says what of a Hub repository is needed:

    * ``model`` — a transformers model folder: configs, tokenizer/processor files and the ``*.safetensors``
      weights; a repository that has no safetensors gets its ``*.bin`` weights instead (a second call);
    * ``processor`` — the tokenizer and image-processor files only (no weights);
    * ``file`` — one file, ``org/name/<file>``.

    A local path is returned as it is (its existence is the caller's to check)."""
    if kind not in FILE_KINDS:
        raise ValueError(f"kind must be one of {FILE_KINDS}, got {kind!r}")
    parsed = parse_ref(ref, revision)
    if parsed is None or kind == "file" or parsed.filename:
        return resolve(ref, revision=revision, key=key)
    folder = resolve_folder(ref, revision=revision, allow_patterns=MODEL_FILES if kind == "model" else PROCESSOR_FILES, key=key)
    if kind == "model" and not any(folder.rglob("*.safetensors")):
        folder = resolve_folder(ref, revision=revision, allow_patterns=MODEL_FILES + ["*.bin"], key=key)
    return folder
