"""Run logging (JSONL, grids, per-sample files, offline wandb) and ``diffrl.tools.analysis`` reading runs back."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from diffrl.logging import RunLogger, WandbInitError, grid_cells, image_grid, per_sample_scores, read_jsonl, wandb_scalars
from diffrl.tools.analysis import (
    Run,
    compare,
    eval_metrics,
    eval_set,
    load_policy,
    load_run,
    plot_curves,
    plot_grids,
    plot_reward_histograms,
    read_wandb_offline,
    sample_eval,
)

PROMPTS = ["a red seven", "a blue three", "a green one"]
RECORDS = [
    {"step": 0, "kind": "eval", "eval/digits": 0.25, "eval/digits_gold": 0.5, "eval/seconds": 0.1, "wall_seconds": 0.2},
    {"step": 1, "kind": "train", "reward_mean": 0.3125, "loss": -0.015625, "clipfrac": 0, "time/rollout": 0.5, "wall_seconds": 1.5},
    {"step": 2, "kind": "train", "reward_mean": 0.4375, "loss": 0.0078125, "clipfrac": 1, "time/rollout": 0.25, "wall_seconds": 2.5},
    {"step": 2, "kind": "eval", "eval/digits": 0.5, "eval/digits_gold": 0.75, "eval/seconds": 0.125, "wall_seconds": 3.0},
]


def _eval_inputs(step: int):
    g = torch.Generator().manual_seed(step)
    images = torch.randint(0, 256, (6, 3, 5, 4), generator=g, dtype=torch.uint8)
    prompts = [p for p in PROMPTS for _ in range(2)]  # 2 seeds per prompt
    seeds = [100 * step + i for i in range(6)]
    scores = {"digits": torch.rand(6, generator=g), "digits_gold": (torch.rand(6, generator=g) > 0.5).float()}
    return images, prompts, seeds, scores


def _write_run(folder, mode: str, config: dict) -> None:
    folder.mkdir()
    with RunLogger(folder, wandb_mode=mode, run_name="t", config=config, max_table_rows=5) as logger:
        for record in RECORDS:
            if record["kind"] == "eval":
                logger.log_eval_samples(record["step"], *_eval_inputs(record["step"]), samples_per_prompt=2, max_grid_images=60)
            logger.log(record)


def _pixels(path) -> np.ndarray:
    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"))


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    root = tmp_path_factory.mktemp("logged")
    config = {"trainer": {"steps": 2, "seed": 0}, "experiment": "unit"}
    _write_run(root / "offline", "offline", config)
    _write_run(root / "disabled", "disabled", config)
    return root, config


def test_offline_wandb_holds_the_metrics_images_and_sample_table(logged):
    root, config = logged
    run = read_wandb_offline(root / "offline")
    assert run.run_dir.parent == root / "offline" / "wandb"  # the wandb dir lives inside the run folder
    assert {k: run.config[k] for k in config} == config
    by_step = {row["_step"]: row for row in run.history}
    assert sorted(by_step) == [0, 1, 2]
    for record in RECORDS:  # every number of every JSONL record, at its step, under its (wandb) key
        for key, value in wandb_scalars(record).items():
            assert by_step[record["step"]][key] == value, (record["step"], key)
    assert by_step[2]["eval/wall_seconds"] == 3.0 and by_step[2]["wall_seconds"] == 2.5  # eval does not overwrite train
    images, prompts, seeds, scores = _eval_inputs(2)
    # per-image captions: prompt and every metric
    captions = by_step[2]["eval/images"]["captions"]
    assert captions == [f"{prompts[i]} | digits={scores['digits'][i]:.3g} digits_gold={scores['digits_gold'][i]:.3g}" for i in (0, 2, 4)]
    assert by_step[2]["eval/grid"]["caption"].startswith("step 2: 1. a red seven | digits=")
    # the grid in wandb's media is the local PNG, pixel for pixel
    assert (_pixels(run.files / by_step[2]["eval/grid"]["path"]) == _pixels(root / "offline" / "images" / "eval_step_000002.png")).all()
    # the sample table: one row per sample (capped at max_table_rows=5), prompt / seed / image / rewards;
    # its files (a wandb artifact) are staged inside the run folder too
    table = run.table("eval/samples", 2)
    assert list(table.columns) == ["step", "index", "prompt", "seed", "image", "digits", "digits_gold"]
    assert len(table) == 5
    for i, row in enumerate(table.itertuples(index=False)):
        assert list(row[:4]) == [2, i, prompts[i], seeds[i]]
        assert row.digits == pytest.approx(float(scores["digits"][i]), abs=1e-7) and row.digits_gold == float(scores["digits_gold"][i])
        assert (root / "offline" / "wandb" / "data") in row.image.parents
        assert (_pixels(row.image)[::4, ::4] == images[i].permute(1, 2, 0).numpy()).all()  # the sample itself, ×4 nearest


def test_waiting_for_a_run_file_sees_the_exit_record_written_late(logged, tmp_path):
    """close() waits for wandb's last records: a file cut before them is incomplete until the rest arrives."""
    import threading

    from diffrl import wandb_file

    full = next((logged[0] / "offline" / "wandb").glob("offline-run-*/run-*.wandb"))
    data = full.read_bytes()
    kinds = wandb_file.record_types(full)
    assert kinds[0] == "header" and kinds[-1] == "exit" and "history" in kinds  # what close() waited for
    cut = tmp_path / "run-x.wandb"
    cut.write_bytes(data[: len(data) - 40])  # the exit record (and maybe the last history row) not yet flushed
    assert "exit" not in wandb_file.record_types(cut)
    assert wandb_file.wait_until_complete(cut, timeout_s=0.2) is False
    writer = threading.Timer(0.3, lambda: cut.write_bytes(data))
    writer.start()
    try:
        assert wandb_file.wait_until_complete(cut, timeout_s=30) is True
    finally:
        writer.join()
    assert wandb_file.record_types(cut) == kinds


