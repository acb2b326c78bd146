"""Atomic safetensors checkpoints.

A checkpoint is a folder ``<root>/step_<N>/`` holding

* ``model.safetensors`` – the trainable weights (the LoRA "default" adapter, or all weights; a bf16 full fine-tune's
  as its fp32 master weights, :mod:`diffrl.engine.precision`, from which the bf16 weights are rounded on load), plus
  every other LoRA adapter (DiffusionNFT's "old", ``eval.ema``'s "ema") so copy/EMA state survives;
* ``optimizer.safetensors`` + ``optimizer.json`` – AdamW state tensors, param groups and the LR
  scheduler's state;
* ``old_policy.safetensors`` – the old policy of full fine-tuning (a LoRA "old" adapter is in model);
* ``rng.safetensors`` – torch's CPU generator state;
* ``state.json`` – the global step, the LoRA rank and alpha (``lora``; null for full fine-tuning) and any caller
  state (trainer position, metrics);
* ``manifest.json`` – written last: each file's size and SHA-256.

It is written into ``step_<N>.tmp-<pid>/``, flushed to disk and renamed into place when complete, so a folder
named ``step_<N>`` is whole when written; an existing complete checkpoint is never overwritten. A write that
fails (disk full, a quota) removes its temporary folder and raises :class:`CheckpointError`; the checkpoints
already there are untouched. :func:`verify` re-checks a folder against its manifest (a file truncated or
changed later, a torn copy), and :func:`load_engine` reads and checks every file before it changes the
engine, so a bad checkpoint never half-loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from diffrl.engine import lora, parallel

_STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read whole (the message names the folder and the file)."""


