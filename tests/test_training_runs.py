"""Whole runs through the CLI: reproducible metrics, and the default recipe raising gold accuracy."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from diffrl.logging import read_jsonl
from diffrl.tools.cli import main

pytestmark = pytest.mark.exact  # runs of one code path compared bit for bit (same seed, same kernels): not a numerics test (conftest.py)

SHORT = ["trainer.steps=3", "trainer.prompts_per_step=2", "trainer.group_size=4", "eval.seeds_per_prompt=1",
         "eval.every=2", "trainer.progress=false", "algorithm.mini_batch_size=4", "sampler.num_steps=4",
         "sampler.eval_num_steps=4", "algorithm.kl_beta=0.01"]


def _numbers(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/")) and "seconds" not in k} for r in records]


def test_same_seed_gives_identical_metrics(tmp_path):
    runs = []
    for name in ("a", "b"):
        assert main(["train", f"trainer.output_dir={tmp_path / name}", *SHORT]) == 0
        runs.append(tmp_path / name)
    a, b = (_numbers(read_jsonl(r / "metrics.jsonl")) for r in runs)
    assert len(a) == 3 + 3  # 3 train steps + evaluations before, at step 2 and at the end
    assert a == b
    assert any(r.get("kl", 0) > 0 for r in a)  # the KL term to the reference was active
    wa = load_file(str(runs[0] / "checkpoints" / "step_000003" / "model.safetensors"))
    wb = load_file(str(runs[1] / "checkpoints" / "step_000003" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all((wa[k] == wb[k]).all() for k in wa)
    # another seed gives another run
    assert main(["train", f"trainer.output_dir={tmp_path / 'c'}", "trainer.seed=1", *SHORT]) == 0
    assert _numbers(read_jsonl(tmp_path / "c" / "metrics.jsonl")) != a
    summary = json.loads((runs[0] / "summary.json").read_text())
    for key in ("gold_accuracy_before", "gold_accuracy_after", "reward_before", "reward_after", "wall_seconds", "steps"):
        assert key in summary
    assert summary["steps"] == 3
    assert (runs[0] / "images" / "eval_step_000000.png").is_file() and (runs[0] / "images" / "eval_step_000003.png").is_file()


@pytest.mark.recipe
def test_default_recipe_raises_gold_accuracy(tmp_path):
    """`diffrl train` with no arguments but the output folder (README's command 1): the fidelity headline up by ≥ 15 points
    (published: +20.4) with the diversity kept, not raw gold, which a run that hacks the reward raises too."""
    assert main(["train", f"trainer.output_dir={tmp_path / 'default'}", "trainer.progress=false"]) == 0
    summary = json.loads((tmp_path / "default" / "summary.json").read_text())
    print(json.dumps(summary, indent=2))
    assert summary["fidelity"]["gain"] is not None and summary["fidelity"]["gain"] >= 0.15, summary["fidelity"]
    assert summary["reward_after"] > summary["reward_before"]
    train = [r for r in read_jsonl(tmp_path / "default" / "metrics.jsonl") if r["kind"] == "train"]
    assert all(r["first_ratio_mean"] == pytest.approx(1.0, abs=1e-12) for r in train)  # on-policy at every step
