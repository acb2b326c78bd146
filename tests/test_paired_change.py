"""``diffrl.sampling.evaluation.paired_change``: per-sample changes between two evaluations on the same seeds."""

from __future__ import annotations

import math

import pytest
import torch

from diffrl.sampling.evaluation import group_means, paired_change


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


class _Grouped:
    """A metric whose groups are the prompts' first words (None for prompts starting with '?')."""

    def groups(self, prompts):
        return [None if p.startswith("?") else p.split()[0] for p in prompts]


def test_group_means_are_the_means_over_each_groups_samples():
    prompts = ["x a", "y a", "x b", "?", "y c", "x c"]
    scores = {"m": torch.tensor([1.0, 0.0, 0.0, 5.0, 1.0, 1.0]), "plain": torch.ones(6)}
    out = group_means(scores, prompts, {"m": _Grouped(), "plain": object()})
    assert out == {"eval/m/x": pytest.approx(2 / 3), "eval/m/y": pytest.approx(0.5)}  # '?' counts in the overall mean only; 'plain' has no groups
    assert list(out) == ["eval/m/x", "eval/m/y"]  # first-seen order


def test_groups_of_the_wrong_length_are_refused():
    class Short:
        def groups(self, prompts):
            return ["x"]

    with pytest.raises(ValueError, match="returned 1 groups for 2 prompts"):
        group_means({"m": torch.zeros(2)}, ["a", "b"], {"m": Short()})
