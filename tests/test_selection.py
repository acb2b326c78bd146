"""eval.select_by and eval.stop_when_diverging: the hacking signature on constructed histories (closed forms),
the best checkpoint kept and named, the stop at the right step through the trainer, and the one-line config errors."""

from __future__ import annotations

import json

import pytest
import torch

from diffrl.recipes import ConfigError, compose, validate
from diffrl.selection import Selection, diverging, metric_key
from diffrl.trainer import Trainer
from rewards.base import Reward, register_reward


def test_the_hacking_signature_on_constructed_histories():
    assert diverging([0.1, 0.2, 0.3], [0.6, 0.5, 0.4], 2)  # reward up twice, judge down twice
    assert not diverging([0.1, 0.2, 0.3], [0.4, 0.5, 0.6], 2)  # healthy: both rise
    assert not diverging([0.3, 0.2, 0.1], [0.6, 0.5, 0.4], 2)  # a collapse: both fall (not hacking)
    assert not diverging([0.1, 0.2, 0.3], [0.6, 0.5, 0.55], 2)  # the judge recovered once
    assert not diverging([0.1, 0.2, 0.2], [0.6, 0.5, 0.4], 2)  # the reward flat once
    assert not diverging([0.1, 0.2], [0.6, 0.5], 2)  # k + 1 evaluations needed
    assert diverging([0.1, 0.2], [0.6, 0.5], 1) and not diverging([0.1, 0.2], [0.6, 0.5], 0)
    assert diverging([0.5, 0.1, 0.2, 0.3], [0.1, 0.7, 0.6, 0.5], 2)  # only the last k changes count
    assert metric_key("digits_gold2") == ("eval/digits_gold2", 1.0) and metric_key("-eval/frechet") == ("eval/frechet", -1.0)


def test_selection_keeps_the_best_and_names_it():
    s = Selection("digits_gold2", 2, {"digits": 1.0})
    history = [(0, 0.10, 0.50), (2, 0.20, 0.60), (4, 0.30, 0.55), (6, 0.40, 0.50)]
    seen = [s.observe(step, {"eval/digits": r, "eval/digits_gold2": j}) for step, r, j in history]
    assert seen == [(True, False), (True, False), (False, False), (False, True)]
    assert s.best == {"step": 2, "value": 0.60, "metric": "eval/digits_gold2"}
    assert "stopped at step 6" in s.stop_message() and "use checkpoint step_000002" in s.stop_message() and "0.6 → 0.5" in s.stop_message()
    lower = Selection("-eval/frechet", 0, {"digits": 1.0})  # lower is better
    for step, value in [(0, 120.0), (2, 110.0), (4, 115.0)]:
        lower.observe(step, {"eval/digits": 0.0, "eval/frechet": value})
    assert lower.best == {"step": 2, "value": 110.0, "metric": "eval/frechet"}
    with pytest.raises(KeyError, match="has no eval/nope"):
        Selection("nope", 0, {"digits": 1.0}).observe(0, {"eval/digits": 0.1})


@register_reward("test_rising_reward")
class RisingReward(Reward):
    """The same value for every image, 0.1 × the step it is scored at: a reward that only ever rises."""

    def __call__(self, images, prompts, metadata=None):
        step = metadata[0]["step"] if isinstance(metadata, list) else metadata["step"]
        return {self.name: torch.full((images.shape[0],), 0.1 * step)}


@register_reward("test_peaking_judge")
class PeakingJudge(Reward):
    """A held-out judge that improves until step 2, then falls: 0.6 − 0.025·|step − 2|."""

    def __call__(self, images, prompts, metadata=None):
        step = metadata[0]["step"] if isinstance(metadata, list) else metadata["step"]
        return {self.name: torch.full((images.shape[0],), 0.6 - 0.025 * abs(step - 2))}


def _run(tmp_path, *extra):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red seven\na blue two\n")
    return [
        "sampler.num_steps=2", "sampler.eval_num_steps=2", "trainer.steps=10", "trainer.prompts_per_step=2", "trainer.group_size=2",
        "eval.seeds_per_prompt=1", "eval.every=2", "trainer.checkpoint_every=0", "trainer.progress=false",
        "trainer.wandb=disabled", f"trainer.prompts={prompts}", f"trainer.output_dir={tmp_path / 'run'}", "reward.names=[test_rising_reward]",
        "reward.weights=[1.0]", "reward.judges=[test_peaking_judge]", "eval.select_by=test_peaking_judge", *extra,
    ]


def test_the_run_stops_at_the_signature_and_names_the_best_checkpoint(tmp_path, single_thread):
    summary = Trainer(compose(_run(tmp_path, "eval.stop_when_diverging=2"))).fit()
    run = tmp_path / "run"
    # evaluations at 0, 2, 4, 6: the reward rose 0 → 0.6 while the judge peaked at step 2 and fell twice
    assert summary["steps"] == 6 and summary["stopped_early"]["step"] == 6 and summary["stopped_early"]["best_step"] == 2
    assert summary["selected"] == {"step": 2, "value": pytest.approx(0.6), "metric": "eval/test_peaking_judge", "checkpoint": str(run / "checkpoints" / "step_000002")}
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000006"]  # the best, and the stop
    assert json.loads((run / "best.json").read_text())["step"] == 2
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    assert [e["step"] for e in evals] == [0, 2, 4, 6]


def test_a_healthy_run_selects_its_best_and_runs_to_the_end(tmp_path, single_thread):
    # a judge that only falls from step 2 on, selected as lower-is-better, is a judge that keeps improving: no stop
    summary = Trainer(compose(_run(tmp_path, "trainer.steps=6", "eval.stop_when_diverging=2", "eval.select_by=-test_peaking_judge"))).fit()
    assert "stopped_early" not in summary and summary["steps"] == 6
    assert summary["selected"]["step"] == 6 and summary["selected"]["value"] == pytest.approx(0.5)


def test_bad_selection_settings_are_one_line_errors():
    base = ["reward.judges=[digits_gold2]"]
    with pytest.raises(ConfigError, match=r"eval.stop_when_diverging=2 needs eval.select_by"):
        validate(compose([*base, "eval.stop_when_diverging=2"]))
    with pytest.raises(ConfigError, match=r"eval.select_by=nope names no evaluation metric: use a held-out judge \(digits_gold, digits_gold2\)"):
        validate(compose([*base, "eval.select_by=nope"]))
    with pytest.raises(ConfigError, match=r"which is the reward itself"):
        validate(compose([*base, "eval.select_by=digits", "eval.stop_when_diverging=2"]))
    assert validate(compose([*base, "eval.select_by=digits_gold2", "eval.stop_when_diverging=2"])).eval.select_by == "digits_gold2"