def test_disabled_writes_nothing_for_wandb_and_the_same_local_files(logged):
    root, _ = logged
    off, dis = root / "offline", root / "disabled"
    assert not (dis / "wandb").exists() and sorted(p.name for p in dis.iterdir()) == ["images", "metrics.jsonl"]
    assert (off / "metrics.jsonl").read_bytes() == (dis / "metrics.jsonl").read_bytes()
    assert read_jsonl(dis / "metrics.jsonl") == RECORDS
    for name in ("eval_step_000000.png", "eval_step_000002.png", "eval_step_000000.jsonl", "eval_step_000002.jsonl"):
        assert (off / "images" / name).read_bytes() == (dis / "images" / name).read_bytes()
    # the grid: the first seed of each prompt, 4× nearest, 1-pixel padding
    images = _eval_inputs(2)[0]
    grid = _pixels(dis / "images" / "eval_step_000002.png")
    for k, i in enumerate((0, 2, 4)):
        left = (1 + k * 5) * 4
        assert (grid[4:24:4, left : left + 16 : 4] == images[i].permute(1, 2, 0).numpy()).all()
    rows = read_jsonl(dis / "images" / "eval_step_000002.jsonl")
    _, prompts, seeds, scores = _eval_inputs(2)
    assert [(r["prompt"], r["seed"], r["grid_index"]) for r in rows] == [(prompts[i], seeds[i], {0: 0, 2: 1, 4: 2}.get(i)) for i in range(6)]
    assert [r["digits"] for r in rows] == [float(v) for v in scores["digits"]]


def test_wandb_failures_are_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"trainer.wandb must be one of \('offline', 'online', 'disabled'\), got 'ofline'"):
        RunLogger(tmp_path, wandb_mode="ofline")
    for var in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc, no wandb settings: not logged in
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    with pytest.raises(WandbInitError, match=r"online mode .*wandb login.*trainer.wandb=offline.*trainer.wandb=disabled"):
        RunLogger(tmp_path / "run", wandb_mode="online")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing written before the error


# -- whole runs --------------------------------------------------------------------------------
TINY = ["trainer.steps=3", "trainer.prompts_per_step=2", "trainer.group_size=4", "eval.seeds_per_prompt=2",
        "eval.every=2", "trainer.progress=false", "sampler.num_steps=3", "sampler.eval_num_steps=3", "trainer.threads=1"]


def _numbers(records):
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/")) and "seconds" not in k} for r in records]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from diffrl.tools.cli import main

    root = tmp_path_factory.mktemp("runs")
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    for mode in ("offline", "disabled"):
        assert main(["train", f"trainer.output_dir={root / mode}", f"trainer.prompts={root / 'prompts.txt'}", f"trainer.wandb={mode}", *TINY]) == 0
    return root


def test_training_jsonl_is_identical_with_and_without_wandb(runs):
    off, dis = (read_jsonl(runs / m / "metrics.jsonl") for m in ("offline", "disabled"))
    assert [(r["step"], r["kind"]) for r in off] == [(0, "eval"), (1, "train"), (2, "train"), (2, "eval"), (3, "train"), (3, "eval")]
    assert _numbers(off) == _numbers(dis)
    assert not (runs / "disabled" / "wandb").exists()
    history = {row["_step"]: row for row in read_wandb_offline(runs / "offline").history}
    for record in off:
        for key, value in wandb_scalars(record).items():
            assert history[record["step"]][key] == value
    assert read_wandb_offline(runs / "offline").config["trainer"]["wandb"] == "offline"


