"""The shipped digits miniature: both classifiers ≥ 95 % on held-out real digits; base gold in [20 %, 60 %]; the base draws
real digits (the realness check) and leaves the colours to learn."""

from __future__ import annotations

import json

import torch

from diffrl.sampling.evaluation import eval_prompts_and_seeds
from diffrl.sampling.evaluator import evaluate
from pipelines.digits import ASSET_DIR, DigitsAdapter
from rewards.base import build_reward
from rewards.digits.classifiers import DigitsClassifier
from rewards.digits.data import COLOUR_NAMES, colourise, load_digit_intensities, make_prompt, parse_prompt, split_indices


def _held_out_accuracy(folder: str, split_seed: int) -> tuple[float, float]:
    model = DigitsClassifier.from_pretrained(ASSET_DIR / folder)
    intens, labels = load_digit_intensities()
    _, held = split_indices(len(labels), split_seed)
    colour = torch.arange(len(held)) % len(COLOUR_NAMES)
    with torch.no_grad():
        d, c = model(colourise(intens[held], colour))
    return (d.argmax(-1) == labels[held]).float().mean().item(), (c.argmax(-1) == colour).float().mean().item()


def test_shipped_files_are_small_and_complete():
    files = [p for p in ASSET_DIR.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < 10 * 2**20
    for part in ("transformer/config.json", "transformer/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors",
                 "reward_classifier/model.safetensors", "gold_classifier/model.safetensors", "metadata.json"):
        assert (ASSET_DIR / part).is_file(), part


def test_classifiers_accurate_on_held_out_real_digits():
    meta = json.loads((ASSET_DIR / "metadata.json").read_text())
    reward_digit, reward_colour = _held_out_accuracy("reward_classifier", meta["reward_classifier"]["split_seed"])
    gold_digit, gold_colour = _held_out_accuracy("gold_classifier", meta["gold_classifier"]["split_seed"])
    assert reward_digit >= 0.95 and gold_digit >= 0.95, (reward_digit, gold_digit)
    assert reward_colour >= 0.99 and gold_colour >= 0.99
    # the gold judge is independent: other architecture, seed and split
    assert meta["reward_classifier"]["architecture"] != meta["gold_classifier"]["architecture"]
    assert meta["reward_classifier"]["split_seed"] != meta["gold_classifier"]["split_seed"]


def test_base_generator_leaves_room_to_learn_and_draws_real_digits():
    """The trainer's evaluation (every prompt × 4 held-out seeds, eval.seed=1234, 10 ODE steps) reproduces the
    metadata's gold, realness and fidelity gold (issue 39); most samples lie within reach of a real digit (the base
    shipped before 2026-12-05: 0 %, RESULTS.md) while gold leaves room to learn."""
    adapter = DigitsAdapter(path=str(ASSET_DIR))
    prompts, seeds = eval_prompts_and_seeds(adapter.default_prompts(), 4, 1234)
    names = ("digits_gold", "digits_real", "digits_fidelity")
    metrics, _ = evaluate(adapter, prompts, seeds=seeds, num_steps=10, guidance_scale=1.0, metrics={n: build_reward(n) for n in names})
    acc = metrics["eval/digits_gold"]
    assert 0.20 <= acc <= 0.60, acc
    meta = json.loads((ASSET_DIR / "metadata.json").read_text())
    assert abs(acc - meta["base_gold_accuracy_by_guidance"]["1.0"]) < 1e-6  # the shipped number reproduces
    shipped = meta["base_scores_by_guidance"]["1.0"]
    for name, key in zip(names, ("gold_accuracy", "realness", "fidelity_gold")):
        assert abs(metrics[f"eval/{name}"] - shipped[key]) < 1e-6, (name, metrics[f"eval/{name}"], shipped[key])
    assert metrics["eval/digits_real"] >= 0.55 and metrics["eval/digits_gold"] <= 0.5, metrics
    assert metrics["eval/digits_fidelity"] <= min(metrics["eval/digits_gold"], metrics["eval/digits_real"]) + 1e-9


def test_prompts_round_trip():
    for d in range(10):
        for c in range(len(COLOUR_NAMES)):
            assert parse_prompt(make_prompt(d, c)) == (d, c)
    assert make_prompt(7, 0) == "a red seven"
