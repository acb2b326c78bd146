"""Distribution metrics (diversity, near-duplicates, Fréchet distance, judge disagreement) against closed
forms and constructed sets; the second digits judge's split and held-out accuracy."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.linalg
import torch

from diffrl.sampling.distribution import (
    NEAR_DUPLICATE_RMS,
    FeatureSpace,
    build_feature_space,
    distribution_metrics,
    frechet_between,
    frechet_distance,
    gaussian_fit,
    judge_disagreement,
    mixture_fit,
    pairwise_distances,
    per_prompt_metrics,
    relative_to_base,
)
from rewards.base import build_reward
from rewards.digits.data import (
    COLOUR_NAMES,
    load_digit_intensities,
    make_prompt,
    split_indices,
)
from rewards.digits.judge2 import (
    JUDGE2_DIR,
    judge2_split,
    read_colour,
    render,
    shipped_split_seeds,
)

HELD_OUT_ACCURACY_BOUND = 0.86  # measured 0.875 (assets/digits/judge2/metadata.json); the gold judge: 0.98


def random_cov(d: int, seed: int) -> torch.Tensor:
    a = torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return a @ a.T + 0.1 * torch.eye(d, dtype=torch.float64)


# -- Fréchet distance -------------------------------------------------------------------------------
def test_frechet_closed_forms():
    # 1-D: (μ1 − μ2)² + (σ1 − σ2)²
    one = lambda v: torch.tensor([[v]], dtype=torch.float64)
    assert frechet_distance(torch.tensor([1.0]), one(4.0), torch.tensor([-2.0]), one(9.0)) == pytest.approx(9.0 + 1.0, abs=1e-12)
    # commuting (diagonal) covariances: ‖μ1 − μ2‖² + Σ (√a − √b)²
    a, b = torch.tensor([1.0, 4.0, 0.25], dtype=torch.float64), torch.tensor([9.0, 1.0, 0.0], dtype=torch.float64)
    mu1, mu2 = torch.tensor([0.0, 1.0, 2.0]), torch.tensor([1.0, 1.0, 0.0])
    expected = 1.0 + 4.0 + ((a.sqrt() - b.sqrt()) ** 2).sum().item()  # the second covariance is singular
    assert frechet_distance(mu1, torch.diag(a), mu2, torch.diag(b)) == pytest.approx(expected, abs=1e-10)
    # full, non-commuting covariances: Tr(Σ1 + Σ2 − 2 sqrtm(Σ1 Σ2)) with scipy's general matrix square root
    c1, c2 = random_cov(6, 1), random_cov(6, 2)
    m1, m2 = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    cross = scipy.linalg.sqrtm(c1.numpy() @ c2.numpy())
    reference = float(((m1 - m2) ** 2).sum() + np.trace(c1.numpy() + c2.numpy() - 2 * cross.real))
    assert frechet_distance(m1, c1, m2, c2) == pytest.approx(reference, rel=1e-9)
    assert frechet_distance(m2, c2, m1, c1) == pytest.approx(reference, rel=1e-9)  # symmetric
    assert frechet_distance(m1, c1, m1, c1) == pytest.approx(0.0, abs=1e-9)


def test_frechet_from_samples_converges_to_the_gaussians_distance():
    g = torch.Generator().manual_seed(0)
    c1, c2 = random_cov(4, 3), random_cov(4, 4)
    m1, m2 = torch.zeros(4, dtype=torch.float64), torch.full((4,), 0.5, dtype=torch.float64)
    draw = lambda m, c, n: m + torch.randn(n, 4, generator=g, dtype=torch.float64) @ torch.linalg.cholesky(c).T
    exact = frechet_distance(m1, c1, m2, c2)
    estimate = frechet_between(draw(m1, c1, 200_000), draw(m2, c2, 200_000))
    assert estimate == pytest.approx(exact, rel=0.02)
    mu, cov = gaussian_fit(draw(m1, c1, 200_000))
    assert torch.allclose(mu, m1, atol=0.02)
    assert torch.allclose(cov, c1, atol=0.1 * c1.abs().max())


def test_mixture_fit_is_the_pooled_moments():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(50, 3, generator=g, dtype=torch.float64), 3 + torch.randn(30, 3, generator=g, dtype=torch.float64)
    mu, cov = mixture_fit([(a, 50), (b, 30)])
    both = torch.cat([a, b])
    assert torch.allclose(mu, both.mean(0))
    # Σ w_k (C_k + (m_k − μ)(m_k − μ)ᵀ) with unbiased C_k = the pooled biased covariance + Σ w_k C_k / n_k
    pooled = (both - mu).T @ (both - mu) / 80
    expected = pooled + sum(n / 80 * gaussian_fit(x)[1] / n for x, n in ((a, 50), (b, 30)))
    assert torch.allclose(cov, expected)


# -- diversity and near-duplicates ---------------------------------------------------------------------
def flat_images(values: list[float]) -> torch.Tensor:
    """Float images [n, 3, 4, 4] whose every pixel is ``values[k]``: pair RMS distance = |values[k] − values[l]|."""
    return torch.tensor(values, dtype=torch.float64).view(-1, 1, 1, 1).expand(-1, 3, 4, 4).clone()


def test_diversity_of_identical_and_of_constructed_sets():
    same = torch.randint(0, 256, (1, 3, 16, 16), dtype=torch.uint8).expand(4, -1, -1, -1)
    spaced = torch.tensor([0, 51, 102, 153], dtype=torch.uint8).view(4, 1, 1, 1).expand(4, 3, 16, 16)  # steps of 0.2
    images = torch.cat([same, spaced])
    prompts = ["a"] * 4 + ["b"] * 4
    rows = {r["prompt"]: r for r in per_prompt_metrics(images, prompts)}
    assert rows["a"]["diversity_pixel"] == 0.0 and rows["a"]["near_duplicate_frac"] == 1.0
    # pairs differ by 1, 2, 3, 1, 2, 1 steps of 0.2: mean 10/6 · 0.2
    assert rows["b"]["diversity_pixel"] == pytest.approx(0.2 * 10 / 6, abs=1e-12)
    assert rows["b"]["near_duplicate_frac"] == 0.0
    metrics = distribution_metrics(images, prompts)
    assert metrics == pytest.approx({"eval/diversity_pixel": 0.1 * 10 / 6, "eval/near_duplicate_frac": 0.5})
    # the order of the samples does not matter, only their prompts
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    assert distribution_metrics(images[perm], [prompts[i] for i in perm]) == pytest.approx(metrics)


def test_near_duplicate_threshold():
    t = NEAR_DUPLICATE_RMS
    # pairwise RMS distances 0.9 t (a, b), 1.8 t (a, c), 0.9 t (b, c): two of the three pairs are near-duplicates
    (row,) = per_prompt_metrics(flat_images([0.1, 0.1 + 0.9 * t, 0.1 + 1.8 * t]), ["p"] * 3)
    assert row["near_duplicate_frac"] == pytest.approx(2 / 3)
    assert row["diversity_pixel"] == pytest.approx(3.6 * t / 3)
    (row,) = per_prompt_metrics(flat_images([0.1, 0.1 + 1.1 * t]), ["p"] * 2)
    assert row["near_duplicate_frac"] == 0.0


def test_one_seed_per_prompt_gives_no_metrics():
    assert distribution_metrics(torch.zeros(3, 3, 8, 8, dtype=torch.uint8), ["a", "b", "c"]) == {}
    assert pairwise_distances(torch.zeros(1, 5)).numel() == 0


class TableFeatures:
    """A feature space whose features are the images' first pixel values and a fixed real set."""

    def __init__(self, real: torch.Tensor):
        self.real = real

    def features(self, images):
        return images.flatten(1)[:, :2].double()

    def reference_features(self, prompt):
        return self.real


