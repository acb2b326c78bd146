"""The digits editing miniature: shipped assets and their recorded numbers, the instruction grammar, the reward
and the gold judge on constructed edits (closed forms), log-prob parity of the family, and both recipes
through the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_engine

from diffrl.config import SamplerConfig
from diffrl.sampling.evaluation import eval_prompts_and_seeds
from diffrl.sampling.evaluator import evaluate
from diffrl.sampling.rollout import sample_trajectories
from pipelines import build_adapter
from pipelines.base import split_prompts
from pipelines.digits_edit import EDIT_ASSET_DIR, DigitsEditAdapter
from rewards.base import build_reward, call_reward
from rewards.digits.data import ASSET_DIR, COLOUR_NAMES, load_digit_intensities, split_indices
from rewards.digits.edit import (
    PRETRAIN_SPLIT_SEED,
    EditJudge,
    EditTarget,
    parse_instruction,
    recolour_instruction,
    redraw_instruction,
)
from rewards.digits.judge2 import render
from tests.conftest import randomise_lora

pytestmark = pytest.mark.usefixtures("single_thread")
GOLD = ("digits_edit_gold", "digits_edit_gold_preservation", "digits_edit_gold_joint")


# -- assets --------------------------------------------------------------------------------------------
def test_shipped_files_are_small_and_the_judge_is_independent():
    files = [p for p in EDIT_ASSET_DIR.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 5 * 2**20
    for part in ("transformer/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors", "judge/model.safetensors", "metadata.json", "pretrain_log.txt"):
        assert (EDIT_ASSET_DIR / part).is_file(), part
    judge_meta = json.loads((EDIT_ASSET_DIR / "judge" / "metadata.json").read_text())
    reward_meta = json.loads((ASSET_DIR / "metadata.json").read_text())["reward_classifier"]
    # other seed, split and architecture than the reward's classifier; accurate on its own held-out digits
    assert (judge_meta["seed"], judge_meta["split_seed"]) != (reward_meta["seed"], reward_meta["split_seed"])
    assert judge_meta["split_seed"] != reward_meta["split_seed"] and reward_meta["architecture"] == "cnn"
    assert judge_meta["held_out"]["digit_accuracy"] >= 0.97 and judge_meta["held_out"]["colour_accuracy"] == 1.0
    assert isinstance(build_reward("digits_edit_gold").model, EditJudge)


def test_base_editor_numbers_reproduce_and_leave_room():
    adapter = DigitsEditAdapter(path=str(EDIT_ASSET_DIR))
    prompts, seeds = eval_prompts_and_seeds(adapter.default_prompts(), 4, 1234)  # the trainer's evaluation
    metrics = {name: build_reward(name) for name in ("digits_edit", *GOLD)}
    scores, _ = evaluate(adapter, prompts, seeds=seeds, num_steps=10, guidance_scale=1.0, metrics=metrics)
    base = json.loads((EDIT_ASSET_DIR / "metadata.json").read_text())["base"]
    for name in ("digits_edit", *GOLD):
        assert abs(scores[f"eval/{name}"] - base[name]) < 1e-6, name
    assert 0.30 <= scores["eval/digits_edit_gold"] <= 0.65  # under-trained: RL has room
    assert scores["eval/digits_edit_gold_preservation"] >= 0.9


# -- instructions and records --------------------------------------------------------------------------
def test_instructions_round_trip_and_bad_ones_are_named():
    for c in range(len(COLOUR_NAMES)):
        assert parse_instruction(recolour_instruction(c)) == EditTarget("recolour", c)
    for s in range(10):
        for t in range(10):
            assert parse_instruction(redraw_instruction(s, t)) == EditTarget("redraw", t, s)
    assert redraw_instruction(3, 8) == "turn the three into an eight" and recolour_instruction(2) == "make it blue"
    for bad in ("make it purple", "turn the three into a eight", "a red seven"):
        with pytest.raises(ValueError, match="neither"):
            parse_instruction(bad)


def test_default_prompts_are_held_out_sources_one_recolour_two_redraws():
    records = DigitsEditAdapter(path=None).default_prompts()
    assert len(records) == 60 and len({r.name for r in records}) == 20
    kinds = [parse_instruction(r.instruction).kind for r in records]
    assert kinds.count("recolour") == 20 and kinds.count("redraw") == 40
    held = set(split_indices(1797, PRETRAIN_SPLIT_SEED)[1].tolist())
    assert all(int(r.name.split("-")[0][len("digit"):]) in held for r in records)
    _, sources = split_prompts(records)
    assert sources.dtype == torch.uint8 and sources.shape == (60, 3, 16, 16)
    _, labels = load_digit_intensities()
    for i in range(0, 60, 3):  # per source: a recolour, then two redraws that name its true digit and ask for two others
        source_digit = int(labels[int(records[i].name.split("-")[0][len("digit"):])])
        first, second = (parse_instruction(r.instruction) for r in records[i + 1 : i + 3])
        assert first.source_digit == second.source_digit == source_digit and len({source_digit, first.target, second.target}) == 3


# -- reward and gold judge on constructed edits -----------------------------------------------------------
def _cases(n: int = 30):
    """Real held-out digits as sources, each with a perfect recolour and a perfect redraw, and broken edits."""
    intensity, labels = load_digit_intensities()
    held = split_indices(len(labels), PRETRAIN_SPLIT_SEED)[1]
    g = torch.Generator().manual_seed(0)
    idx = held[torch.randperm(len(held), generator=g)[:n]]
    colour = torch.randint(0, 6, (n,), generator=g)
    new_colour = (colour + 1 + torch.randint(0, 5, (n,), generator=g)) % 6
    digit = labels[idx]
    new_digit = (digit + 1 + torch.randint(0, 9, (n,), generator=g)) % 10
    other = torch.stack([held[labels[held] == d][i % 5] for i, d in enumerate(new_digit.tolist())])  # a real digit of the new class
    source = render(intensity[idx], colour)
    return {
        "source": source,
        "recolour": [recolour_instruction(int(c)) for c in new_colour],
        "redraw": [redraw_instruction(int(d), int(t)) for d, t in zip(digit, new_digit)],
        "recoloured": render(intensity[idx], new_colour),  # perfect recolour
        "redrawn": render(intensity[other], colour),  # perfect redraw
        "redrawn_wrong_colour": render(intensity[other], new_colour),  # right digit, colour not kept
        "recoloured_other_digit": render(intensity[other], new_colour),  # right colour, digit not kept
    }


def _gold(images, prompts, sources):
    return call_reward("digits_edit_gold", build_reward("digits_edit_gold"), images, prompts, None, sources)


def test_gold_judge_closed_forms():
    c = _cases()
    ones, zeros = torch.ones(30), torch.zeros(30)
    expected = [  # (edits, instructions, success, preservation)
        (c["recoloured"], c["recolour"], ones, ones),
        (c["redrawn"], c["redraw"], ones, ones),
        (c["source"], c["redraw"], zeros, ones),  # an unchanged source fails a redraw and keeps everything
        (c["source"], c["recolour"], zeros, ones),
        (c["redrawn_wrong_colour"], c["redraw"], ones, zeros),  # a wrong colour loses preservation
        (c["recoloured_other_digit"], c["recolour"], ones, zeros),
    ]
    for images, prompts, success, preservation in expected:
        out = _gold(images, prompts, c["source"])
        assert torch.equal(out["digits_edit_gold"], success) and torch.equal(out["digits_edit_gold_preservation"], preservation)
        assert torch.equal(out["digits_edit_gold_joint"], success * preservation)
    # every gold name reports its own metric as the main output
    for name in GOLD:
        out = call_reward(name, build_reward(name), c["redrawn_wrong_colour"], c["redraw"], None, c["source"])
        assert torch.equal(out[name], {"digits_edit_gold": ones, "digits_edit_gold_preservation": zeros, "digits_edit_gold_joint": zeros}[name])


def test_training_reward_closed_forms_and_source_is_required():
    c = _cases()
    reward = build_reward("digits_edit")

    def run(images, prompts):
        out = call_reward("digits_edit", reward, images, prompts, None, c["source"])
        torch.testing.assert_close(out["digits_edit"], out["digits_edit_success"] * out["digits_edit_preservation"], rtol=0, atol=0)
        return out["digits_edit_success"], out["digits_edit_preservation"]

    for images, prompts in ((c["recoloured"], c["recolour"]), (c["redrawn"], c["redraw"])):
        s, p = run(images, prompts)
        assert (s > 0.5).sum() >= 29 and (p > 0.5).sum() >= 29 and s.mean() > 0.95 and p.mean() > 0.95  # perfect edits score ≈ 1 (the classifier is 99 % accurate)
    s, p = run(c["source"], c["redraw"])  # unchanged source on a redraw
    assert (s < 0.5).all() and s.mean() < 0.05 and p.mean() > 0.95
    s, p = run(c["redrawn_wrong_colour"], c["redraw"])
    assert s.mean() > 0.95 and p.max() < 0.05
    s, p = run(c["recoloured_other_digit"], c["recolour"])
    assert s.mean() > 0.95 and p.max() < 0.1
    with pytest.raises(ValueError, match="source_images"):
        reward(c["source"], c["redraw"], None)
    with pytest.raises(ValueError, match="neither"):
        reward(c["source"][:1], ["make it purple"], None, source_images=c["source"][:1])


# -- the family ---------------------------------------------------------------------------------------------
def test_rollout_training_parity_and_the_source_conditions():
    adapter = build_adapter("digits_edit", path=None, seed=0)
    s = SamplerConfig(num_steps=3, kind="flow_sde", noise_level=0.7, height=16, width=16, guidance_scale=3.0)
    engine = make_engine(adapter, s, lora_rank=4)
    engine.initialize()
    randomise_lora(engine.module, scale=0.02)
    records = adapter.default_prompts()
    prompts, sources = split_prompts([records[0], records[0], records[1], records[2]])
    td = sample_trajectories(adapter, prompts, settings=s, seeds=[5, 6, 7, 7], source_images=sources)
    assert td["sde_mask"].all() and torch.isfinite(td["log_probs"]).all()
    assert torch.equal(td["cond"]["negative_source_latents"], td["cond"]["source_latents"])  # uncond = empty text, same source
    # training recomputes the recorded log-probs exactly from the stored cond (same module, same batch composition)
    assert torch.equal(engine.infer_batch(td)["log_probs"], td["log_probs"])
    alone = sample_trajectories(adapter, prompts[2:3], settings=s, seeds=[7], source_images=sources[2:3])
    torch.testing.assert_close(alone["latents"][0], td["latents"][2], rtol=1e-4, atol=1e-4)
    # same seed, same kind of instruction ("make it …"), another source: another sample — the source is read
    assert not torch.allclose(td["latents"][2, -1], td["latents"][3, -1], atol=1e-3)
    with pytest.raises(ValueError, match="source image"):
        adapter.encode(prompts[:1])


# -- the recipes ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", ["digits_edit_flow_grpo", "digits_edit_nft"])
def test_recipe_trains_two_steps_and_evaluates_like_evaluate(recipe, tmp_path):
    from diffrl.tools.cli import main

    out = tmp_path / "run"
    rc = main([
        "train", f"experiment={recipe}", "trainer.steps=2", f"trainer.output_dir={out}", "trainer.wandb=disabled",
        "trainer.progress=false", "trainer.prompts_per_step=2", "trainer.group_size=2", "sampler.num_steps=2",
        "sampler.eval_num_steps=2", "eval.every=2", "eval.seeds_per_prompt=1", "trainer.checkpoint_every=0",
    ])
    assert rc in (0, None)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert all(0.0 <= r["reward/digits_edit_mean"] <= 1.0 for r in train)
    summary = json.loads((out / "summary.json").read_text())
    # the trainer's step-0 evaluation is evaluate() of the shipped base on the same held-out pairs
    adapter = DigitsEditAdapter(path=str(EDIT_ASSET_DIR))
    prompts, seeds = eval_prompts_and_seeds(adapter.default_prompts(), 1, 1234)
    metrics = {name: build_reward(name) for name in ("digits_edit", "digits_edit_gold", "digits_edit_gold_preservation")}
    expected, _ = evaluate(adapter, prompts, seeds=seeds, num_steps=2, guidance_scale=1.0, metrics=metrics)
    for key, value in expected.items():
        assert summary["eval_before"][key] == pytest.approx(value, abs=1e-6), key
    assert summary["gold_accuracy_before"] == pytest.approx(expected["eval/digits_edit_gold"], abs=1e-6)
