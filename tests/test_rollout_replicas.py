"""Rollout replicas (issue 19): a replica as its own Ray actor beside the actor, real weight sync over gloo,
bounded staleness with the truncated importance-sampling correction.

- 1 replica + 1 actor at ``distributed.max_staleness=0`` reproduces the synchronous (local) run's numbers exactly;
- every sync leaves the replica's LoRA bit-identical to the actor's (SHA-256 on both ends, logged), and the
  last one equals the synchronous run's final LoRA; with full fine-tuning the whole denoiser moves, same checks;
- ``max_staleness=1``: step 1 is on-policy (equal to the synchronous run), later steps train on trajectories one
  version old with the proximal ratio and truncated importance weights;
- the truncated-IS loss against its closed form; bad values of the new keys are one-line errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from diffrl.algorithms.losses import flow_grpo_loss, make_step_loss, truncated_is_weight
from diffrl.config import LoraConfig, ModelConfig, SamplerConfig
from diffrl.distributed import weight_sync
from diffrl.distributed.rollout import RolloutWorker
from diffrl.distributed.workers import WorkerConfig
from diffrl.recipes import ConfigError, compose
from diffrl.sampling.seeding import Stream, derive
from diffrl.trainer import Trainer

PROMPTS = ["a red seven", "a blue two"]
VOLATILE = ("time", "seconds", "perf/", "wall")


def _overrides(tmp_path: Path, out: Path, *extra: str) -> list[str]:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return [
        "sampler.num_steps=3", "sampler.eval_num_steps=2", "trainer.steps=3", "trainer.prompts_per_step=2", "trainer.group_size=4",
        "eval.seeds_per_prompt=2", "eval.every=100", "trainer.checkpoint_every=100", "trainer.threads=1",
        "trainer.wandb=disabled", f"trainer.output_dir={out}", "trainer.progress=false", f"trainer.prompts={prompts}",
        "algorithm.mini_batch_size=null",  # one optimizer step per RL step (the default recipe takes two since 2026-12-07)
        *extra,
    ]


def _records(run: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not any(tag in k for tag in VOLATILE)} for r in lines]


# -- the correction's math ------------------------------------------------------------------------------
def test_truncated_is_weight_is_the_capped_ratio():
    proximal = torch.tensor([0.0, 0.3, -0.2, 2.0, -5.0])
    behaviour = torch.tensor([0.0, 0.1, 0.1, 0.0, -5.5])
    w = truncated_is_weight(proximal, behaviour, cap=2.0)
    expected = [1.0, torch.exp(torch.tensor(0.2)).item(), torch.exp(torch.tensor(-0.3)).item(), 2.0, torch.exp(torch.tensor(0.5)).item()]
    torch.testing.assert_close(w, torch.tensor(expected), rtol=1e-6, atol=0)
    assert not w.requires_grad
    with pytest.raises(ValueError, match="rollout_is_cap must be ≥ 1"):
        truncated_is_weight(proximal, behaviour, cap=0.5)


def test_step_loss_uses_the_proximal_ratio_and_truncated_weights():
    g = torch.Generator().manual_seed(0)
    B, K, k, eps, cap = 8, 3, 1, 0.2, 1.3
    behaviour = torch.randn(B, K, generator=g)
    proximal = behaviour + 0.8 * torch.randn(B, K, generator=g)
    advantages = torch.randn(B, generator=g)
    log_prob = (proximal[:, k] + 0.3 * torch.randn(B, generator=g)).requires_grad_(True)
    batch = TensorDict({"log_probs": behaviour, "prox_log_probs": proximal, "advantages": advantages}, batch_size=[B])
    step = {"log_prob": log_prob, "mean": torch.zeros(B, 2), "std": torch.ones(B, 2)}
    loss, metrics = make_step_loss("flow_grpo", clip_range=eps, rollout_is_cap=cap)(step, batch, k)

    # closed form: L = mean_i min(exp(prox_i − μ_i), C) · max(−A_i r_i, −A_i clip(r_i, 1 ± ε)), r_i = exp(log π_i − prox_i)
    w = torch.minimum(torch.exp(proximal[:, k] - behaviour[:, k]), torch.tensor(cap))
    ratio = torch.exp(log_prob.detach() - proximal[:, k])
    expected = (w * torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - eps, 1 + eps))).mean()
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-6, atol=1e-7)
    assert metrics["rollout_is_weight_mean"] == pytest.approx(w.mean().item(), rel=1e-6)
    assert metrics["rollout_is_truncated"] == pytest.approx((w >= cap).float().mean().item())
    assert 0 < metrics["rollout_is_truncated"] < 1  # both sides of the cap are exercised
    # gradient: ∂L/∂log π_i = −A_i w_i r_i / B where the ratio is not clipped away, else 0
    loss.backward()
    active = torch.where(advantages > 0, ratio < 1 + eps, ratio > 1 - eps)
    torch.testing.assert_close(log_prob.grad, torch.where(active, -advantages * w * ratio / B, torch.zeros(B)), rtol=1e-5, atol=1e-7)

    # one optimizer step: the step's own log-probs (detached) are the proximal policy, the ratio is 1 and the gradient −A·w/B
    current = proximal[:, k].clone().requires_grad_(True)
    one_step = batch.exclude("prox_log_probs")
    one_step["proximal_is_current"] = torch.ones(B, dtype=torch.bool)
    same, metrics = make_step_loss("flow_grpo", clip_range=eps, rollout_is_cap=cap)({**step, "log_prob": current}, one_step, k)
    torch.testing.assert_close(same.detach(), (-advantages * w).mean(), rtol=1e-6, atol=1e-7)
    assert metrics["ratio_mean"] == 1.0
    same.backward()
    torch.testing.assert_close(current.grad, -advantages * w / B, rtol=1e-6, atol=1e-8)

    # without prox_log_probs (on-policy, staleness 0) the loss is Flow-GRPO's against the behaviour log-probs
    on_policy = batch.exclude("prox_log_probs")
    got, _ = make_step_loss("flow_grpo", clip_range=eps, rollout_is_cap=cap)({**step, "log_prob": log_prob.detach()}, on_policy, k)
    plain, _ = flow_grpo_loss(log_prob.detach(), behaviour[:, k], advantages, clip_range=eps)
    assert torch.equal(got, plain)
    with pytest.raises(ValueError, match="grpo_guard cannot train off-policy"):
        make_step_loss("grpo_guard", clip_range=eps)({**step, "log_prob": log_prob.detach()}, batch, k)


def test_buckets_hold_consecutive_tensors_of_one_dtype_up_to_the_size():
    f32, bf16 = torch.float32, torch.bfloat16
    specs = [weight_sync.TensorSpec(n, s, d) for n, s, d in
             [("a", (4,), f32), ("b", (2, 2), f32), ("c", (3,), f32), ("d", (40,), f32), ("e", (2,), bf16), ("f", (2,), bf16)]]
    plan = weight_sync.plan_buckets(specs, bucket_bytes=32)  # 8 floats
    assert [[s.name for s in b] for b in plan] == [["a", "b"], ["c"], ["d"], ["e", "f"]]
    with pytest.raises(ValueError, match="bucket size"):
        weight_sync.plan_buckets(specs, 0)


def test_rollout_worker_sleeps_and_wakes_and_tags_its_weights_version(single_thread):
    config = WorkerConfig(model=ModelConfig(family="digits", path=None, lora=LoraConfig(rank=4)), sampler=SamplerConfig(num_steps=2, noise_level=0.7))
    worker = RolloutWorker(config)
    worker.init_model()
    request = TensorDict({"seeds": torch.tensor([derive(0, Stream.ROLLOUT, 0, 0, s) for s in range(2)]), "group_id": torch.zeros(2, dtype=torch.long)},
                         batch_size=[2])
    request["prompts"] = NonTensorStack(*PROMPTS[:1] * 2)
    first = worker.generate_sequences(request.clone())
    assert first["weights_version"].tolist() == [0, 0] and first["log_probs"].shape == (2, 2)
    before = worker.weights_hash()
    worker.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        worker.generate_sequences(request.clone())
    worker.wake()
    again = worker.generate_sequences(request.clone())
    assert worker.weights_hash() == before
    assert torch.equal(again["latents"], first["latents"]) and torch.equal(again["log_probs"], first["log_probs"])
    with pytest.raises(ValueError, match="role 'rollout' only"):
        RolloutWorker(config, role="actor")


# -- bad values -------------------------------------------------------------------------------------------
@pytest.fixture
def no_model(monkeypatch):
    import diffrl.run_setup as run_setup

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built for an invalid config")

    monkeypatch.setattr(run_setup, "build_worker_group", refuse)


BAD = [
    ("distributed.rollout_replicas=-1", "distributed.rollout_replicas=-1 is invalid"),
    ("distributed.max_staleness=1.5", "distributed.max_staleness=1.5 has the wrong type: it must be an integer"),
    ("distributed.max_staleness=-2", "distributed.max_staleness=-2 is invalid: it must be an integer ≥ 0 (0: synchronous)"),
    ("distributed.weight_sync_bucket_mb=0", "distributed.weight_sync_bucket_mb=0.0 is invalid: it must be a number > 0"),
    ("distributed.weight_sync_backend=mpi", "distributed.weight_sync_backend='mpi' is invalid: it must be one of gloo, nccl"),
    ("distributed.num_gpus_per_rollout=-1", "distributed.num_gpus_per_rollout=-1.0 is invalid"),
    ("algorithm.rollout_is_cap=0.5", "algorithm.rollout_is_cap=0.5 is invalid"),
    ("distributed.rollout_replicas=1", "distributed.rollout_replicas=1 needs distributed.backend=ray"),
    ("distributed.max_staleness=1", "distributed.max_staleness=1 needs rollout replicas"),
    ("distributed.backend=ray distributed.rollout_replicas=3", "distributed.rollout_replicas=3 must divide the 8 rollouts of a request"),
    ("distributed.backend=ray distributed.rollout_replicas=1 distributed.max_staleness=1 reward.async_chunks=2", "reward.async_chunks=2 with distributed.max_staleness=1"),
    ("distributed.backend=ray distributed.rollout_replicas=1 distributed.max_staleness=2 experiment=digits_grpo_guard", "distributed.max_staleness=2 needs a loss"),
    ("distributed.backend=ray distributed.rollout_replicas=1 distributed.max_staleness=1 experiment=digits_nft", "distributed.max_staleness=1 needs a loss"),
    ("distributed.backend=ray distributed.rollout_replicas=1 experiment=digits_nft model.lora.rank=0", "distributed.rollout_replicas=1 with full fine-tuning"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[b[0] for b in BAD])
def test_bad_values_are_one_line_errors_before_any_model(tmp_path, no_model, overrides, message):
    extra = overrides.split()
    experiment = [e for e in extra if e.startswith("experiment=")]
    with pytest.raises((ConfigError, ValueError)) as info:
        Trainer(compose(experiment + _overrides(tmp_path, tmp_path / "r", *[e for e in extra if e not in experiment])))
    text = str(info.value)
    assert "\n" not in text and message in text, text
    assert not (tmp_path / "r").exists()


# -- real Ray + gloo -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def synchronous_run(tmp_path_factory):
    """The synchronous loop of today (one local worker): the numbers the replica runs are held to."""
    tmp = tmp_path_factory.mktemp("sync")
    trainer = Trainer(compose(_overrides(tmp, tmp / "run")))
    trainer.fit()
    return _records(tmp / "run"), weight_sync.state_hash(trainer.workers.trainable_state())


@pytest.fixture
def ray_cluster(ray_local):
    """The process's local Ray instance (tests/conftest.py)."""
    return ray_local


