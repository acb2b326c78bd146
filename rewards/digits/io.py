"""Save/load of the miniature's small modules as ``config.json`` + ``model.safetensors``."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file


class JsonSafetensorsMixin:
    """``save_pretrained`` / ``from_pretrained`` for an ``nn.Module`` whose ``config`` property
    returns its constructor's keyword arguments."""

    def save_pretrained(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(self.config, indent=2))
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, str(folder / "model.safetensors"))

    @classmethod
    def from_pretrained(cls, folder: str | Path):
        folder = Path(folder)
        for name in ("config.json", "model.safetensors"):
            if not (folder / name).is_file():
                raise FileNotFoundError(f"{cls.__name__} file {folder / name} is missing")
        model = cls(**json.loads((folder / "config.json").read_text()))
        model.load_state_dict(load_file(str(folder / "model.safetensors")))
        return model.eval()
