"""Atomic safetensors checkpoints.

A checkpoint is a folder ``<root>/step_<N>/`` holding

* ``model.safetensors`` – the trainable weights (the LoRA "default" adapter, or all weights), plus
  every other LoRA adapter (e.g. "old") so copy/EMA state survives;
* ``optimizer.safetensors`` + ``optimizer.json`` – AdamW state tensors, param groups and the LR
  scheduler's state;
* ``old_policy.safetensors`` – the old policy of full fine-tuning (a LoRA "old" adapter is in model);
* ``rng.safetensors`` – torch's CPU generator state;
* ``state.json`` – the global step, the LoRA rank and alpha (``lora``; null for full fine-tuning) and any caller
  state (trainer position, metrics).

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

from diffrl.engine import parallel

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
    old = {n: parallel.full_tensor(t).contiguous().cpu() for n, t in engine.old_state().items()}
    optimizer = _optimizer_payload(engine.optimizer) if engine.optimizer is not None else None
    if parallel.rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if final.exists():
            raise FileExistsError(f"checkpoint {final} already exists; it is kept as it is")
        tmp = root / f"{final.name}.tmp-{os.getpid()}"
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
        os.replace(tmp, final)
        _fsync_dir(root)
    parallel.barrier()
    return final


def load_engine(engine, path: str | Path) -> dict:
    """Load weights, the old policy and the optimizer state from a checkpoint folder; return its state.json.

    Under torch.distributed every rank calls it and keeps its own shards.
    """
    path = Path(path)
    if not (path / "model.safetensors").is_file() or not (path / "state.json").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (model.safetensors and state.json are required)")
    engine.initialize()
    weights = load_file(str(path / "model.safetensors"))
    if any(".old." in n for n in weights) and not engine.has_old:
        engine.copy_to_old()  # the old LoRA adapter is created, then overwritten below
    params = dict(engine.module.named_parameters())
    missing = [n for n in weights if n not in params]
    if missing:
        raise KeyError(f"checkpoint {path} holds weights the model lacks: {missing[:5]}…")
    for name, value in weights.items():
        parallel.load_full(params[name], value)
    if (path / "old_policy.safetensors").is_file():
        engine.load_old_state(load_file(str(path / "old_policy.safetensors")))
    if (path / "optimizer.safetensors").is_file() and engine.optimizer is not None:
        meta = json.loads((path / "optimizer.json").read_text())
        state = _optimizer_from_payload(load_file(str(path / "optimizer.safetensors")), meta)
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
    if (path / "rng.safetensors").is_file():
        torch.set_rng_state(load_file(str(path / "rng.safetensors"))["torch_cpu"])
    return json.loads((path / "state.json").read_text())


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (temporary folders are ignored)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]
