"""Tests for diffrl.advantages.group_advantages against hand-computed values."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from diffrl.advantages import STD_MODES, group_advantages

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
