"""The objective contract (``diffrl/engine/objective.py``): every algorithm group's objective declares its
``ObjectiveSpec``, the rollout request and the engine follow the declared fields, a spec that contradicts its class is
refused, and docs/algorithms.md's table states what the registry declares."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from diffrl.algorithms import (BASE, OLD, ALGORITHMS, Granularity, MicroBatchObjective, Objective, ObjectiveSpec, OffPolicy, Pairs,
                               Reference, StepObjective, build_algorithm)
from diffrl.engine.engine import DiffusionEngine
from diffrl.recipes import CONFIG_DIR, compose, to_config
from diffrl.run_setup import run_context
from diffrl.sampling.schedules import WindowMasks

pytestmark = pytest.mark.exact  # types and configs: no floats from different code paths (conftest.py)

ROOT = Path(__file__).resolve().parents[1]
GROUPS = sorted(p.stem for p in (Path(CONFIG_DIR) / "algorithm").glob("*.yaml") if not p.stem.startswith("schema"))


def _algorithm(group: str, *overrides: str):
    cfg = to_config(compose([f"algorithm={group}", *overrides]))
    return build_algorithm(cfg.algorithm, run_context(cfg))


def _docs_rows() -> dict[str, list[str]]:
    text = (ROOT / "docs" / "algorithms.md").read_text()
    table = text.split("| group | class (`algorithm.trainer`) |", 1)[1].split("\n\n", 1)[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()[2:] if line.startswith("|")]
    return {row[0]: row for row in rows}


@pytest.mark.parametrize("group", GROUPS)
def test_every_group_declares_its_spec_and_the_docs_table_states_it(group):
    algorithm = _algorithm(group)
    spec = algorithm.spec
    assert isinstance(algorithm.objective(), Objective) and isinstance(spec, ObjectiveSpec)
    assert algorithm.objective().spec == spec  # built from the config: the same for every call
    row = _docs_rows().get(group)
    assert row is not None, f"docs/algorithms.md's objective table has no row for the group {group}"
    _, cls, _, granularity, _, whole_batch, off_policy, means, _, pairs = row
    assert cls == algorithm.name and granularity == spec.granularity.value and off_policy == spec.off_policy.value, row
    assert (whole_batch == "yes") == spec.prepares_batch and (means == "yes") == spec.record_means, row
    assert pairs == ("—" if spec.pairs is Pairs.NONE else spec.pairs.value), row


def test_the_docs_table_names_every_registered_class():
    assert {row[1] for row in _docs_rows().values()} == set(ALGORITHMS)


@pytest.mark.parametrize("group, overrides, reference, old_policy", [
    ("flow_grpo", ["algorithm.kl_beta=0"], None, False), ("flow_grpo", ["algorithm.kl_beta=0.1"], BASE, False), ("gardo", ["algorithm.kl_beta=0.1"], OLD, True),
    ("gardo", ["algorithm.kl_beta=0"], None, True), ("nft", ["algorithm.kl_beta=0.1"], BASE, True), ("dgpo", [], BASE, False),
    ("awm", ["algorithm.awm_ema_beta=0.1", "algorithm.kl_beta=0"], None, True), ("dpo", [], BASE, False),
])
def test_the_reference_and_the_old_policy_follow_the_config(group, overrides, reference, old_policy):
    algorithm = _algorithm(group, *overrides)
    assert algorithm.spec.reference == reference and algorithm.spec.old_policy is old_policy and algorithm.needs_old_policy is old_policy


def test_off_policy_correction_and_offline_pairs_are_declared(tmp_path):
    assert _algorithm("ddpo").spec.off_policy is OffPolicy.TRUNCATED_IS and _algorithm("grpo_guard").spec.off_policy is OffPolicy.NONE
    assert _algorithm("dpo").spec.pairs is Pairs.ONLINE
    assert _algorithm("dpo", f"algorithm.preference_pairs={tmp_path / 'pairs.jsonl'}").spec.pairs is Pairs.OFFLINE


@pytest.mark.parametrize("group", GROUPS)
def test_the_rollout_request_records_the_means_the_spec_declares(group):
    algorithm = _algorithm(group)
    K = int(algorithm.run.sampler.num_steps)
    masks = WindowMasks(trained=torch.ones(K, dtype=torch.bool), stochastic=torch.ones(K, dtype=torch.bool))
    request = algorithm.rollout_request(masks, 4)
    assert request.record_means is algorithm.spec.record_means and request.micro_batch_size == 4


def test_a_spec_that_contradicts_its_class_is_refused():
    class Prepared(MicroBatchObjective):
        def __init__(self, spec):
            super().__init__(spec)

        def prepare_batch(self, engine, batch, seed):
            return batch

        def micro_losses(self, engine, micro, seed):
            yield from ()

    spec = ObjectiveSpec(name="x", granularity=Granularity.MICRO_BATCH)
    with pytest.raises(TypeError, match="prepares_batch=False but the class defines prepare_batch"):
        Prepared(spec)
    assert Prepared(ObjectiveSpec(name="x", granularity=Granularity.MICRO_BATCH, prepares_batch=True)).spec.prepares_batch
    with pytest.raises(TypeError, match="is a micro_batch objective, its spec says step"):
        Prepared(ObjectiveSpec(name="x", granularity=Granularity.STEP, prepares_batch=True))
    with pytest.raises(ValueError, match="old_policy=True"):
        ObjectiveSpec(name="x", granularity=Granularity.STEP, reference=OLD)
    with pytest.raises(ValueError, match="per-step log-probs"):
        ObjectiveSpec(name="x", granularity=Granularity.MICRO_BATCH, off_policy=OffPolicy.TRUNCATED_IS)
    with pytest.raises(ValueError, match="unknown reference kind"):
        Reference("tutor")
    with pytest.raises(ValueError, match="a source .the teacher's folder or Hub id. is given exactly with kind 'teacher'"):
        Reference("teacher")
    with pytest.raises(ValueError, match="the trained policy itself"):
        Reference("adapter", "default")


def test_the_engine_scores_the_declared_reference():
    """A step objective's ``ref_mean`` comes from the reference its spec names (base, or the old adapter), and no reference
    is scored when it names none."""
    seen = []

    class Probe(StepObjective):
        def __init__(self, reference):
            super().__init__(ObjectiveSpec(name="probe", granularity=Granularity.STEP, reference=reference, old_policy=reference == OLD))

        def __call__(self, step, batch, k):
            seen.append(step.get("ref_mean"))
            return step["log_prob"].sum(), {}

    engine = object.__new__(DiffusionEngine)
    engine.sampler = type("S", (), {"kind": "flow_sde", "noise_level": 0.7})()
    engine.adapter = "policy"
    engine._score_step = lambda adapter, batch, k, cond=None: type("Out", (), {"log_prob": torch.zeros(2), "mean": torch.full((2,), {"policy": 0.0, "base": 1.0, "old": 2.0}[adapter]),
                                                                    "std": torch.ones(2)})()
    engine.reference = lambda: contextlib.nullcontext("base")
    engine.old_policy = lambda: contextlib.nullcontext("old")
    micro = {"sde_mask": torch.ones(2, 1, dtype=torch.bool)}
    for reference in (None, BASE, OLD):
        list(DiffusionEngine._pieces(engine, Probe(reference), micro, 0))
    assert seen[0] is None and float(seen[1][0]) == 1.0 and float(seen[2][0]) == 2.0