def _fsync(path: Path) -> None:
    """Flush a file or a folder (its entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON to ``path`` via a temporary file and ``os.replace``."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(obj, indent=2))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _optimizer_payload(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{key}"] = parallel.full_tensor(value.detach()).contiguous().cpu()
            else:
                scalars[f"{idx}.{key}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_from_payload(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict] = {}
    for name, value in tensors.items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = value
    for name, value in meta["scalars"].items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = value
    groups = meta["param_groups"]
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    return {"state": state, "param_groups": groups}


def save_engine(engine, root: str | Path, *, global_step: int, extra_state: dict | None = None) -> Path:
    """Write ``root/step_<global_step>`` atomically and return its path.

    Under torch.distributed every rank must call it (sharded tensors are gathered); rank 0 writes.
    """
    root = Path(root)
    final = root / f"step_{global_step:06d}"
    weights = {n: parallel.full_tensor(p.detach()).contiguous().cpu() for n, p in engine.module.named_parameters() if p.requires_grad or "lora_" in n}
    weights.update({n: parallel.full_tensor(m).contiguous().cpu() for n, m in engine.master_state().items()})  # fp32 masters of bf16 weights
    old = {n: parallel.full_tensor(t).contiguous().cpu() for n, t in engine.old_state().items()}
    optimizer = _optimizer_payload(engine.optimizer) if engine.optimizer is not None else None
    error = None
    if parallel.rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if final.exists():
            raise FileExistsError(f"checkpoint {final} already exists; it is kept as it is")
        tmp = root / f"{final.name}.tmp-{os.getpid()}"
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt", "global_step": str(global_step)})
            if old:
                save_file(old, str(tmp / "old_policy.safetensors"))
            if optimizer is not None:
                save_file(optimizer[0], str(tmp / "optimizer.safetensors"))
                meta = dict(optimizer[1], scheduler=engine.scheduler.state_dict() if engine.scheduler is not None else None)
                (tmp / "optimizer.json").write_text(json.dumps(meta))
            save_file({"torch_cpu": torch.get_rng_state()}, str(tmp / "rng.safetensors"))
            lora = {"rank": int(engine.model.lora.rank), "alpha": float(engine.model.lora.alpha)} if engine.model.lora.rank else None
            (tmp / "state.json").write_text(json.dumps({"global_step": global_step, "lora": lora, **(extra_state or {})}, indent=2))
            files = sorted(p for p in tmp.iterdir() if p.is_file())
            for f in files:
                _fsync(f)
            manifest = {f.name: {"bytes": f.stat().st_size, "sha256": _sha256(f)} for f in files}
            (tmp / MANIFEST).write_text(json.dumps({"files": manifest}, indent=2))
            _fsync(tmp / MANIFEST)
            os.replace(tmp, final)
            _fsync(root)
        except (OSError, SafetensorError) as exc:  # safetensors reports a full disk as SafetensorError
            shutil.rmtree(tmp, ignore_errors=True)
            kept = list_checkpoints(root)
            error = CheckpointError(
                f"could not write checkpoint {final} ({getattr(exc, 'strerror', None) or exc}); nothing partial was left and "
                f"{'the newest complete checkpoint ' + kept[-1].name + ' is intact' if kept else 'no earlier checkpoint exists'}"
                " — free space (or fix the folder) and continue with trainer.resume=auto"
            )
    parallel.barrier()
    if error is not None:
        raise error
    return final


def verify(path: str | Path, *, hashes: bool = True) -> str | None:
    """What is wrong with the checkpoint folder ``path`` (``None``: it is whole).

    Checks the manifest's files (present, size, SHA-256 unless ``hashes=False``) and that ``state.json``
    parses; a folder written before manifests existed is checked by parsing its files."""
    path = Path(path)
    if not (path / "state.json").is_file() or not (path / "model.safetensors").is_file():
        return "model.safetensors or state.json is missing"
    manifest_path = path / MANIFEST
    if manifest_path.is_file():
        try:
            files = json.loads(manifest_path.read_text())["files"]
        except (ValueError, KeyError, TypeError):
            return f"{MANIFEST} is unreadable"
        for name, entry in files.items():
            f = path / name
            if not f.is_file():
                return f"{name} is missing"
            size = f.stat().st_size
            if size != entry["bytes"]:
                return f"{name} has {size} bytes, the manifest says {entry['bytes']} (truncated or replaced)"
            if hashes and _sha256(f) != entry["sha256"]:
                return f"{name} does not match its SHA-256 in the manifest (corrupted)"
    try:
        state = json.loads((path / "state.json").read_text())
        int(state["global_step"])
    except (ValueError, KeyError, TypeError):
        return "state.json is not valid JSON with a global_step"
    if not manifest_path.is_file():
        for f in path.glob("*.safetensors"):
            try:
                load_file(str(f))
            except (SafetensorError, OSError, ValueError) as exc:
                return f"{f.name} cannot be read ({exc})"
    return None


def set_aside(path: str | Path) -> Path:
    """Rename a damaged checkpoint folder out of the way (kept for inspection, never deleted)."""
    path = Path(path)
    target = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    os.replace(path, target)
    return target


def lora_adapters(weights: dict) -> set[str]:
    """The LoRA adapter names in checkpoint weights (``<module>.lora_A.<adapter>.weight``)."""
    return {name.split(".lora_A.", 1)[1].split(".", 1)[0] for name in weights if ".lora_A." in name}


def checkpoint_adapters(path: str | Path) -> set[str]:
    """The LoRA adapters a checkpoint folder holds (read from ``model.safetensors``' keys, no tensor loaded)."""
    with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as f:
        return lora_adapters(dict.fromkeys(f.keys()))


def load_engine(engine, path: str | Path, *, hashes: bool = True) -> dict:
    """Load weights, the old policy and the optimizer state from a checkpoint folder; return its state.json.

    Under torch.distributed every rank calls it and keeps its own shards.
    """
    path = Path(path)
    if not (path / "model.safetensors").is_file() or not (path / "state.json").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (model.safetensors and state.json are required)")
    problem = verify(path, hashes=hashes)
    if problem:
        raise CheckpointError(f"checkpoint {path} is damaged: {problem}; nothing was loaded")
    # read and check every file before the engine changes: a bad checkpoint never half-loads
    try:
        weights = load_file(str(path / "model.safetensors"))
        old_state = load_file(str(path / "old_policy.safetensors")) if (path / "old_policy.safetensors").is_file() else None
        optim = None
        if (path / "optimizer.safetensors").is_file():
            meta = json.loads((path / "optimizer.json").read_text())
            optim = (_optimizer_from_payload(load_file(str(path / "optimizer.safetensors")), meta), meta)
        rng = load_file(str(path / "rng.safetensors"))["torch_cpu"] if (path / "rng.safetensors").is_file() else None
        state_json = json.loads((path / "state.json").read_text())
    except (SafetensorError, OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read ({exc}); nothing was loaded") from None
    engine.initialize()
    for name in sorted(lora_adapters(weights) - {"default"}):
        lora.ensure_adapter(engine.module, name)  # DiffusionNFT's "old", eval.ema's "ema": created, then overwritten below
    params = dict(engine.module.named_parameters())
    missing = [n for n in weights if n not in params]
    if missing:
        raise CheckpointError(f"checkpoint {path} holds weights this model lacks ({missing[:3]}…): it was written by another model family or LoRA config; nothing was loaded")
    shapes = [n for n, v in weights.items() if tuple(v.shape) != tuple(params[n].shape)]
    if shapes:
        raise CheckpointError(f"checkpoint {path} has other shapes for {shapes[:3]} (another LoRA rank or model size); nothing was loaded")
    for name, value in weights.items():
        parallel.load_full(params[name], value)
    engine.load_master_state(weights)  # fp32 masters exactly; the bf16 weights rounded from them
    if old_state is not None:
        engine.load_old_state(old_state)
    if optim is not None and engine.optimizer is not None:
        state, meta = optim
        ordered = [p for group in engine.optimizer.param_groups for p in group["params"]]
        for idx, entry in state["state"].items():
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.ndim > 0:
                    target = torch.empty_like(ordered[idx])
                    parallel.load_full(target, value)
                    entry[key] = target
        engine.optimizer.load_state_dict(state)
        if meta.get("scheduler") is not None and engine.scheduler is not None:
            engine.scheduler.load_state_dict(meta["scheduler"])
    if rng is not None:
        torch.set_rng_state(rng)
    return state_json


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (temporary folders are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]