def _replica_run(tmp_path, staleness: int, *extra: str) -> list[dict]:
    out = tmp_path / f"k{staleness}"
    trainer = Trainer(compose(_overrides(tmp_path, out, "distributed.backend=ray", "distributed.rollout_replicas=1", f"distributed.max_staleness={staleness}",
                                         "distributed.weight_sync_bucket_mb=0.01", *extra)))  # 10 KiB: the LoRA (124 KiB) moves in several buckets
    try:
        trainer.fit()
    finally:
        trainer.close()
    raw = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["time/weight_sync"] > 0 for r in raw if r["kind"] == "train")  # timed
    proximal = [r["kind"] == "train" and "time/proximal" in r for r in raw]
    return _records(out), proximal


def _check_syncs(train: list[dict]) -> None:
    for r in train:
        assert r["weight_sync/buckets"] > 1 and r["weight_sync/bytes"] > 0
        assert r["weight_sync/hash_replicas"] == [r["weight_sync/hash"]]  # the replica holds the actor's weights bit for bit
    assert len({r["weight_sync/hash"] for r in train}) == len(train)  # each step changed the LoRA, each sync moved it
    assert train[0]["weight_sync/initial_hash_replicas"] == [train[0]["weight_sync/initial_hash"]]


@pytest.mark.ray
@pytest.mark.slow  # Ray actors: the slow tier, where the Ray tests run one after another on one process
@pytest.mark.ranks
def test_staleness_0_with_one_replica_reproduces_the_synchronous_run(tmp_path, synchronous_run, ray_cluster):
    expected, final_hash = synchronous_run
    got, _ = _replica_run(tmp_path, 0)
    assert len(got) == len(expected) == 5  # eval, 3 steps, eval
    for a, b in zip(expected, got):
        assert set(a) <= set(b)
        assert {k: b[k] for k in a} == a  # every number equal (==), rewards, losses, ratios, evaluations
    train = [r for r in got if r["kind"] == "train"]
    assert [r["weights_version"] for r in train] == [0, 1, 2] and all(r["staleness"] == 0 for r in train)
    assert not any("rollout_is_weight_mean" in r for r in train)  # on-policy: no correction
    _check_syncs(train)
    assert train[-1]["weight_sync/hash"] == final_hash[:16]  # the last sync carried the synchronous run's final LoRA


