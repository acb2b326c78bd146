"""Tests for diffrl.algorithms.advantages against hand-computed values: group advantages, zero-std filtering, DDPO's
per-prompt stat tracker and multi-reward aggregation."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from diffrl.algorithms.advantages import STD_MODES, PerPromptStatTracker, aggregate_rewards, group_advantages, group_std_keep_mask

# Three interleaved groups with non-contiguous, non-zero-based ids and different sizes:
#   group 7  (idx 0, 2, 5): rewards 1, 2, 6   mean 3  centred -2, -1, 3   pop. std sqrt(14/3)
#   group 3  (idx 1, 4):    rewards 0.5, 1.5  mean 1  centred -0.5, 0.5   pop. std 0.5
#   group 10 (idx 3, 6):    rewards 4, 4      mean 4  centred 0, 0        pop. std 0
GROUP_ID = torch.tensor([7, 3, 7, 10, 3, 7, 10])
REWARDS = torch.tensor([1.0, 0.5, 2.0, 4.0, 1.5, 6.0, 4.0])
CENTRED = [-2.0, -0.5, -1.0, 0.0, 0.5, 3.0, 0.0]
EPS = 1e-4


pytestmark = pytest.mark.usefixtures("single_thread")


def _close(got: torch.Tensor, expected: list[float], tol: float = 1e-6):
    assert got.shape == (len(expected),)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float32), rtol=tol, atol=tol)


def test_group_std_mode_hand_values():
    s7 = math.sqrt(14.0 / 3.0)
    s3 = 0.5
    expected = [
        -2.0 / (s7 + EPS),
        -0.5 / (s3 + EPS),
        -1.0 / (s7 + EPS),
        0.0,  # zero-variance group: 0 / (0 + eps) = 0
        0.5 / (s3 + EPS),
        3.0 / (s7 + EPS),
        0.0,
    ]
    got = group_advantages(REWARDS, GROUP_ID, std_mode="group", eps=EPS, clip_max=5.0)
    _close(got, expected)
    # literal spot values: -2/sqrt(14/3) ~ -0.92582, -0.5/0.5 ~ -1 (minus the eps effect)
    assert got[0].item() == pytest.approx(-0.925819, abs=1e-4)
    assert got[1].item() == pytest.approx(-0.5 / 0.5001, abs=1e-6)


def test_global_std_mode_hand_values():
    r = REWARDS.tolist()
    pstd = statistics.pstdev(r)  # population std of the whole batch
    # hand: mean 19/7, sum of squares 1 + .25 + 4 + 16 + 2.25 + 36 + 16 = 75.5
    assert pstd == pytest.approx(math.sqrt(75.5 / 7 - (19 / 7) ** 2))
    expected = [c / (pstd + EPS) for c in CENTRED]
    got = group_advantages(REWARDS, GROUP_ID, std_mode="global", eps=EPS, clip_max=5.0)
    _close(got, expected)


def test_global_is_the_default_mode():
    got = group_advantages(REWARDS, GROUP_ID)
    pstd = statistics.pstdev(REWARDS.tolist())
    _close(got, [c / (pstd + 1e-4) for c in CENTRED])


def test_none_std_mode_is_centred_rewards_without_eps():
    got = group_advantages(REWARDS, GROUP_ID, std_mode="none", eps=0.5, clip_max=5.0)
    _close(got, CENTRED)


def test_clipping_at_clip_max():
    # none mode: centred values -2 .. 3 clipped to [-1.5, 1.5]
    got = group_advantages(REWARDS, GROUP_ID, std_mode="none", clip_max=1.5)
    _close(got, [-1.5, -0.5, -1.0, 0.0, 0.5, 1.5, 0.0])
    # group mode: group 3 gives +-0.5/0.5001 ~ +-0.9998, clipped to +-0.9; group 7 gives -0.926, -0.463, 1.389
    got = group_advantages(REWARDS, GROUP_ID, std_mode="group", eps=EPS, clip_max=0.9)
    s7 = math.sqrt(14.0 / 3.0) + EPS
    _close(got, [-0.9, -0.9, -1.0 / s7, 0.0, 0.9, 0.9, 0.0])


def test_clipping_of_a_low_variance_outlier_in_group_mode():
    # group 0: 0, 0, 0, 1 -> mean 0.25, pop std sqrt(0.1875); the outlier has A = 0.75/0.4331 = 1.732
    rewards = torch.tensor([0.0, 0.0, 0.0, 1.0])
    gid = torch.tensor([2, 2, 2, 2])
    sd = math.sqrt(0.1875) + EPS
    got = group_advantages(rewards, gid, std_mode="group", eps=EPS, clip_max=5.0)
    _close(got, [-0.25 / sd, -0.25 / sd, -0.25 / sd, 0.75 / sd])
    assert got[3].item() == pytest.approx(1.7317, abs=1e-3)
    got = group_advantages(rewards, gid, std_mode="group", eps=EPS, clip_max=1.5)
    _close(got, [-0.25 / sd, -0.25 / sd, -0.25 / sd, 1.5])


def test_eps_is_added_to_the_std():
    # rewards 0 and 1e-4: centred +-5e-5, pop std 5e-5 -> A = 5e-5 / (5e-5 + 1e-4) = 1/3
    rewards = torch.tensor([0.0, 1e-4], dtype=torch.float64)
    gid = torch.tensor([5, 5])
    got = group_advantages(rewards, gid, std_mode="group", eps=1e-4)
    _close(got, [-1.0 / 3.0, 1.0 / 3.0], tol=1e-4)


def test_singleton_group_and_integer_rewards():
    # a one-sample group has advantage 0; integer rewards are promoted to fp32
    rewards = torch.tensor([3, 5, 1, 2])
    gid = torch.tensor([100, 4, 100, 4])  # also check that shuffled, large ids work
    got = group_advantages(rewards, gid, std_mode="group", eps=0.0)
    # group 100: 3, 1 -> mean 2, std 1 ; group 4: 5, 2 -> mean 3.5, std 1.5
    _close(got, [1.0, 1.0, -1.0, -1.0])
    got = group_advantages(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([9, 1, 1]), std_mode="group", eps=EPS)
    _close(got, [0.0, -0.5 / (0.5 + EPS), 0.5 / (0.5 + EPS)])


def test_group_ids_are_labels_only():
    # relabelling groups (any injective map) does not change the result
    relabelled = torch.tensor([0, 42, 0, -3, 42, 0, -3])
    for mode in STD_MODES:
        a = group_advantages(REWARDS, GROUP_ID, std_mode=mode)
        b = group_advantages(REWARDS, relabelled, std_mode=mode)
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_unknown_std_mode_raises():
    with pytest.raises(ValueError, match="batch"):
        group_advantages(REWARDS, GROUP_ID, std_mode="batch")


# --- zero-std groups ------------------------------------------------------------------------------------
def test_group_std_keep_mask_drops_zero_variance_groups():
    keep, dropped = group_std_keep_mask(REWARDS, GROUP_ID)
    # group 10 (idx 3, 6) has rewards 4, 4
    assert keep.dtype == torch.bool
    assert keep.tolist() == [True, True, True, False, True, True, False]
    assert dropped == 1
    # threshold 0.5: group 3 has std exactly 0.5, which is not > 0.5 ; group 7 has std sqrt(14/3) ~ 2.16
    keep, dropped = group_std_keep_mask(REWARDS, GROUP_ID, min_std=0.5)
    assert keep.tolist() == [True, False, True, False, False, True, False]
    assert dropped == 2


def test_group_std_keep_mask_equal_rewards_and_singletons():
    # 0.1 three times: the float mean is not exactly 0.1, the group still counts as std 0
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.2, 0.3], dtype=torch.float32)
    gid = torch.tensor([0, 0, 0, 1, 2, 2])  # group 1 is a single sample
    keep, dropped = group_std_keep_mask(rewards, gid)
    assert keep.tolist() == [False, False, False, False, True, True]
    assert dropped == 2
    with pytest.raises(ValueError, match="min_std"):
        group_std_keep_mask(rewards, gid, min_std=-1.0)


# --- DDPO per-prompt stat tracker ---------------------------------------------------------------------------
def test_stat_tracker_hand_values_and_eviction():
    eps = 1e-6
    t = PerPromptStatTracker(buffer_size=3, min_count=2, eps=eps)
    # batch 1: "a" gets 1, 3 (buffer [1, 3], ready: mean 2, std 1) ; "b" gets 5 (buffer [5], not ready:
    # batch mean 3, batch std sqrt(8/3))
    adv = t.update(["a", "a", "b"], torch.tensor([1.0, 3.0, 5.0]))
    sb = math.sqrt(8 / 3)
    _close(adv, [-1 / (1 + eps), 1 / (1 + eps), 2 / (sb + eps)])
    # batch 2: "a" buffer [1, 3, 5] (mean 3, std sqrt(8/3)) ; "b" buffer [5, 7] (mean 6, std 1)
    adv = t.update(["b", "a"], torch.tensor([7.0, 5.0]))
    _close(adv, [1 / (1 + eps), 2 / (sb + eps)])
    # batch 3: "a" gets 9, the oldest reward 1 is evicted -> buffer [3, 5, 9]
    adv = t.update(["a"], torch.tensor([9.0]))
    assert list(t.buffers["a"]) == [3.0, 5.0, 9.0]
    mean = 17 / 3
    std = math.sqrt(((3 - mean) ** 2 + (5 - mean) ** 2 + (9 - mean) ** 2) / 3)
    _close(adv, [(9 - mean) / (std + eps)])
    assert t.stats() == {"num_prompts": 2, "buffer_len_mean": 2.5, "buffer_len_min": 2, "buffer_len_max": 3, "num_ready": 2}


def test_stat_tracker_state_round_trip_through_json():
    t = PerPromptStatTracker(buffer_size=4, min_count=2)
    t.update(["x", "y", "x"], torch.tensor([0.5, 2.0, 1.5]))
    t.update(["y", "z"], torch.tensor([1.0, 3.0]))
    state = json.loads(json.dumps(t.state_dict()))
    assert state["buffers"] == {"x": [0.5, 1.5], "y": [2.0, 1.0], "z": [3.0]}
    restored = PerPromptStatTracker(buffer_size=4, min_count=2)
    restored.load_state_dict(state)
    assert restored.stats() == t.stats()
    nxt = (["x", "z", "w"], torch.tensor([4.0, -1.0, 0.0]))
    torch.testing.assert_close(restored.update(*nxt), t.update(*nxt), rtol=0, atol=0)
    with pytest.raises(ValueError, match="buffer_size"):
        PerPromptStatTracker(buffer_size=8, min_count=2).load_state_dict(state)
    with pytest.raises(ValueError, match="keys"):
        restored.load_state_dict({"buffers": {}})


def test_stat_tracker_errors():
    with pytest.raises(ValueError, match="min_count"):
        PerPromptStatTracker(buffer_size=4, min_count=5)
    with pytest.raises(ValueError, match="buffer_size"):
        PerPromptStatTracker(buffer_size=0, min_count=0)
    t = PerPromptStatTracker()
    with pytest.raises(ValueError, match="NaN"):
        t.update(["a", "b"], torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="one prompt per reward"):
        t.update(["a"], torch.tensor([1.0, 2.0]))
    assert t.stats()["num_prompts"] == 0  # a rejected batch leaves no trace


# --- multi-reward aggregation ---------------------------------------------------------------------------------
#   rewards a = 1, 2, 3, 4 ; b = 2, 0, 0, 2 ; groups 0, 0, 1, 1 ; weights a: 1, b: 0.5 ; std_mode group, eps 1e-4
#   sum_rewards:    a + b/2 = 2, 2, 3, 5 -> group 0 has std 0 -> 0, 0 ; group 1 -> -1/(1+eps), 1/(1+eps)
#   sum_advantages: A_a = ∓0.5/(0.5+eps) per group ; A_b = +1, -1 | -1, +1 (over 1+eps) ; A = A_a + A_b/2
AGG_REWARDS = {"a": torch.tensor([1.0, 2.0, 3.0, 4.0]), "b": torch.tensor([2.0, 0.0, 0.0, 2.0]), "logged": torch.zeros(4)}
AGG_WEIGHTS = {"a": 1.0, "b": 0.5}
AGG_GID = torch.tensor([0, 0, 1, 1])


def test_aggregate_sum_rewards():
    got = aggregate_rewards(AGG_REWARDS, AGG_WEIGHTS, AGG_GID, mode="sum_rewards", std_mode="group", eps=EPS)
    _close(got, [0.0, 0.0, -1 / (1 + EPS), 1 / (1 + EPS)])


def test_aggregate_sum_advantages():
    got = aggregate_rewards(AGG_REWARDS, AGG_WEIGHTS, AGG_GID, mode="sum_advantages", std_mode="group", eps=EPS)
    a = 0.5 / (0.5 + EPS)
    b = 0.5 / (1 + EPS)
    _close(got, [-a + b, a - b, -a - b, a + b])


def test_aggregate_single_reward_is_group_advantages():
    for mode in ("sum_rewards", "sum_advantages"):
        got = aggregate_rewards({"r": REWARDS}, {"r": 1.0}, GROUP_ID, mode=mode)
        torch.testing.assert_close(got, group_advantages(REWARDS, GROUP_ID))


def test_aggregate_errors():
    with pytest.raises(ValueError, match="sum_rewards"):
        aggregate_rewards(AGG_REWARDS, AGG_WEIGHTS, AGG_GID, mode="mean")
    with pytest.raises(ValueError, match="'c'"):
        aggregate_rewards(AGG_REWARDS, {"c": 1.0}, AGG_GID)
    with pytest.raises(ValueError, match="weights is empty"):
        aggregate_rewards(AGG_REWARDS, {}, AGG_GID)
    with pytest.raises(ValueError, match="std_mod"):
        aggregate_rewards(AGG_REWARDS, AGG_WEIGHTS, AGG_GID, std_mod="group")
