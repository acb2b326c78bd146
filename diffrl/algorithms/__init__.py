"""Algorithms: one class per family behind one interface (``base.Algorithm``), a registry keyed by
``algorithm.trainer`` (``ALGORITHMS``), the objective contract its losses declare (``base.ObjectiveSpec``), and the
pure math they share (``advantages``, ``losses``, ``objectives``, ``awm_loss``).

An algorithm is one module of this package that registers its class (``@register_algorithm``), beside its yaml
group ``configs/algorithm/<name>.yaml``: every module here is imported below (``pkgutil``), so adding one needs no
other edit. ``ALGORITHMS`` lists the registered classes; ``docs/algorithms.md`` tabulates them with their objectives'
specs (``tests/test_objective_contract.py`` checks that table against the registry).
"""

import importlib
import pkgutil

from diffrl.algorithms.awm import AWM
from diffrl.algorithms.base import (
    ALGORITHMS,
    BASE,
    OLD,
    Algorithm,
    Granularity,
    MicroBatchObjective,
    Objective,
    ObjectiveSpec,
    OffPolicy,
    Pairs,
    Reference,
    RolloutPlan,
    RunContext,
    StepObjective,
    StepResult,
    algorithm_class,
    build_algorithm,
    check_config,
    group_class,
    register_algorithm,
    registered_where,
)
from diffrl.algorithms.dpo import Preference
from diffrl.algorithms.nft import NFT
from diffrl.algorithms.policy_gradient import PolicyGradient

for _module in pkgutil.iter_modules(__path__):  # every algorithm module registers itself on import
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "ALGORITHMS", "AWM", "BASE", "NFT", "OLD", "Algorithm", "Granularity", "MicroBatchObjective", "Objective", "ObjectiveSpec", "OffPolicy",
    "Pairs", "PolicyGradient", "Preference", "Reference", "RolloutPlan", "RunContext", "StepObjective", "StepResult", "algorithm_class",
    "build_algorithm", "check_config", "group_class", "register_algorithm", "registered_where",
]
