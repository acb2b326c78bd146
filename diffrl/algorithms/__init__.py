"""Algorithms: one class per family behind one interface (``base.Algorithm``), a registry keyed by
``algorithm.trainer``, and the pure math they share (``advantages``, ``losses``, ``objectives``).

================  ===========================================================================
name              class
================  ===========================================================================
policy_gradient   :class:`PolicyGradient` (Flow-GRPO, -Fast, MixGRPO, GRPO-Guard, DanceGRPO, DDPO)
preference        :class:`Preference` (Diffusion-DPO, online or offline pairs)
nft               :class:`NFT` (DiffusionNFT)
awm               :class:`AWM` (Advantage Weighted Matching)
================  ===========================================================================
"""

from diffrl.algorithms.awm import AWM
from diffrl.algorithms.base import (
    ALGORITHMS,
    Algorithm,
    RolloutPlan,
    RunContext,
    StepResult,
    algorithm_class,
    build_algorithm,
    check_config,
    group_class,
    register_algorithm,
)
from diffrl.algorithms.dpo import Preference
from diffrl.algorithms.nft import NFT
from diffrl.algorithms.policy_gradient import PolicyGradient

__all__ = [
    "ALGORITHMS", "AWM", "Algorithm", "NFT", "PolicyGradient", "Preference", "RolloutPlan", "RunContext", "StepResult",
    "algorithm_class", "build_algorithm", "check_config", "group_class", "register_algorithm",
]