def test_feature_metrics_with_a_known_feature_space():
    real = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0], [2.0, 2.0]], dtype=torch.float64)  # mean (1, 1), cov (4/3) I
    feats = torch.tensor([[1.0, 1.0], [4.0, 5.0], [1.0, 1.0]], dtype=torch.float64)
    images = torch.zeros(3, 2, 1, 1, dtype=torch.float64)
    images[:, :, 0, 0] = feats
    space = TableFeatures(real)
    assert isinstance(space, FeatureSpace)
    (row,) = per_prompt_metrics(images, ["p"] * 3, space)
    assert row["diversity_feature"] == pytest.approx((5.0 + 0.0 + 5.0) / 3)
    assert row["frechet"] == pytest.approx(frechet_distance(*gaussian_fit(feats), *gaussian_fit(real)))
    metrics = distribution_metrics(images, ["p"] * 3, space)
    assert metrics["eval/frechet_pooled"] == pytest.approx(row["frechet"])  # one prompt: pooled = per prompt
    assert relative_to_base({"eval/diversity_pixel": 0.2, "eval/diversity_feature": 4.0}, {"eval/diversity_pixel": 0.1, "eval/diversity_feature": 5.0}) == {
        "diversity_pixel_vs_base": 0.5, "diversity_feature_vs_base": 1.25}


