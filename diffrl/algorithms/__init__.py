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

An algorithm is one module of this package that registers its class (``@register_algorithm``), beside its yaml
group ``configs/algorithm/<name>.yaml``: every module here is imported below, so adding one needs no other edit.
"""

import importlib
import pkgutil

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

for _module in pkgutil.iter_modules(__path__):  # every algorithm module registers itself on import
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "ALGORITHMS", "AWM", "Algorithm", "NFT", "PolicyGradient", "Preference", "RolloutPlan", "RunContext", "StepResult",
    "algorithm_class", "build_algorithm", "check_config", "group_class", "register_algorithm",
]
