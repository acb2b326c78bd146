"""The realness check and the fidelity headline (issue 39): closed forms, the calibration, and the separation of real
held-out digits from AWM's filled shapes, from thickened strokes and from noise."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from diffrl.config import RewardConfig, eval_metric_names
from diffrl.sampling.distribution import DIVERSITY_FLOOR, fidelity_headline
from rewards.base import build_reward
from rewards.digits import judge_correct
from rewards.digits.classifiers import DigitsClassifier
from rewards.digits.data import ASSET_DIR, load_digit_intensities, make_prompt
from rewards.digits.judge2 import render
from rewards.digits.realness import PASS_QUANTILE, nearest_distance, realness_check, realness_features, realness_split, rendered_real
from rewards.digits.stroke import stroke_statistics

DATA = Path(__file__).parent / "data"


def _awm_samples():
    with safe_open(str(DATA / "digits_awm_samples.safetensors"), "pt") as f:
        return f.get_tensor("awm"), f.get_tensor("base"), json.loads(f.metadata()["prompts"])


def test_nearest_distance_is_the_rms_to_the_closest_reference_row():
    ref = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    x = torch.tensor([[0.5, 0.5, 0.5, 0.5], [1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.2]])
    # ‖x − r‖₂ / √4: 0.5 (either), min(√3, 1)/2 = 0.5, 0.2/2 = 0.1
    assert torch.allclose(nearest_distance(x, ref), torch.tensor([0.5, 0.5, 0.1]))


def test_split_is_disjoint_and_covers_every_digit():
    ref, cal, test = realness_split()
    assert (len(ref), len(cal), len(test)) == (1258, 270, 269)
    assert torch.equal(torch.cat([ref, cal, test]).sort().values, torch.arange(1797))


def test_features_are_the_ink_intensity_whatever_the_colour():
    intensity, _ = load_digit_intensities()
    digit = intensity[:1]
    feats = torch.cat([realness_features(render(digit, torch.tensor([c]))) for c in range(6)])
    expected = F.avg_pool2d(digit, 2).flatten(1)
    # uint8 rounding of one channel (the dimmest palette channel carries 0.1 of the ink): within 2/255 / 0.1
    assert (feats - expected).abs().max() < 0.02
    assert (feats.std(0).max()) < 0.02


def test_calibration_passes_95_percent_of_real_digits_it_never_saw():
    check = realness_check()
    assert check.calibration_pass >= PASS_QUANTILE
    assert check.test_pass >= 0.92  # digits used neither as neighbours nor for the threshold (measured 0.952)
    assert 0.05 < check.threshold < 0.25  # RMS ink intensity: the pass distance is a fraction of a stroke's contrast


def test_separates_real_digits_from_awm_filled_shapes_thick_strokes_and_noise():
    check = realness_check()
    _, _, test = realness_split()
    real = rendered_real(test)
    awm, base, _ = _awm_samples()
    thick = F.max_pool2d(real.float() / 255.0, 3, 1, 1)  # every stroke dilated by one pixel
    noise = torch.rand(500, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    blobs = torch.zeros(60, 3, 16, 16)
    blobs[:, :, 3:13, 4:12] = torch.tensor([1.0, 0.15, 0.1]).view(1, 3, 1, 1)  # a filled red rectangle
    rates = {name: float(check.passes(x).float().mean()) for name, x in
             {"real": real, "awm": awm, "thick": thick, "noise": noise, "blobs": blobs}.items()}
    assert rates["real"] >= 0.92
    assert rates["awm"] <= 0.05 and rates["thick"] <= 0.10 and rates["noise"] == 0.0 and rates["blobs"] == 0.0, rates
    # the samples of the base shipped before 2026-12-05 (stored with AWM's) are no closer to real digits than AWM's (issue 39)
    assert float(check.passes(base).float().mean()) <= 0.05
    d_real, d_awm = check.distance(real).median(), check.distance(awm).median()
    assert d_awm > 1.5 * d_real


def test_fidelity_is_gold_and_real():
    fidelity, real = build_reward("digits_fidelity"), build_reward("digits_real")
    gold = DigitsClassifier.from_pretrained(ASSET_DIR / "gold_classifier")
    _, _, test = realness_split()
    images = rendered_real(test[:40])
    intensity, labels = load_digit_intensities()
    colour = torch.randint(6, (40,), generator=torch.Generator().manual_seed(34))  # rendered_real's colours (seed + 1)
    right = [make_prompt(int(d), int(c)) for d, c in zip(labels[test[:40]], colour)]
    wrong = [make_prompt((int(d) + 1) % 10, int(c)) for d, c in zip(labels[test[:40]], colour)]
    awm, _, awm_prompts = _awm_samples()
    for batch, prompts in ((images, right), (images, wrong), (awm, awm_prompts)):
        out = fidelity(batch, prompts)["digits_fidelity"]
        expected = (judge_correct(gold, batch, prompts) & real(batch, prompts)["digits_real"].bool()).float()
        assert torch.equal(out, expected)
    assert fidelity(images, right)["digits_fidelity"].mean() >= 0.85  # real digits, right prompts: the gold judge reads them
    assert fidelity(images, wrong)["digits_fidelity"].sum() <= 2
    assert fidelity(awm, awm_prompts)["digits_fidelity"].mean() <= 0.05  # AWM: gold 0.93 on these prompts, fidelity ≈ 0
    with pytest.raises(ValueError, match=r"\[B, 3, 16, 16\]"):
        real(torch.zeros(2, 3, 32, 32, dtype=torch.uint8), ["a red one"] * 2)


def _eval(step, value, diversity, **extra):
    return {"step": step, "kind": "eval", "eval/digits_fidelity": value, "eval/diversity_feature": diversity, **extra}


def test_fidelity_headline_takes_the_best_evaluation_that_keeps_diversity():
    evals = [_eval(0, 0.10, 10.0), _eval(50, 0.40, 8.0), _eval(100, 0.60, 6.9), _eval(150, 0.70, 5.0)]
    h = fidelity_headline(evals, "digits_fidelity")
    # floor 0.70 × 10 = 7.0: steps 100 and 150 collapsed; the best kept is step 50
    assert h["step"] == 50 and h["best"] == 0.40 and h["gain"] == pytest.approx(0.30)
    assert h["diversity_floor"] == pytest.approx(DIVERSITY_FLOOR * 10.0) and h["diversity_at_best"] == 8.0
    assert h["last"] == 0.70 and h["last_gain"] == pytest.approx(0.60)
    # every trained evaluation collapsed: "none"
    none = fidelity_headline([_eval(0, 0.1, 10.0), _eval(50, 0.9, 6.0)], "digits_fidelity")
    assert none["best"] is None and none["step"] is None and none["gain"] is None and none["last_gain"] == pytest.approx(0.8)
    # ties go to the earliest evaluation; without a diversity metric no floor applies
    plain = [{"step": s, "eval/digits_fidelity": v} for s, v in ((0, 0.2), (10, 0.5), (20, 0.5))]
    h = fidelity_headline(plain, "digits_fidelity")
    assert h["step"] == 10 and h["diversity_key"] is None and h["diversity_floor"] is None
    # pixel diversity when the feature one is missing
    pix = [{"step": 0, "eval/f": 0.0, "eval/diversity_pixel": 0.2}, {"step": 5, "eval/f": 0.3, "eval/diversity_pixel": 0.15}]
    assert fidelity_headline(pix, "f")["diversity_key"] == "eval/diversity_pixel" and fidelity_headline(pix, "f")["gain"] == pytest.approx(0.3)
    with pytest.raises(KeyError, match="reward.fidelity=digits_fidelity"):
        fidelity_headline([{"step": 0}], "digits_fidelity")


def test_eval_metric_names_one_order_everywhere():
    r = RewardConfig(names=["digits"], gold="digits_gold", fidelity="digits_fidelity", judges=["digits_gold2", "digits_gold"])
    assert eval_metric_names(r) == ["digits", "digits_gold", "digits_fidelity", "digits_gold2"]
    assert eval_metric_names({"names": ["a"], "gold": None, "judges": []}) == ["a"]


def test_stroke_prior_scores_real_strokes_above_filled_shapes():
    """digits_stroke (GARDO's auxiliary reward on digits): 1 at the real digits' mean statistics; real held-out digits
    score far above AWM's filled shapes and dilated strokes (measured medians 0.75, 0.001, 0.004)."""
    stroke = build_reward("digits_stroke")
    _, _, test = realness_split()
    real = rendered_real(test)
    awm, _, prompts = _awm_samples()
    thick = F.max_pool2d(real.float() / 255.0, 3, 1, 1)
    med = {n: float(stroke(x, ["a red one"] * len(x))["digits_stroke"].median()) for n, x in (("real", real), ("awm", awm), ("thick", thick))}
    assert med["real"] > 0.5 and med["awm"] < 0.05 and med["thick"] < 0.05, med
    # closed form: a red 4×4 square of full ink has ink and solid shares 16/256 and total variation 2·8/240
    square = torch.zeros(1, 3, 16, 16)
    square[0, :, 6:10, 6:10] = torch.tensor([1.0, 0.15, 0.1]).view(3, 1, 1)
    stats = stroke_statistics(square)
    torch.testing.assert_close(stats, torch.tensor([[16 / 256, 16 / 256, 16 / 240]]))
    z = (stats - stroke.mean) / stroke.std
    assert float(stroke(square, ["a red one"])["digits_stroke"]) == pytest.approx(float(torch.exp(-0.5 * (z**2).mean())))