def test_a_reward_without_features_is_no_feature_space():
    with pytest.raises(TypeError, match="digits_gold.*no feature space"):
        build_feature_space("digits_gold")
    assert isinstance(build_feature_space("digits_gold2"), FeatureSpace)


# -- judges ------------------------------------------------------------------------------------------------
def rows(gold: list[float], judge: list[float]) -> list[dict]:
    return [{"prompt": f"p{i // 2}", "seed": i % 2, "g": a, "j": b} for i, (a, b) in enumerate(zip(gold, judge))]


def test_judge_disagreement_is_paired_over_seeds():
    n = 40
    before = rows([0.0] * n, [0.0] * n)
    # gold rises on every sample, the second judge on none: a disagreement far beyond the noise
    out = judge_disagreement(before, rows([1.0] * n, [0.0] * (n - 1) + [1.0]), "g", "j")
    assert out["disagree"] and out["gold_change"] == 1.0 and out["judge_change"] == pytest.approx(1 / n)
    assert out["difference"] == pytest.approx(1 - 1 / n) and out["agreement_before"] == 1.0 and out["agreement_after"] == pytest.approx(1 / n)
    # both judges rise on the same 10 samples, plus one sample each on different seeds: no disagreement
    up = [1.0] * 10 + [0.0] * (n - 10)
    after = rows([*up[:-1], 1.0], [*up[:-2], 1.0, 0.0])
    out = judge_disagreement(before, after, "g", "j")
    assert not out["disagree"] and out["difference"] == 0.0 and out["stderr"] == pytest.approx((2 / (n - 1)) ** 0.5 / n**0.5)


# -- the second digits judge ----------------------------------------------------------------------------
def test_judge2_split_is_disjoint_from_both_classifiers_training_data():
    n = 1797
    train, held = judge2_split(n)
    seeds = shipped_split_seeds()
    assert seeds == {"reward_classifier": 11, "gold_classifier": 22}
    train_set = set(train.tolist())
    for seed in seeds.values():
        assert not train_set & set(split_indices(n, seed)[0].tolist())
    assert len(train_set) == 73 and len(train_set | set(held.tolist())) == n and not train_set & set(held.tolist())
    meta = json.loads((JUDGE2_DIR / "metadata.json").read_text())  # the shipped weights were trained on this split
    assert meta["train_indices"] == train.tolist() and meta["excluded_split_seeds"] == seeds


def test_judge2_reads_held_out_real_digits():
    intensity, labels = load_digit_intensities()
    held = judge2_split(len(labels))[1]
    colour = torch.arange(len(held)) % len(COLOUR_NAMES)
    images = render(intensity[held], colour)
    prompts = [make_prompt(int(d), int(c)) for d, c in zip(labels[held], colour)]
    judge = build_reward("digits_gold2")
    accuracy = judge(images, prompts)["digits_gold2"].mean().item()
    assert accuracy >= HELD_OUT_ACCURACY_BOUND
    assert accuracy == pytest.approx(json.loads((JUDGE2_DIR / "metadata.json").read_text())["held_out"]["accuracy"], abs=1e-6)
    assert torch.equal(read_colour(images.float() / 255), colour)  # the colour rule reads every real digit
    # a wrong digit or colour in the prompt scores 0
    wrong = [make_prompt((int(d) + 1) % 10, int(c)) for d, c in zip(labels[held], colour)]
    assert judge(images, wrong)["digits_gold2"].mean().item() < 0.05
    # real digits as the reference of a prompt: their Fréchet distance to themselves is 0, to another class large
    ref7, ref1 = judge.reference_features("a red seven"), judge.reference_features("a red one")
    assert ref7.shape == ((labels[held] == 7).sum().item(), judge.model.hidden)
    assert frechet_between(ref7, ref7) == pytest.approx(0.0, abs=1e-6)
    assert frechet_between(ref7, ref1) > 10 * frechet_between(ref7[::2], ref7[1::2])
