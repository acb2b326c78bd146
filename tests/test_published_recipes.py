"""The published recipes (configs/experiment/ on real checkpoints): each composes and validates, states its values
against their sources, and runs two RL steps on the CPU shrunk by the one override set ``+shrink=tiny`` (the recipe's
own algorithm, sampler, prompt set and rewards; only sizes change)."""

from __future__ import annotations

import json
import re

import pytest

from diffrl.prompt_sets import is_prompt_set, load_prompt_set
from diffrl.recipes import CONFIG_DIR, compose, to_config, validate
from diffrl.tools.cli import main

pytestmark = pytest.mark.exact  # messages, files and configs: no floats from different code paths (conftest.py)

PUBLISHED = {
    # recipe: (algorithm Config class, model family, Hub model, optimizer steps per RL step)
    "sd35m_geneval_flow_grpo": ("PolicyGradientConfig", "sd3", "stabilityai/stable-diffusion-3.5-medium", 2),
    "sd35m_ocr_flow_grpo": ("PolicyGradientConfig", "sd3", "stabilityai/stable-diffusion-3.5-medium", 2),
    "sd35m_pickscore_flow_grpo": ("PolicyGradientConfig", "sd3", "stabilityai/stable-diffusion-3.5-medium", 2),
    "sd35m_pickscore_flow_grpo_fast": ("PolicyGradientConfig", "sd3", "stabilityai/stable-diffusion-3.5-medium", 2),
    "sd35m_multi_reward_nft": ("NFTConfig", "sd3", "stabilityai/stable-diffusion-3.5-medium", 1),
    "sd35m_geneval_awm": ("AWMConfig", "sd3", "stabilityai/stable-diffusion-3.5-medium", 1),
    "flux_hpsv2_dance_grpo": ("PolicyGradientConfig", "flux", "black-forest-labs/FLUX.1-dev", 3),
    "qwen_image_ocr_lora_flow_grpo": ("PolicyGradientConfig", "qwen_image", "Qwen/Qwen-Image", 2),
    "flux_kontext_counting_flow_grpo": ("PolicyGradientConfig", "flux_kontext", "black-forest-labs/FLUX.1-Kontext-dev", 2),
    "wan21_1_3b_ocr_flow_grpo": ("PolicyGradientConfig", "wan", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", 2),
}


NEEDS_RECORDS = {"flux_kontext_counting_flow_grpo"}  # trains on the user's records: refused without them (test_newcomer_path.py)


def test_every_published_recipe_composes_validates_and_keeps_global_sizes(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # online, validate resolves nothing (downloads happen at build)
    for name, (cls, family, repo, steps) in PUBLISHED.items():
        records = [f"trainer.prompts={CONFIG_DIR.parent / 'assets/tiny_records/counting_edit'}"] if name in NEEDS_RECORDS else []
        cfg = validate(compose([f"experiment={name}", "model.device=cpu", *records]))
        assert type(cfg.algorithm).__name__ == cls and cfg.model.family == family and cfg.model.path == repo, name
        batch = cfg.trainer.prompts_per_step * cfg.trainer.group_size
        assert batch // cfg.algorithm.mini_batch_size == steps and batch % cfg.algorithm.mini_batch_size == 0, name
        # the same recipe on 8 ranks: every mini-batch splits evenly (sizes are global, per-rank sizes derived)
        for ranks in (8, 32):
            if batch % ranks == 0:
                assert cfg.algorithm.mini_batch_size % ranks == 0 or cfg.algorithm.mini_batch_size < ranks, (name, ranks)


def test_published_recipe_headers_state_values_against_sources():
    for name in PUBLISHED:
        text = (CONFIG_DIR / "experiment" / f"{name}.yaml").read_text()
        header = [line for line in text.splitlines() if line.startswith("#")]
        rows = [line for line in header if re.match(r"^# [a-zA-Z].{28,}\S", line) and re.search(r"(L\d+|\.py|\.sh|our choice|yaml|README|arXiv|--)", line)]
        assert any("peer (source)" in line for line in header), name
        assert len(rows) >= 12, (name, len(rows))
        assert "our choice" in text or "-- ours" in text, name  # every departure from the peer is said


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_recipe_runs_two_steps_shrunk_to_tiny(name, tmp_path, single_thread):
    out = tmp_path / "run"
    extra = {"wan21_1_3b_ocr_flow_grpo": ["model.options.num_frames=5"]}.get(name, [])  # configs/shrink/tiny.yaml: frames are the family's
    assert main(["train", f"experiment={name}", "+shrink=tiny", f"trainer.output_dir={out}", "trainer.progress=false", *extra]) == 0
    config = (out / "config.yaml").read_text()
    cls, family, _, steps = PUBLISHED[name]
    recipe = to_config(compose([f"experiment={name}", *(["+shrink=tiny"] if name in NEEDS_RECORDS else [])]))
    assert f"family: {family}" in config and f"experiment: {name}" in config
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["kind"] == "train"]
    assert len(train) == 2
    for record in train:
        for reward in recipe.reward.names:
            value = record[f"reward/{reward}_mean"]
            assert value == value and abs(value) < 1e4, (reward, value)
        if getattr(recipe.algorithm, "adv_drop_zero_advantage", False):  # flow_grpo's drop: the rows that train depend on the rewards
            assert "dropped_samples" in record and record.get("optimizer_steps", 0.0) in (0.0, steps)
        else:
            assert record["rows_unused"] == 0.0
            assert record["optimizer_steps"] == steps  # the recipe's optimizer steps per RL step survive the shrink
    evals = [r for r in lines if r["kind"] == "eval"]
    assert len(evals) == 2 and all(f"eval/{recipe.reward.names[0]}" in r for r in evals)
    samples = [json.loads(line) for line in (out / "images" / "eval_step_000000.jsonl").read_text().splitlines()]
    assert len(samples) == 2
    if is_prompt_set(str(recipe.trainer.prompts)):  # evaluations sample the set's test split, training its train split
        assert [s["prompt"] for s in samples] == load_prompt_set(recipe.trainer.prompts, "test")[0][:2]


def test_diffrl_eval_reproduces_the_trainers_evaluation_on_a_prompt_sets_test_split(tmp_path, single_thread):
    """The trainer, `diffrl eval` and the analysis helpers evaluate the same prompts: a set's test split."""
    from diffrl.tools.analysis import eval_set

    out = tmp_path / "run"
    assert main(["train", "experiment=sd35m_geneval_flow_grpo", "+shrink=tiny", f"trainer.output_dir={out}", "trainer.progress=false"]) == 0
    final = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in line][-1]
    assert main(["eval", "--run", str(out), "--out", str(tmp_path / "eval")]) == 0
    record = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert record["metrics"]["eval/geneval"] == pytest.approx(final["eval/geneval"], abs=1e-6)
    assert [s["prompt"] for s in record["samples"]] == load_prompt_set("geneval", "test")[0][:2]
    prompts, _ = eval_set(out)
    assert prompts == load_prompt_set("geneval", "test")[0][:2]
