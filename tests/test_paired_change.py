"""``diffrl.sampling.evaluation.paired_change``: per-sample changes between two evaluations on the same seeds."""

from __future__ import annotations

import math

import pytest

from diffrl.sampling.evaluation import paired_change


def rows(values, prompts=("a", "a", "b", "b"), seeds=(1, 2, 1, 2)):
    return [{"prompt": p, "seed": s, "r": v, "gold": float(v > 0)} for p, s, v in zip(prompts, seeds, values)]


def test_hand_computed_paired_statistics():
    before = rows([0.0, 1.0, 2.0, 3.0])
    after = rows([0.5, 1.0, 3.0, 2.0])  # changes +0.5, 0, +1, −1
    out = paired_change(before, after, ["r", "gold", "absent"])
    d = [0.5, 0.0, 1.0, -1.0]
    mean = sum(d) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in d) / 3)
    assert out["r"]["mean_change"] == pytest.approx(0.125)
    assert out["r"]["stderr"] == pytest.approx(std / 2)
    assert out["r"]["t"] == pytest.approx(0.125 / (std / 2))
    assert (out["r"]["improved_fraction"], out["r"]["worsened_fraction"], out["r"]["n"]) == (0.5, 0.25, 4)
    assert out["gold"]["mean_change"] == pytest.approx(0.25)  # sample 0 went 0 → 1 (0.0 > 0 is False, 0.5 > 0 True)
    assert "absent" not in out


def test_pairs_follow_prompt_and_seed_not_row_order():
    before = rows([0.0, 1.0, 2.0, 3.0])
    after = list(reversed(rows([1.0, 2.0, 3.0, 4.0])))  # every sample +1, rows listed in another order
    out = paired_change(before, after, ["r"])
    assert out["r"]["mean_change"] == pytest.approx(1.0) and out["r"]["improved_fraction"] == 1.0


def test_different_seed_sets_are_refused():
    with pytest.raises(ValueError, match="different \\(prompt, seed\\) pairs"):
        paired_change(rows([0, 1, 2, 3]), rows([0, 1, 2, 3], seeds=(1, 2, 1, 3)), ["r"])
