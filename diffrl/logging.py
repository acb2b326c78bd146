"""Run logging: per-step JSONL metrics, evaluation grids and sample tables, wandb, a progress bar.

What a run folder receives (always, whatever ``trainer.wandb`` says):

- ``metrics.jsonl``: one JSON object per training step and per evaluation, appended and flushed line
  by line, so a run that stops early keeps every step it finished;
- ``images/eval_step_<N>.png``: the first held-out sample of each prompt at evaluation ``N`` on a grid;
- ``images/eval_step_<N>.jsonl``: one line per evaluation sample (index, prompt, seed, every eval
  metric, its place on the grid), the local twin of the wandb sample table.

Videos (uint8 ``[N, F, 3, H, W]``, video families such as Wan): the grid, the captioned images and the
table show each video's middle frame (:func:`middle_frames`); the grid's videos are also written as
animated GIFs ``images/eval_step_<N>/<index>.gif`` and logged to wandb as ``eval/videos``
(``wandb.Video`` of the GIF file, which needs no video encoder package).

wandb (:class:`RunLogger`, ``trainer.wandb``):

- ``offline`` (default): ``wandb.init(mode="offline", dir=<run folder>)``; the run lives in
  ``<run folder>/wandb/offline-run-*``, the sample tables' files (wandb stages them as artifacts) in
  ``<run folder>/wandb/data`` unless ``WANDB_DATA_DIR`` is set, and nothing leaves the machine (the
  explicit mode wins over a ``WANDB_MODE`` environment variable). No login is needed; ``wandb sync <that folder>`` uploads it
  later, :func:`diffrl.tools.analysis.read_wandb_history` reads it back locally.
- ``online``: streams to the wandb server (needs ``wandb login`` or ``WANDB_API_KEY``).
- ``disabled``: wandb is never imported and nothing is written for it.

Each ``metrics.jsonl`` record goes to wandb under the same keys (``step`` is the wandb step, ``kind``
is dropped, an evaluation's ``wall_seconds`` becomes ``eval/wall_seconds``: :func:`wandb_scalars`). Each evaluation also logs ``eval/grid`` (the PNG grid, captioned with its prompts and
rewards in grid order), ``eval/images`` (the grid's images one by one, each captioned
``"<prompt> | <metric>=<value> …"``) and ``eval/samples``, a ``wandb.Table`` with one row per sample
(step, index, prompt, seed, image, one column per eval metric) for the first ``max_table_rows``
samples. A failing ``wandb.init`` is an error (:class:`WandbInitError`, naming the mode and the fix),
never a silent fallback to JSONL only: a run that asked for wandb gets it or stops before training.
A resumed run (``trainer.resume=auto``) starts a new wandb run in the same folder from the resumed step.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffrl import wandb_file
from diffrl.sampling.evaluation import main_score, per_sample_scores, read_jsonl  # noqa: F401  (the logging API)

WANDB_MODES = ("offline", "online", "disabled")
WANDB_FLUSH_TIMEOUT_S = 60.0  # how long close() waits for an offline run file to be complete


class WandbInitError(RuntimeError):
    """wandb could not start a run in the requested mode (the message names the fix)."""


class JsonlWriter:
    """Append one JSON object per line to ``path`` (flushed after each line)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fh = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._fh.write(json.dumps(record, default=float) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def image_grid(images: torch.Tensor, *, columns: int | None = None, scale: int = 1, padding: int = 1):
    """uint8 ``[N, 3, H, W]`` → a PIL image of the images on a grid (``scale``× nearest upsampling)."""
    from PIL import Image

    n, _, h, w = images.shape
    columns = columns or math.ceil(math.sqrt(n))
    rows = math.ceil(n / columns)
    canvas = torch.full((3, rows * (h + padding) + padding, columns * (w + padding) + padding), 64, dtype=torch.uint8)
    for i in range(n):
        r, c = divmod(i, columns)
        top, left = padding + r * (h + padding), padding + c * (w + padding)
        canvas[:, top : top + h, left : left + w] = images[i]
    img = Image.fromarray(canvas.permute(1, 2, 0).contiguous().numpy())
    if scale > 1:
        img = img.resize((img.width * scale, img.height * scale), Image.NEAREST)
    return img


def grid_cells(grid, count: int, *, columns: int | None = None, scale: int = 1, padding: int = 1) -> torch.Tensor:
    """The inverse of :func:`image_grid`: a grid image (PIL or uint8 ``[H, W, 3]``) of ``count`` cells → uint8
    ``[count, 3, h, w]``, exactly the images it was drawn from (nearest upsampling loses nothing)."""
    pixels = torch.from_numpy(np.array(grid.convert("RGB") if hasattr(grid, "convert") else grid)).permute(2, 0, 1)
    columns = columns or math.ceil(math.sqrt(count))
    rows = math.ceil(count / columns)
    height, width = pixels.shape[1] / scale, pixels.shape[2] / scale
    h, w = (height - padding) / rows - padding, (width - padding) / columns - padding
    if not (h.is_integer() and w.is_integer() and h > 0 and w > 0):
        raise ValueError(f"a {pixels.shape[2]}×{pixels.shape[1]} grid is not {count} cells in {columns} columns at scale {scale} with padding {padding}")
    h, w = int(h), int(w)
    small = pixels[:, ::scale, ::scale]
    out = []
    for i in range(count):
        r, c = divmod(i, columns)
        top, left = padding + r * (h + padding), padding + c * (w + padding)
        out.append(small[:, top : top + h, left : left + w])
    return torch.stack(out).contiguous()


def middle_frames(images: torch.Tensor) -> torch.Tensor:
    """Videos ``[N, F, 3, H, W]`` → their middle frames ``[N, 3, H, W]`` (frame ``F // 2``); images pass through."""
    return images[:, images.shape[1] // 2] if images.ndim == 5 else images


def save_gif(frames: torch.Tensor, path: str | Path, *, fps: float = 8.0, scale: int = 1) -> Path:
    """Write uint8 frames ``[F, 3, H, W]`` as an animated GIF (PIL, looping; ``scale``× nearest upsampling)."""
    from PIL import Image

    path = Path(path)
    pictures = [Image.fromarray(f.permute(1, 2, 0).contiguous().cpu().numpy()) for f in frames]
    if scale > 1:
        pictures = [p.resize((p.width * scale, p.height * scale), Image.NEAREST) for p in pictures]
    tmp = path.with_name(path.name + ".tmp.gif")
    pictures[0].save(tmp, save_all=True, append_images=pictures[1:], duration=max(1, round(1000 / fps)), loop=0)
    os.replace(tmp, path)
    return path


def save_grid(images: torch.Tensor, path: str | Path, **kwargs) -> Path:
    """Write :func:`image_grid` to ``path`` (PNG) via a temporary file and rename (videos: middle frames)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp.png")
    image_grid(middle_frames(images), **kwargs).save(tmp)
    os.replace(tmp, path)
    return path


def grid_rows(num_samples: int, samples_per_prompt: int, max_images: int) -> list[int]:
    """Indices of the samples on an evaluation grid: the first seed of each prompt, at most ``max_images``."""
    return list(range(0, num_samples, samples_per_prompt))[:max_images]


def wandb_scalars(record: dict) -> dict[str, float]:
    """The numbers of a ``metrics.jsonl`` record as logged to wandb: same keys, minus ``step`` and
    ``kind``; an evaluation's keys without the ``eval/`` prefix (``wall_seconds``) get it, so that they
    do not overwrite the training record of the same step."""
    is_eval = record.get("kind") == "eval"
    return {
        (f"eval/{k}" if is_eval and not k.startswith("eval/") else k): v
        for k, v in record.items()
        if k not in ("step", "kind") and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def _caption(prompt: str, scores: dict[str, float]) -> str:
    return prompt + " | " + " ".join(f"{name}={value:.3g}" for name, value in scores.items())


class RunLogger:
    """Everything a training run writes about itself: ``metrics.jsonl``, evaluation grids and sample
    files, and (unless ``wandb_mode="disabled"``) a wandb run inside the run folder.

    Args:
        output_dir: the run folder (must exist).
        wandb_mode: ``offline`` | ``online`` | ``disabled`` (see the module docstring).
        project, entity, run_name: the wandb project, entity (None: the account's default) and run name
            (None: the run folder's name).
        config: the resolved run config (a plain dict), stored as the wandb run's config.
        max_table_rows: evaluation samples per ``eval/samples`` table.

    Raises:
        ValueError: an unknown ``wandb_mode``.
        WandbInitError: wandb is not installed or ``wandb.init`` failed (e.g. ``online`` without a login).
    """

    def __init__(
        self, output_dir: str | Path, *, wandb_mode: str = "offline", project: str = "diffrl", entity: str | None = None,
        run_name: str | None = None, config: dict | None = None, max_table_rows: int = 64,
    ):
        if wandb_mode not in WANDB_MODES:
            raise ValueError(f"trainer.wandb must be one of {WANDB_MODES}, got {wandb_mode!r}")
        self.output_dir = Path(output_dir)
        self.images_dir = self.output_dir / "images"
        self.images_dir.mkdir(parents=True, exist_ok=True)
        self.max_table_rows = max_table_rows
        self.wandb_mode = wandb_mode
        self.run = None if wandb_mode == "disabled" else self._init_wandb(project, entity, run_name or self.output_dir.name, config or {})
        self._jsonl = JsonlWriter(self.output_dir / "metrics.jsonl")

    def _init_wandb(self, project: str, entity: str | None, run_name: str, config: dict):
        fix = (
            "log in with `wandb login` (or set WANDB_API_KEY), or set trainer.wandb=offline (nothing leaves the machine) "
            "or trainer.wandb=disabled"
            if self.wandb_mode == "online"
            else "set trainer.wandb=disabled to keep only metrics.jsonl and the PNG grids"
        )
        try:
            import wandb
        except ImportError as exc:
            raise WandbInitError(f"trainer.wandb={self.wandb_mode} needs the wandb package ({exc}); pip install wandb, or {fix}") from exc
        try:
            return wandb.init(
                mode=self.wandb_mode, dir=str(self.output_dir), project=project, entity=entity, name=run_name, config=config,
                settings=wandb.Settings(console="off", silent=True),
            )
        except Exception as exc:  # wandb raises UsageError, CommError, timeouts …: all mean "no run"
            raise WandbInitError(f"wandb.init failed in {self.wandb_mode} mode ({type(exc).__name__}: {exc}); {fix}") from exc

    # -- scalars --------------------------------------------------------------------------------
    def log(self, record: dict) -> None:
        """Append ``record`` (with ``step``, ``kind`` and numbers) to ``metrics.jsonl`` and log its numbers to wandb."""
        self._jsonl.write(record)
        if self.run is not None:
            self.run.log(wandb_scalars(record), step=int(record["step"]))

    # -- evaluations ----------------------------------------------------------------------------
    def log_eval_samples(
        self, step: int, images: torch.Tensor, prompts: list[str], seeds: list[int], scores: dict[str, torch.Tensor], *,
        samples_per_prompt: int = 1, max_grid_images: int = 60, grid_columns: int = 10, grid_scale: int = 4,
        source_images: torch.Tensor | None = None,
    ) -> Path:
        """Write evaluation ``step``'s grid PNG and per-sample JSONL; log grid, captioned images and table to wandb.

        Args:
            step: the RL step the evaluation follows.
            images: uint8 ``[N, 3, H, W]`` (or videos ``[N, F, 3, H, W]``), ``samples_per_prompt`` consecutive
                samples per prompt.
            prompts, seeds: ``N`` prompts and sampling seeds.
            scores: ``{metric name: [N]}`` (see :func:`per_sample_scores`).
            source_images: uint8 ``[N, 3, H, W]``, an editing run's sources: each grid cell then shows the
                source and the edit side by side.

        Returns:
            The grid's path.
        """
        n = images.shape[0]
        if len(prompts) != n or len(seeds) != n or any(v.shape != (n,) for v in scores.values()):
            raise ValueError(f"log_eval_samples: {n} images need {n} prompts, seeds and scores per metric")
        on_grid = grid_rows(n, samples_per_prompt, max_grid_images)
        grid_path = self.images_dir / f"eval_step_{step:06d}.png"
        cells = images if source_images is None else torch.cat([source_images, images], dim=-1)  # source | edit
        save_grid(cells[on_grid], grid_path, columns=min(grid_columns, len(on_grid)), scale=grid_scale)
        grid_index = {row: i for i, row in enumerate(on_grid)}
        rows = [
            {"step": step, "index": i, "prompt": prompts[i], "seed": int(seeds[i]), "grid_index": grid_index.get(i),
             **{name: float(values[i]) for name, values in scores.items()}}
            for i in range(n)
        ]
        samples_path = self.images_dir / f"eval_step_{step:06d}.jsonl"
        tmp = samples_path.with_name(samples_path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, samples_path)
        videos = {}
        if images.ndim == 5:
            folder = self.images_dir / f"eval_step_{step:06d}"
            folder.mkdir(exist_ok=True)
            videos = {i: save_gif(images[i], folder / f"{i:04d}.gif", scale=grid_scale) for i in on_grid}
        if self.run is not None:
            self._wandb_eval(step, middle_frames(images), rows, on_grid, grid_path, scores, grid_scale, videos)
        return grid_path

    def _wandb_eval(self, step, images, rows, on_grid, grid_path, scores, grid_scale, videos) -> None:
        import wandb
        from PIL import Image

        def picture(i: int):
            img = Image.fromarray(images[i].permute(1, 2, 0).contiguous().numpy())
            return img.resize((img.width * grid_scale, img.height * grid_scale), Image.NEAREST) if grid_scale > 1 else img

        metric_names = list(scores)
        values = lambda r: {name: r[name] for name in metric_names}
        grid_caption = f"step {step}: " + "; ".join(f"{k + 1}. {_caption(rows[i]['prompt'], values(rows[i]))}" for k, i in enumerate(on_grid))
        table = wandb.Table(columns=["step", "index", "prompt", "seed", "image", *metric_names])
        for r in rows[: self.max_table_rows]:
            table.add_data(step, r["index"], r["prompt"], r["seed"], wandb.Image(picture(r["index"])), *[r[m] for m in metric_names])
        payload = {
            "eval/grid": wandb.Image(str(grid_path), caption=grid_caption),
            "eval/images": [wandb.Image(picture(i), caption=_caption(rows[i]["prompt"], values(rows[i]))) for i in on_grid],
            "eval/samples": table,
        }
        if videos:
            payload["eval/videos"] = [wandb.Video(str(videos[i]), caption=_caption(rows[i]["prompt"], values(rows[i]))) for i in on_grid]
        # a table is logged as an artifact whose files wandb copies into $WANDB_DATA_DIR/artifacts/staging
        # while logging; unless the user chose that folder, keep them inside the run folder too
        previous = os.environ.get("WANDB_DATA_DIR")
        if previous is None:
            os.environ["WANDB_DATA_DIR"] = str(self.output_dir / "wandb" / "data")
        try:
            self.run.log(payload, step=step)
        finally:
            if previous is None:
                os.environ.pop("WANDB_DATA_DIR", None)

    def close(self) -> None:
        self._jsonl.close()
        if self.run is not None:
            run_file = Path(self.run.settings.sync_file) if self.wandb_mode == "offline" else None
            self.run.finish()
            self.run = None
            # finish() may return before wandb's service flushed the last history row and the exit
            # record; wait for them so that the run folder is complete when the trainer returns
            if run_file is not None and not wandb_file.wait_until_complete(run_file, timeout_s=WANDB_FLUSH_TIMEOUT_S):
                warnings.warn(f"wandb has not finished writing {run_file} after {WANDB_FLUSH_TIMEOUT_S:.0f} s; "
                              "its last records may be missing (metrics.jsonl is complete)", stacklevel=2)

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Progress:
    """A tqdm bar over RL steps showing the latest reward/loss (silent when disabled)."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True, desc: str = "train"):
        self.bar = None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True)

    def update(self, **postfix) -> None:
        if self.bar is not None:
            self.bar.set_postfix({k: f"{v:.4g}" if isinstance(v, float) else v for k, v in postfix.items()}, refresh=False)
            self.bar.update(1)

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