def test_load_run_matches_the_jsonl_and_the_sample_files(runs):
    run = load_run(runs / "offline")
    records = read_jsonl(runs / "offline" / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert run.train["step"].tolist() == [1, 2, 3] and run.eval["step"].tolist() == [0, 2, 3]
    for key in ("reward_mean", "reward_std", "loss", "wall_seconds"):
        assert run.train[key].tolist() == [r[key] for r in train]
    for key in ("eval/digits", "eval/digits_gold"):
        assert run.eval[key].tolist() == [r[key] for r in evals]
    assert run.config["trainer"]["steps"] == 3 and run.summary["steps"] == 3
    assert run.eval_steps() == [0, 2, 3] and sorted(run.checkpoints()) == [3]
    for r in evals:  # the per-sample scores average to the evaluation's numbers
        samples = run.samples(r["step"])
        assert len(samples) == 6 and samples["prompt"].tolist() == [p for p in PROMPTS for _ in range(2)]
        assert samples["digits"].mean() == pytest.approx(r["eval/digits"], abs=1e-6)
        assert samples["digits_gold"].mean() == pytest.approx(r["eval/digits_gold"], abs=1e-6)
    assert run.grid(3).size == _pixels(runs / "offline" / "images" / "eval_step_000003.png").shape[1::-1]
    assert compare([run, runs / "disabled"]).loc["offline", "reward_after"] == run.summary["reward_after"]
    with pytest.raises(FileNotFoundError, match="not a diffrl run folder"):
        load_run(runs)


def test_plots_draw_the_numbers(runs):
    import matplotlib

    matplotlib.use("Agg")
    a, b = load_run(runs / "offline"), load_run(runs / "disabled", name="no-wandb")
    fig = plot_curves([a, b], keys=["reward_mean", "eval/digits_gold"])
    reward_ax, gold_ax = fig.axes[:2]
    assert [line.get_label() for line in reward_ax.lines] == ["offline", "no-wandb"]
    assert list(reward_ax.lines[0].get_xdata()) == [1, 2, 3]
    assert list(reward_ax.lines[0].get_ydata()) == a.train["reward_mean"].tolist()
    assert list(gold_ax.lines[1].get_ydata()) == b.eval["eval/digits_gold"].tolist()
    with pytest.raises(KeyError, match="no run has the metric 'rewardmean'"):
        plot_curves(a, keys=["rewardmean"])
    assert len([ax for ax in plot_grids(a).axes if ax.images]) == 3
    hist = plot_reward_histograms(a, "digits")
    assert sum(p.get_height() for p in hist.axes[0].patches) == 12  # 6 samples at steps 0 and 3


def test_load_policy_reproduces_the_last_evaluation(runs):
    """The checkpoint, loaded from the run folder, samples the evaluation seeds to the logged numbers."""
    from diffrl.sampling.evaluator import evaluate
    from rewards.base import build_reward

    run = load_run(runs / "offline")
    prompts, seeds = eval_set(run)
    worker = load_policy(run)
    metrics = {"digits": build_reward("digits")}
    kwargs = dict(seeds=seeds, num_steps=3, guidance_scale=1.0, metrics=metrics)
    trained, _ = evaluate(worker.adapter, prompts, **kwargs)
    with worker.engine.reference() as base:
        before, _ = evaluate(base, prompts, **kwargs)
    assert trained["eval/digits"] == pytest.approx(run.eval["eval/digits"].iloc[-1], abs=1e-6)
    assert before["eval/digits"] == pytest.approx(run.eval["eval/digits"].iloc[0], abs=1e-6)
    assert trained["eval/digits"] != before["eval/digits"]
    # the same through sample_eval / eval_metrics (the notebooks' path), per sample against the sample file
    images, prompts_b, _ = sample_eval(run, worker.adapter)
    scores = per_sample_scores(images, prompts_b, eval_metrics(run))
    # the reward, gold, the fidelity headline, the second judge and the realness check
    assert sorted(scores) == ["digits", "digits_fidelity", "digits_gold", "digits_gold2", "digits_real"]
    logged = run.samples(3)
    assert scores["digits"].tolist() == pytest.approx(logged["digits"].tolist(), abs=1e-6)
    assert scores["digits_gold"].tolist() == logged["digits_gold"].tolist()
    assert scores["digits_gold2"].tolist() == logged["digits_gold2"].tolist()
    assert scores["digits_fidelity"].tolist() == logged["digits_fidelity"].tolist()
    assert scores["digits_real"].tolist() == logged["digits_real"].tolist()


def test_grid_images_give_back_the_logged_images_exactly(logged):
    root, _ = logged
    images, prompts, _, scores = _eval_inputs(2)
    run = Run(root / "offline", name="offline", config={}, train=None, eval=None)
    cells, rows = run.grid_images(2)
    assert torch.equal(cells, images[[0, 2, 4]])  # the first seed of each prompt
    assert rows["prompt"].tolist() == PROMPTS and rows["digits"].tolist() == pytest.approx(scores["digits"][[0, 2, 4]].tolist())
    many = torch.randint(0, 256, (7, 3, 6, 9), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    assert torch.equal(grid_cells(image_grid(many, columns=3, scale=2), 7, columns=3, scale=2), many)
    with pytest.raises(ValueError, match="not 7 cells in 4 columns"):
        grid_cells(image_grid(many, columns=3, scale=2), 7, columns=4, scale=2)
