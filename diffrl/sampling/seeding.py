"""Every seed of a run, derived from ``trainer.seed`` through one function and named streams.

``derive(seed, stream, *keys)`` gives the integer seed of one random draw: a stream names *what* is drawn
(rollout noise, the training window, a mini-batch shuffle, …) and the keys say *which one* (step, prompt
position, sample index, …). A draw depends on nothing else (not on batch composition, worker count or
chunking), so rollouts reproduce and a resumed run redraws exactly what the uninterrupted run drew.

Each stream fixes the number of its keys and how they mix into the seed. The hash is a splitmix64 chain;
the per-stream layout (which slot each key takes, the stream's tag) is the one runs used before the streams
had names, so results of earlier runs reproduce bit for bit.

Streams and their keys:

========================  ==============================  ==============================================
stream                    keys                            draws
========================  ==============================  ==============================================
``ROLLOUT``               step, prompt position, sample   a training sample's generator (SDE noise; its
                                                          first draw is the initial noise)
``INITIAL_NOISE``         step, prompt position           shared initial noise of a prompt group
``EVAL``                  prompt index, sample            held-out evaluation sample (``seed`` =
                                                          ``eval.seed``; disjoint from training)
``WINDOW``                step                            the training window of an RL step
``PROMPT_ORDER``          pass over the prompt set        the permutation of prompts in one pass
``MINI_BATCH_SHUFFLE``    step, epoch                     the order of a step's rows in one epoch
``UPDATE``                step, epoch, mini-batch index   one optimizer step (seeds the objective streams)
``OBJECTIVE_NOISE``       sample seed, noise index        re-noising noise of an objective (NFT, DPO, AWM;
                                                          ``seed`` = the ``UPDATE`` seed)
``DPO_TIMESTEP``          sample seed, noise index        Diffusion-DPO's noise level of a pair
``NFT_TIMESTEPS``         sample seed                     the order of DiffusionNFT's noise levels
``OFFLINE_PAIRS``         pass over the pair file         the permutation of offline preference pairs
========================  ==============================  ==============================================
"""

from __future__ import annotations

import enum

import torch

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix(seed: int, *parts: int) -> int:
    """A 63-bit seed that depends on ``seed`` and every part (a splitmix64 chain)."""
    h = _splitmix64(seed & _MASK64)
    for part in parts:
        h = _splitmix64(h ^ (part & _MASK64))
    return h & _MASK63


class Stream(enum.Enum):
    """Named random streams (see the module docstring for their keys)."""

    ROLLOUT = "rollout"
    INITIAL_NOISE = "initial_noise"
    EVAL = "eval"
    WINDOW = "window"
    PROMPT_ORDER = "prompt_order"
    MINI_BATCH_SHUFFLE = "mini_batch_shuffle"
    UPDATE = "update"
    OBJECTIVE_NOISE = "objective_noise"
    DPO_TIMESTEP = "dpo_timestep"
    NFT_TIMESTEPS = "nft_timesteps"
    OFFLINE_PAIRS = "offline_pairs"


# The tags keep streams that share a key layout apart; the linear streams seed torch.Generator directly
# (stream constant × seed + key), the layout runs used before the streams were named.
_TAGGED = {  # stream -> (number of keys, function of (seed, keys))
    Stream.ROLLOUT: (3, lambda s, k: mix(s, k[0], k[1], k[2])),
    Stream.INITIAL_NOISE: (2, lambda s, k: mix(s, k[0], k[1], -1)),
    Stream.EVAL: (2, lambda s, k: mix(s, -1, k[0], k[1])),
    Stream.WINDOW: (1, lambda s, k: mix(s, k[0], -7, 0)),
    Stream.PROMPT_ORDER: (1, lambda s, k: s * 100003 + k[0]),
    Stream.MINI_BATCH_SHUFFLE: (2, lambda s, k: s * 1000003 + k[0] + k[1]),
    Stream.UPDATE: (3, lambda s, k: mix(mix(s * 1000003 + k[0], k[1], 0, 5), 0, k[2], 3)),
    Stream.OBJECTIVE_NOISE: (2, lambda s, k: mix(s, k[0], k[1], 1)),
    Stream.DPO_TIMESTEP: (2, lambda s, k: mix(s, k[0], k[1], 2)),
    Stream.NFT_TIMESTEPS: (1, lambda s, k: mix(s, k[0], 0, 4)),
    Stream.OFFLINE_PAIRS: (1, lambda s, k: s * 7919 + k[0]),
}


def derive(seed: int, stream: Stream, *keys: int) -> int:
    """The seed of one draw of ``stream`` identified by ``keys`` (see the module docstring).

    Raises:
        ValueError: when the number of keys does not match the stream's.
    """
    count, fn = _TAGGED[stream]
    if len(keys) != count:
        raise ValueError(f"seed stream {stream.value} takes {count} keys, got {len(keys)}: {keys}")
    return fn(int(seed), tuple(int(k) for k in keys))


def generator(seed: int, stream: Stream, *keys: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with :func:`derive`."""
    return torch.Generator().manual_seed(derive(seed, stream, *keys))


def generators(seeds: list[int], device: str | torch.device = "cpu") -> list[torch.Generator]:
    """One generator per seed (per-sample draws that do not depend on the batch)."""
    return [torch.Generator(device=device).manual_seed(int(s)) for s in seeds]
