"""Atomic safetensors checkpoints.

A checkpoint is a folder ``<root>/step_<N>/`` holding

* ``model.safetensors`` – the trainable weights (the LoRA "default" adapter, or all weights), plus
  every other LoRA adapter (e.g. "old") so copy/EMA state survives;
* ``optimizer.safetensors`` + ``optimizer.json`` – AdamW state tensors and param groups;
* ``state.json`` – the global step and any caller state (trainer position, metrics).

It is written into ``step_<N>.tmp-<pid>/`` and renamed into place when complete, so a folder named
``step_<N>`` is always whole; an existing complete checkpoint is never overwritten.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_STEP_DIR = re.compile(r"^step_(\d+)$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON to ``path`` via a temporary file and ``os.replace``."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def _optimizer_payload(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{idx}.{key}"] = value.detach().contiguous().cpu()
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
    """Write ``root/step_<global_step>`` atomically and return its path."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{global_step:06d}"
    if final.exists():
        raise FileExistsError(f"checkpoint {final} already exists; it is kept as it is")
    tmp = root / f"{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    weights = {n: p.detach().contiguous().cpu() for n, p in engine.module.named_parameters() if p.requires_grad or "lora_" in n}
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt", "global_step": str(global_step)})
    if engine.optimizer is not None:
        tensors, meta = _optimizer_payload(engine.optimizer)
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        (tmp / "optimizer.json").write_text(json.dumps(meta))
    (tmp / "state.json").write_text(json.dumps({"global_step": global_step, **(extra_state or {})}, indent=2))
    os.replace(tmp, final)
    _fsync_dir(root)
    return final


def load_engine(engine, path: str | Path) -> dict:
    """Load weights (and optimizer state when present) from a checkpoint folder; return its state.json."""
    path = Path(path)
    if not (path / "model.safetensors").is_file() or not (path / "state.json").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (model.safetensors and state.json are required)")
    engine.initialize()
    weights = load_file(str(path / "model.safetensors"))
    params = dict(engine.module.named_parameters())
    missing = [n for n in weights if n not in params]
    if missing:
        raise KeyError(f"checkpoint {path} holds weights the model lacks: {missing[:5]}…")
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)
    if (path / "optimizer.safetensors").is_file() and engine.optimizer is not None:
        meta = json.loads((path / "optimizer.json").read_text())
        engine.optimizer.load_state_dict(_optimizer_from_payload(load_file(str(path / "optimizer.safetensors")), meta))
    return json.loads((path / "state.json").read_text())


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (temporary folders are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]
