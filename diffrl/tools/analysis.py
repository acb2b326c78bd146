"""Read finished (or running) run folders into pandas and plot them.

A run folder (see ``diffrl.trainer``) holds ``config.yaml``, ``metrics.jsonl``, ``images/eval_step_<N>.png``
and ``.jsonl``, ``checkpoints/step_<N>/``, ``summary.json`` and, unless wandb was disabled, ``wandb/``.

>>> run = load_run("outputs/digits_flow_grpo-20260101-120000")       # doctest: +SKIP
>>> run.eval[["step", "eval/digits", "eval/digits_gold"]]             # doctest: +SKIP
>>> plot_curves([run, other], keys=["reward_mean", "eval/digits_gold"])  # doctest: +SKIP
>>> compare([run, other])[["gold_accuracy_after", "diversity_pixel_vs_base", "frechet_after"]]  # doctest: +SKIP

The offline wandb files are read back without wandb's servers by :func:`read_wandb_offline`: a
``run-<id>.wandb`` file is a 7-byte header (``":W&B"``, magic ``0xBEE1``, version 0) followed by
LevelDB log records (32 KiB blocks; each record a 7-byte header ``crc32 | length | type`` with types
full / first / middle / last; LevelDB's ``doc/log_format.md``) whose payloads are wandb's protobuf
``Record`` messages; the CRC is zlib's CRC-32 of the type byte then the payload.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch

from diffrl import wandb_file
from diffrl.checkpoint import list_checkpoints
from diffrl.config import eval_metric_names
from diffrl.data import eval_subset, run_prompts
from diffrl.recipes import to_config, upgrade_run_config
from diffrl.distributed.workers import TrainingWorker
from diffrl.logging import grid_cells, image_grid
from diffrl.sampling.distribution import DISTRIBUTION_KEYS, relative_to_base
from diffrl.sampling.evaluation import eval_prompts_and_seeds
from diffrl.sampling.evaluator import Evaluator, local_generate
from diffrl.run_setup import worker_config
from pipelines import build_adapter
from rewards.base import build_reward

_EVAL_FILE = re.compile(r"eval_step_(\d+)\.(png|jsonl)$")
_STEP_DIR = re.compile(r"step_(\d+)$")


@dataclass
class Run:
    """One run folder loaded into memory.

    Attributes:
        path: the run folder.
        name: a label for plots (default: the folder's name).
        config: the resolved run config (a plain dict of ``config.yaml``).
        train: one row per training step (``step`` and every metric of ``metrics.jsonl``'s train lines).
        eval: one row per evaluation (``step``, ``eval/<metric>``, ``eval/seconds``, ``wall_seconds``).
        summary: ``summary.json`` (None while the run has not finished).
    """

    path: Path
    name: str
    config: dict
    train: pd.DataFrame
    eval: pd.DataFrame
    summary: dict | None = None
    _samples: dict = field(default_factory=dict, repr=False)

    # -- evaluation images and samples ----------------------------------------------------------
    def eval_steps(self) -> list[int]:
        """Steps that have an evaluation grid, ascending."""
        return sorted(int(m.group(1)) for p in (self.path / "images").glob("eval_step_*.png") if (m := _EVAL_FILE.search(p.name)))

    def grid_path(self, step: int) -> Path:
        path = self.path / "images" / f"eval_step_{step:06d}.png"
        if not path.is_file():
            raise FileNotFoundError(f"run {self.path} has no evaluation grid at step {step}; grids exist at steps {self.eval_steps()}")
        return path

    def grid(self, step: int):
        """The evaluation grid at ``step`` as a PIL image (the first seed of each prompt, ×4 nearest)."""
        from PIL import Image

        with Image.open(self.grid_path(step)) as img:
            return img.convert("RGB")

    def grid_images(self, step: int, *, columns: int = 10, scale: int = 4) -> tuple[torch.Tensor, pd.DataFrame]:
        """The evaluation grid at ``step`` back as images: ``(uint8 [N, 3, H, W], the N per-sample rows in grid
        order)``, exact (the grid is ×``scale`` nearest of the images; ``columns`` and ``scale`` as the logger drew
        it, by default 10 and 4). An editing run's cells are source | edit side by side."""
        rows = self.samples(step)
        rows = rows[rows["grid_index"].notna()].sort_values("grid_index").reset_index(drop=True)
        return grid_cells(self.grid(step), len(rows), columns=min(columns, len(rows)), scale=scale), rows

    def samples(self, step: int | None = None) -> pd.DataFrame:
        """Per-sample evaluation scores (``step, index, prompt, seed, grid_index, <metric> …``) at ``step``
        (None: every evaluation, concatenated)."""
        steps = self.eval_steps() if step is None else [step]
        frames = []
        for s in steps:
            if s not in self._samples:
                path = self.path / "images" / f"eval_step_{s:06d}.jsonl"
                if not path.is_file():
                    raise FileNotFoundError(f"run {self.path} has no per-sample evaluation file {path.name} (written by diffrl ≥ this version)")
                self._samples[s] = pd.DataFrame([json.loads(line) for line in path.read_text().splitlines() if line.strip()])
            frames.append(self._samples[s])
        return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()

    def checkpoints(self) -> dict[int, Path]:
        """``{step: folder}`` of the complete checkpoints."""

        return {int(_STEP_DIR.search(p.name).group(1)): p for p in list_checkpoints(self.path / "checkpoints")}

    def metric(self, key: str) -> pd.DataFrame:
        """``step`` and ``key`` from the train rows if they hold it, else from the eval rows."""
        for frame in (self.train, self.eval):
            if key in frame.columns:
                return frame[["step", key]].dropna()
        raise KeyError(f"run {self.name!r} has no metric {key!r}; train metrics: {list(self.train.columns)}, eval metrics: {list(self.eval.columns)}")


def load_run(path: str | Path, name: str | None = None) -> Run:
    """Load a run folder: ``metrics.jsonl`` into train and eval DataFrames, ``config.yaml``, ``summary.json``.

    Raises:
        FileNotFoundError: ``path`` is not a run folder (no ``metrics.jsonl``).
    """
    from omegaconf import OmegaConf

    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{path} is not a diffrl run folder: {metrics.name} is missing (give the trainer.output_dir of a run)")
    records = []
    for line in metrics.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # the last line of a killed run may be cut
            continue
    frame = pd.DataFrame(records)
    if "kind" not in frame.columns:
        frame["kind"] = pd.Series(dtype=str)
    split = lambda kind: frame[frame["kind"] == kind].drop(columns="kind").dropna(axis=1, how="all").reset_index(drop=True)
    config_file = path / "config.yaml"
    config = upgrade_run_config(OmegaConf.to_container(OmegaConf.load(config_file), resolve=False)) if config_file.is_file() else {}
    summary_file = path / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else None
    return Run(path=path, name=name or path.name, config=config, train=split("train"), eval=split("eval"), summary=summary)


def _as_runs(runs: Run | str | Path | Iterable) -> list[Run]:
    if isinstance(runs, (Run, str, Path)):
        runs = [runs]
    return [r if isinstance(r, Run) else load_run(r) for r in runs]


def compare(runs: Sequence[Run | str | Path]) -> pd.DataFrame:
    """One row per run: the scalar entries of ``summary.json`` and its :func:`collapse_columns` (runs without
    a summary give NaN)."""
    rows = []
    for run in _as_runs(runs):
        summary = run.summary or {}
        scalars = {k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        rows.append({"run": run.name, **scalars, **collapse_columns(summary)})
    return pd.DataFrame(rows).set_index("run")


def collapse_columns(summary: dict) -> dict:
    """What the reward misses, as flat columns of a ``summary.json``: each distribution metric of
    ``diffrl.sampling.distribution`` before and after (``frechet_before`` …), the diversities relative to
    the base model (``diversity_pixel_vs_base``) and, per extra judge, its accuracy before and after and
    whether its change disagrees with gold's beyond the evaluation noise (``digits_gold2_disagrees``)."""
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    out = {}
    for key in DISTRIBUTION_KEYS:
        if f"eval/{key}" in before and f"eval/{key}" in after:
            out[f"{key}_before"], out[f"{key}_after"] = before[f"eval/{key}"], after[f"eval/{key}"]
    out.update(relative_to_base(before, after))
    for judge, d in (summary.get("judges") or {}).items():
        out[f"{judge}_before"], out[f"{judge}_after"], out[f"{judge}_disagrees"] = d["judge_before"], d["judge_after"], d["disagree"]
    return out


# -- plots --------------------------------------------------------------------------------------
def plot_curves(runs: Run | str | Path | Sequence, keys: Sequence[str], *, ncols: int = 3, smooth: int = 1, figsize_per_plot=(4.0, 3.0)):
    """One panel per metric ``key``, one line per run; returns the matplotlib ``Figure``.

    Train metrics (e.g. ``reward_mean``, ``loss``) are drawn as lines (a running mean over ``smooth``
    steps when ``smooth > 1``), evaluation metrics (``eval/<name>``) as lines with markers.

    Raises:
        KeyError: a key that no run has, with the metrics the runs do have.
    """
    import matplotlib.pyplot as plt

    runs = _as_runs(runs)
    keys = list(keys)
    if not keys:
        raise ValueError("plot_curves needs at least one metric key")
    for key in keys:
        if not any(key in r.train.columns or key in r.eval.columns for r in runs):
            available = sorted({c for r in runs for c in (*r.train.columns, *r.eval.columns)} - {"step"})
            raise KeyError(f"no run has the metric {key!r}; available: {available}")
    ncols = min(ncols, len(keys))
    nrows = -(-len(keys) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(figsize_per_plot[0] * ncols, figsize_per_plot[1] * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for run in runs:
            try:
                data = run.metric(key)
            except KeyError:
                continue
            values = data[key].rolling(smooth, min_periods=1).mean() if smooth > 1 and key in run.train.columns else data[key]
            ax.plot(data["step"], values, marker="o" if key in run.eval.columns else None, label=run.name)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    if len(runs) > 1:
        axes.flat[0].legend(fontsize="small")
    fig.tight_layout()
    return fig


def plot_grids(run: Run | str | Path, steps: Sequence[int] | None = None, *, metrics: Sequence[str] | None = None, width: float = 10.0):
    """The evaluation grids of ``run`` at ``steps`` (default: every evaluation), one row each, titled
    with the step and the evaluation's mean metrics; returns the ``Figure``."""
    import matplotlib.pyplot as plt

    (run,) = _as_runs(run)
    steps = list(steps) if steps is not None else run.eval_steps()
    if not steps:
        raise FileNotFoundError(f"run {run.path} has no evaluation grids")
    grids = [run.grid(s) for s in steps]
    aspect = grids[0].height / grids[0].width
    fig, axes = plt.subplots(len(steps), 1, figsize=(width, width * aspect * len(steps) + 0.4 * len(steps)), squeeze=False)
    for ax, step, grid in zip(axes[:, 0], steps, grids):
        ax.imshow(grid)
        ax.set_axis_off()
        row = run.eval[run.eval["step"] == step]
        names = metrics or [c for c in run.eval.columns if c.startswith("eval/") and c != "eval/seconds"]
        stats = ", ".join(f"{n.removeprefix('eval/')}={row[n].iloc[-1]:.3f}" for n in names if n in row and len(row))
        ax.set_title(f"step {step}" + (f": {stats}" if stats else ""))
    fig.tight_layout()
    return fig


def plot_seed_grid(images: dict, prompts: list[str], per_prompt: int, *, title: str | None = None, scale: int = 4, dpi: int = 80):
    """Per-prompt seed grids side by side: one row per prompt, its ``per_prompt`` seeds under each model.

    Args:
        images: ``{label: uint8 [N, 3, H, W]}`` (e.g. base, trained, real), each in the order of ``prompts``.
        prompts: ``N`` prompts, ``per_prompt`` consecutive samples per prompt.

    Returns:
        The matplotlib ``Figure`` (prompts as row labels, model labels on top).
    """
    import matplotlib.pyplot as plt

    names = list(images)
    if not names or any(v.shape[0] != len(prompts) for v in images.values()):
        raise ValueError(f"plot_seed_grid: every model needs {len(prompts)} images (one per prompt), got {[tuple(v.shape) for v in images.values()]}")
    starts = list(range(0, len(prompts), per_prompt))
    gap = torch.full_like(images[names[0]][:1], 64)
    tiles = [t for s in starts for k, name in enumerate(names) for t in ([images[name][s : s + per_prompt]] + ([gap] if k < len(names) - 1 else []))]
    columns = len(names) * (per_prompt + 1) - 1
    grid = image_grid(torch.cat(tiles), columns=columns, scale=scale)
    fig, ax = plt.subplots(figsize=(grid.width / dpi + 1.6, grid.height / dpi + 0.6), dpi=dpi)
    ax.imshow(grid)
    ax.set_yticks([grid.height * (i + 0.5) / len(starts) for i in range(len(starts))], [prompts[s] for s in starts], fontsize=7)
    ax.set_xticks([grid.width * (k * (per_prompt + 1) + per_prompt / 2) / columns for k in range(len(names))], names, fontsize=8)
    ax.xaxis.tick_top()
    ax.tick_params(length=0)
    if title:
        ax.set_xlabel(title, fontsize=9)
    fig.tight_layout()
    return fig


def plot_reward_histograms(run: Run | str | Path, metric: str, steps: Sequence[int] | None = None, *, bins: int = 20):
    """Histograms of the per-sample evaluation ``metric`` at ``steps`` (default: first and last
    evaluation) overlaid on one axis; returns the ``Figure``."""
    import matplotlib.pyplot as plt
    import numpy as np

    (run,) = _as_runs(run)
    available = run.eval_steps()
    steps = list(steps) if steps is not None else sorted({available[0], available[-1]})
    frames = {s: run.samples(s) for s in steps}
    for s, frame in frames.items():
        if metric not in frame.columns:
            raise KeyError(f"evaluation at step {s} has no per-sample metric {metric!r}; it has {[c for c in frame.columns if c not in ('step', 'index', 'prompt', 'seed', 'grid_index')]}")
    values = np.concatenate([f[metric].to_numpy() for f in frames.values()])
    edges = np.histogram_bin_edges(values, bins=bins)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for s, frame in frames.items():
        ax.hist(frame[metric], bins=edges, alpha=0.5, label=f"step {s} (mean {frame[metric].mean():.3f})")
    ax.set_xlabel(metric)
    ax.set_ylabel("samples")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


# -- the trained policy -----------------------------------------------------------------------
def eval_set(run: Run | str | Path, adapter=None) -> tuple[list[str], list[int]]:
    """The run's held-out evaluation prompts and seeds (the same pairs its evaluations sampled).

    The prompts are the run's evaluation prompts (``diffrl.data.run_prompts``: a built-in set's test split, a
    prompt file), else the model family's built-in set (from ``adapter``, else a freshly built one)."""

    (run,) = _as_runs(run)
    cfg = to_config(run.config)
    _, prompts, _ = run_prompts(cfg)
    if prompts is None:
        if adapter is None:
            m = run.config["model"]
            adapter = build_adapter(m["family"], path=m["path"], revision=m.get("revision"), dtype=m["dtype"], device=m["device"])
        prompts = eval_subset(adapter.default_prompts(), cfg.eval)
    return eval_prompts_and_seeds(prompts, int(cfg.eval.seeds_per_prompt), int(cfg.eval.seed))


def eval_metrics(run: Run | str | Path) -> dict:
    """``{name: reward}``: the run's rewards, gold metric and extra judges (``reward.judges``), built from its
    config (as the trainer does)."""

    (run,) = _as_runs(run)
    r = run.config["reward"]
    options = r.get("options") or {}
    names = eval_metric_names(r)
    return {name: build_reward(name, **options.get(name, {})) for name in names}


def sample_eval(run: Run | str | Path, adapter, prompts: list[str] | None = None, seeds: list[int] | None = None):
    """Sample like the run's evaluations (its sampler settings made deterministic, ``eval_num_steps``)
    with ``adapter`` (e.g. ``load_policy(run).adapter``, or the base model inside
    ``worker.engine.reference()``) on ``prompts``/``seeds`` (default: :func:`eval_set`).

    Returns:
        ``(images uint8 [N, 3, H, W], prompts, seeds)``.
    """
    from omegaconf import OmegaConf


    (run,) = _as_runs(run)
    cfg = OmegaConf.create(run.config)
    if prompts is None:
        prompts, seeds = eval_set(run, adapter)
    if seeds is None or len(seeds) != len(prompts):
        raise ValueError("sample_eval needs one seed per prompt (or neither, for the run's evaluation set)")
    evaluator = Evaluator({}, eval_num_steps=int(cfg.sampler.eval_num_steps), micro_batch_size=cfg.sampler.micro_batch_size)
    return evaluator.run(local_generate(adapter, worker_config(cfg).sampler), prompts, seeds).images, prompts, seeds


def load_policy(run: Run | str | Path, step: int | None = None):
    """A ``TrainingWorker`` built from the run's config with checkpoint ``step`` loaded (None: the newest).

    ``worker.adapter`` samples with the trained policy; ``with worker.engine.reference() as base:``
    samples with the base model (LoRA disabled), so both can be compared on the same seeds.
    """
    from omegaconf import OmegaConf


    (run,) = _as_runs(run)
    found = run.checkpoints()
    if not found:
        raise FileNotFoundError(f"run {run.path} has no complete checkpoint")
    if step is None:
        step = max(found)
    if step not in found:
        raise FileNotFoundError(f"run {run.path} has no checkpoint at step {step}; checkpoints: {sorted(found)}")
    worker = TrainingWorker(worker_config(OmegaConf.create(run.config)))
    worker.reset()
    worker.load_checkpoint(found[step])
    return worker


# -- offline wandb files ----------------------------------------------------------------------
@dataclass
class WandbOfflineRun:
    """What :func:`read_wandb_offline` found: ``history`` (one dict per ``run.log`` commit, with ``_step``),
    ``config`` (key → value), ``run_id`` and the ``files`` folder (media, tables)."""

    run_dir: Path
    run_id: str
    history: list[dict]
    config: dict
    files: Path
    artifacts: dict[str, dict] = field(default_factory=dict)
    """client id → ``{"name", "type", "files": {path in artifact: local file}}`` (tables are artifacts)"""

    def row(self, step: int) -> dict:
        """The history row of wandb step ``step``."""
        for row in self.history:
            if row.get("_step") == step:
                return row
        raise KeyError(f"wandb history has no step {step}; steps: {[r.get('_step') for r in self.history]}")

    def table(self, key: str, step: int) -> pd.DataFrame:
        """The ``wandb.Table`` logged under ``key`` at ``step``; image cells become local file paths."""
        ref = self.row(step)[key]["artifact_path"]  # wandb-client-artifact://<client id>/<path>
        client_id, _, inner = ref.split("://", 1)[1].partition("/")
        files = self.artifacts[client_id.split(":")[0]]["files"]
        data = json.loads(Path(files[inner]).read_text())
        cell = lambda v: files[v["path"]] if isinstance(v, dict) and v.get("_type") == "image-file" else v
        return pd.DataFrame([[cell(v) for v in r] for r in data["data"]], columns=data["columns"])


def _item_value(item):
    which = item.WhichOneof("value")
    if which is None or which == "none":
        return json.loads(item.value_json) if item.value_json else None
    value = getattr(item, which)
    return json.loads(value) if which == "json" else value


def _set_nested(target: dict, keys: list[str], value) -> None:
    """``target[k0][k1]… = value`` (wandb splits a media value into items with a ``nested_key`` path)."""
    for key in keys[:-1]:
        target = target.setdefault(key, {})
    target[keys[-1]] = value


def read_wandb_offline(path: str | Path) -> WandbOfflineRun:
    """Read an offline wandb run back: a run folder (its newest ``wandb/offline-run-*``), an
    ``offline-run-*`` folder or a ``run-<id>.wandb`` file.

    Returns:
        :class:`WandbOfflineRun` with the logged history (values decoded from wandb's JSON: numbers stay
        numbers, media and tables are their ``{"_type": …}`` descriptors) and the config.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    path = Path(path)
    if path.is_dir() and (path / "wandb").is_dir():
        found = sorted((path / "wandb").glob("offline-run-*"))
        if not found:
            raise FileNotFoundError(f"{path / 'wandb'} holds no offline-run-* folder (was the run logged with trainer.wandb=offline?)")
        path = found[-1]
    files = sorted(path.glob("run-*.wandb")) if path.is_dir() else [path]
    if not files or not files[0].is_file():
        raise FileNotFoundError(f"no run-<id>.wandb file at {path}")
    history, config, run_id, artifacts = [], {}, "", {}
    for payload in wandb_file.payloads(files[0]):
        record = pb.Record()
        record.ParseFromString(payload)
        which = record.WhichOneof("record_type")
        if which == "history":
            row = {}
            for item in record.history.item:
                _set_nested(row, [item.key] if item.key else list(item.nested_key), _item_value(item))
            if record.history.HasField("step"):
                row.setdefault("_step", record.history.step.num)
            history.append(row)
        elif which == "run":
            run_id = record.run.run_id
            for item in record.run.config.update:
                _set_nested(config, [item.key] if item.key else list(item.nested_key), json.loads(item.value_json))
        elif which == "config":
            for item in record.config.update:
                _set_nested(config, [item.key] if item.key else list(item.nested_key), json.loads(item.value_json))
        elif which == "artifact":
            a = record.artifact
            artifacts[a.client_id] = {"name": a.name, "type": a.type, "files": {c.path: Path(c.local_path) for c in a.manifest.contents}}
    folder = files[0].parent
    return WandbOfflineRun(run_dir=folder, run_id=run_id, history=history, config=config, files=folder / "files", artifacts=artifacts)
