"""Whole runs through the CLI: reproducible metrics, and the default recipe retracing its published run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from diffrl.logging import read_jsonl
from diffrl.tools.cli import main

pytestmark = pytest.mark.exact  # runs of one code path compared bit for bit (same seed, same kernels): not a numerics test (conftest.py)

SHORT = ["trainer.steps=3", "trainer.prompts_per_step=2", "trainer.group_size=4", "eval.seeds_per_prompt=1", "eval.num_prompts=8",
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


PINNED = Path(__file__).parent / "data" / "default_recipe_published.json"
FOLLOW_STEPS = 10
# the continuous numbers of a step; the pin (AMD, AVX2) and a run on an Intel CPU under its AVX-512 kernels agree over
# the 10 steps to ≤ 3.3e-6 relative (2026-12-07): 1e-4 leaves room and still fails on any change of the update.
# policy_loss is not among them: it is a group mean of -advantage x ratio whose advantages sum to zero, ~1e-5 left of
# terms of size |A| ~ 0.8, so kernels that sum in another order move it by up to 4.7e-8 x |A| (5e-3 of itself); it is
# compared at 1e-6 x advantage_abs_mean, ~10 % of its value, 20x the difference measured
FOLLOWED = ("reward_mean", "reward_std", "advantage_abs_mean", "grad_norm", "ratio_mean", "kl", "lr")


@pytest.mark.slow(seconds=44)
def test_default_recipe_follows_its_published_run(tmp_path):
    """README command 1 (`diffrl train`, the default recipe) on a shorter schedule: its first 10 steps retrace the
    published 80-step run step for step (pinned by `benchmarks/learning/pin_default_recipe.py`), whose headline is a
    fidelity gain (README's number), not raw gold, which a run that hacks the reward raises too: ≥ +30 points with
    realness and Fréchet distance no worse than the base's at the last evaluation (issue 53). The recipe's schedule
    is constant, so stopping at step 10 changes no update."""
    pinned = json.loads(PINNED.read_text())
    fidelity = pinned["summary"]["fidelity"]
    assert pinned["summary"]["steps"] == 80 and fidelity["gain"] is not None and fidelity["last_gain"] >= 0.30, fidelity
    evals = [r for r in pinned["records"] if r["kind"] == "eval"]
    assert evals[-1]["eval/digits_real"] >= evals[0]["eval/digits_real"] and evals[-1]["eval/frechet"] <= evals[0]["eval/frechet"], evals
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert f"the default Flow-GRPO +{100 * fidelity['last_gain']:.1f}" in readme  # README publishes this file's gain

    out = tmp_path / "default"
    assert main(["train", f"trainer.output_dir={out}", "trainer.progress=false", f"trainer.steps={FOLLOW_STEPS}",
                 f"eval.every={FOLLOW_STEPS}", f"trainer.checkpoint_every={FOLLOW_STEPS}"]) == 0
    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    published = [r for r in pinned["records"] if r["kind"] == "train"][:FOLLOW_STEPS]
    assert [r["step"] for r in train] == [r["step"] for r in published] == list(range(1, FOLLOW_STEPS + 1))
    for got, want in zip(train, published):
        for key in FOLLOWED:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-12), (got["step"], key)
        assert got["policy_loss"] == pytest.approx(want["policy_loss"], rel=0, abs=1e-6 * want["advantage_abs_mean"]), got["step"]
        assert got["first_ratio_mean"] == pytest.approx(1.0, abs=1e-12)  # on-policy at every step
    before = next(r for r in records if r["kind"] == "eval" and r["step"] == 0)
    base = next(r for r in pinned["records"] if r["kind"] == "eval" and r["step"] == 0)
    for key in ("eval/digits", "eval/digits_gold", "eval/digits_fidelity", "eval/digits_real", "eval/diversity_feature"):
        assert before[key] == pytest.approx(base[key], rel=1e-4), key
    # the run moved: its evaluation at step 10 is not the base's
    after = next(r for r in records if r["kind"] == "eval" and r["step"] == FOLLOW_STEPS)
    assert after["eval/digits"] != before["eval/digits"]