@pytest.mark.ray
@pytest.mark.slow  # Ray actors: the slow tier
def test_staleness_1_trains_one_version_behind_with_truncated_weights(tmp_path, synchronous_run, ray_cluster):
    expected, _ = synchronous_run
    got, proximal = _replica_run(tmp_path, 1)
    assert not any(proximal)  # one optimizer step per RL step: the training forward itself is the proximal policy
    train = [r for r in got if r["kind"] == "train"]
    assert [r["weights_version"] for r in train] == [0, 0, 1]
    assert [r["staleness"] for r in train] == [0.0, 1.0, 1.0]
    first = expected[1]
    assert {k: train[0][k] for k in first} == first  # step 1 samples with version 0 as the synchronous run does
    for r in train[1:]:
        assert 0 < r["rollout_is_weight_mean"] <= 2.0 and r["rollout_is_weight_mean"] != 1.0
        assert r["first_ratio_mean"] == 1.0  # the ratio starts at 1 against the proximal policy (the actor's own re-scoring)
        assert r["reward_mean"] != expected[train.index(r) + 1]["reward_mean"]  # sampled by older weights than the synchronous run's
    _check_syncs(train)


@pytest.mark.ray
@pytest.mark.slow  # Ray actors: the slow tier
def test_staleness_2_with_mini_batches_rescored_by_the_actor(tmp_path, ray_cluster):
    got, proximal = _replica_run(tmp_path, 2, "algorithm.mini_batch_size=4")  # 2 optimizer steps: the proximal policy is re-scored
    train = [r for r in got if r["kind"] == "train"]
    assert [r["weights_version"] for r in train] == [0, 0, 0]  # steps 1–3 were all sent before the first update
    assert [r["staleness"] for r in train] == [0.0, 1.0, 2.0]
    assert proximal == [False, False, True, True, False]  # eval, on-policy step 1, two stale steps, eval
    assert "rollout_is_weight_mean" not in train[0]
    for r in train[1:]:
        assert 0 < r["rollout_is_weight_mean"] <= 2.0
        assert r["first_ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # the actor's re-scoring before its first optimizer step
    _check_syncs(train)


@pytest.mark.ray
@pytest.mark.slow  # Ray actors: the slow tier
def test_full_fine_tuning_syncs_every_weight_and_matches_the_synchronous_run(tmp_path, ray_cluster):
    full = ("model.lora.rank=0", "algorithm.lr=1e-5", "trainer.steps=2")
    local = Trainer(compose(_overrides(tmp_path, tmp_path / "local", *full)))
    local.fit()
    expected = _records(tmp_path / "local")
    got, _ = _replica_run(tmp_path, 0, *full)
    for a, b in zip(expected, got):
        assert {k: b[k] for k in a} == a
    train = [r for r in got if r["kind"] == "train"]
    denoiser_bytes = sum(p.numel() * p.element_size() for p in local.workers.trainable_state().values())
    assert all(r["weight_sync/bytes"] == denoiser_bytes for r in train)  # the whole denoiser moves, not a LoRA
    assert train[-1]["weight_sync/hash"] == weight_sync.state_hash(local.workers.trainable_state())[:16]
    _check_syncs(train)
