"""``rollout_driver.sample_while_scoring``: chunk c's scoring runs while chunk c + 1 samples, the results are the serial
loop's in order, and a scoring error surfaces after the chunks in flight."""

from __future__ import annotations

import threading

import pytest

from diffrl.rollout_driver import sample_while_scoring

pytestmark = pytest.mark.exact


def test_each_chunk_is_scored_while_the_next_samples_and_results_keep_their_order():
    started = [threading.Event() for _ in range(3)]
    overlapped = []

    def generate(c):
        if c > 0:  # sampling chunk c waits (boundedly) for chunk c - 1's scoring to have started: it runs beside it
            overlapped.append(started[c - 1].wait(timeout=10))
        return [10 * c + i for i in range(4)]

    def score_fn(part):
        started[part[0] // 10].set()
        return [x * x for x in part]

    parts, results, sampling, wait = sample_while_scoring(generate, 3, score_fn)
    assert overlapped == [True, True]
    assert parts == [[0, 1, 2, 3], [10, 11, 12, 13], [20, 21, 22, 23]]
    assert results == [[x * x for x in p] for p in parts]  # what the serial loop computes, in the chunks' order
    assert sampling >= 0 and wait >= 0


def test_a_scoring_error_surfaces_after_sampling():
    sampled = []

    def score_fn(part):
        if part == 1:
            raise RuntimeError("reward server down")
        return part

    with pytest.raises(RuntimeError, match="reward server down"):
        sample_while_scoring(lambda c: sampled.append(c) or c, 3, score_fn)
    assert sampled == [0, 1, 2]
