"""Workers (seed API): mini-batches × epochs, reference inference, adapter copy/EMA, checkpoints."""

from __future__ import annotations

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from diffrl.algorithms.advantages import group_advantages
from diffrl.algorithms.losses import make_step_loss
from diffrl.checkpoint import list_checkpoints
from diffrl.config import LoraConfig, ModelConfig, SamplerConfig
from diffrl.distributed.workers import ActorRolloutRefWorker, WorkerConfig
from diffrl.engine import lora
from diffrl.sampling.seeding import Stream, derive
from tests.conftest import randomise_lora


def _worker(num_steps=3):
    cfg = WorkerConfig(model=ModelConfig(family="digits", path=None, lora=LoraConfig(rank=4)), sampler=SamplerConfig(num_steps=num_steps, noise_level=0.7))
    worker = ActorRolloutRefWorker(cfg, role="actor_rollout_ref")
    worker.init_model()
    worker.set_loss_fn(make_step_loss("flow_grpo", clip_range=0.2))
    return worker


def _request(n_prompts=2, group=4):
    prompts = ["a red seven", "a green three", "a blue one"][:n_prompts]
    td = TensorDict({"seeds": torch.tensor([derive(0, Stream.ROLLOUT, 0, j, s) for j in range(n_prompts) for s in range(group)]),
                     "group_id": torch.arange(n_prompts).repeat_interleave(group)}, batch_size=[n_prompts * group])
    td["prompts"] = NonTensorStack(*[p for p in prompts for _ in range(group)])
    return td


def test_train_mini_batch_counts_optimizer_steps_and_pops_flags():
    worker = _worker()
    traj = worker.generate_sequences(_request())
    del traj["metrics"]
    traj["advantages"] = group_advantages(torch.arange(8.0), traj["group_id"])
    traj.set_non_tensor("mini_batch_size", 2)
    traj.set_non_tensor("update_seeds", [7, 8, 9, 10])
    out = worker.update_actor(traj).get_non_tensor("metrics")
    assert len(out["loss"]) == 4  # 4 consecutive mini-batches, one optimizer step each
    # the first mini-batch is on-policy: ratio 1 up to float32 kernels (AVX-512 and AVX2 log-probs differ by ~1e-8)
    assert out["ratio_mean"][0] == pytest.approx(1.0, abs=1e-6)
    assert abs(out["ratio_mean"][-1] - 1.0) > 1e-4  # the last one follows three updates
    assert "mini_batch_size" not in traj.keys() and "update_seeds" not in traj.keys()
    bad = traj.clone()
    bad.set_non_tensor("mini_batch_size", 3)
    try:
        worker.update_actor(bad)
    except ValueError as exc:
        assert "mini_batch_size=3" in str(exc)
    else:
        raise AssertionError("an indivisible mini_batch_size must raise")


def test_infer_ref_equals_actor_before_training_and_differs_after():
    worker = _worker()
    traj = worker.generate_sequences(_request())
    del traj["metrics"]
    ref0 = worker.infer_ref_batch(traj.clone())["log_probs"]
    act0 = worker.infer_actor_batch(traj.clone())["log_probs"]
    torch.testing.assert_close(ref0, act0, rtol=0, atol=1e-4)  # LoRA B = 0 at init: actor == reference
    randomise_lora(worker.engine.module)
    act1 = worker.infer_actor_batch(traj.clone())["log_probs"]
    ref1 = worker.infer_ref_batch(traj.clone())["log_probs"]
    torch.testing.assert_close(ref1, ref0, rtol=0, atol=1e-6)  # reference ignores the adapter
    assert (act1 - act0).abs().max() > 1e-3


def test_copy_and_ema_adapter_closed_form():
    worker = _worker()
    module = worker.engine.module
    randomise_lora(module, seed=1)
    worker.copy_adapter("default", "old")
    default = lora.adapter_parameters(module, "default")
    old = lora.adapter_parameters(module, "old")
    assert len(old) == len(default) > 0
    for name, p in default.items():
        assert torch.equal(old[name.replace(".default.", ".old.")], p)
    assert not any(p.requires_grad for p in old.values())  # the old policy is never trained
    before_old = {n: p.clone() for n, p in old.items()}
    randomise_lora(module, seed=2)  # changes both adapters' B; re-randomise default only:
    with torch.no_grad():
        for n, p in old.items():
            p.copy_(before_old[n])
        for n, p in default.items():
            p.add_(0.1)
    worker.ema_update_adapter("default", "old", decay=0.9)
    for name, p in default.items():
        expected = 0.9 * before_old[name.replace(".default.", ".old.")] + 0.1 * p
        torch.testing.assert_close(old[name.replace(".default.", ".old.")], expected)
    assert [n for n, p in module.named_parameters() if p.requires_grad] == list(default)  # still only "default" trains


def test_checkpoint_round_trip_is_atomic_and_exact(tmp_path):
    worker = _worker()
    traj = worker.generate_sequences(_request())
    del traj["metrics"]
    traj["advantages"] = group_advantages(torch.arange(8.0), traj["group_id"])
    worker.update_actor(traj.clone())
    path = worker.save_checkpoint(tmp_path / "ckpt", global_step=1, extra_state={"note": "x"})
    assert [p.name for p in list_checkpoints(tmp_path / "ckpt")] == ["step_000001"]
    (tmp_path / "ckpt" / "step_000002.tmp-123").mkdir()  # a partial write is ignored
    assert [p.name for p in list_checkpoints(tmp_path / "ckpt")] == ["step_000001"]
    try:
        worker.save_checkpoint(tmp_path / "ckpt", global_step=1)
    except FileExistsError:
        pass
    else:
        raise AssertionError("an existing checkpoint must not be overwritten")
    saved = {n: p.clone() for n, p in worker.engine.trainable_state().items()}
    opt_state = worker.engine.optimizer.state_dict()

    fresh = _worker()
    state = fresh.load_checkpoint(path)
    assert state == {"global_step": 1, "lora": {"rank": fresh.engine.model.lora.rank, "alpha": fresh.engine.model.lora.alpha}, "note": "x"}
    for n, p in fresh.engine.trainable_state().items():
        assert torch.equal(p, saved[n])
    fresh_opt = fresh.engine.optimizer.state_dict()
    for idx, st in opt_state["state"].items():
        for key, value in st.items():
            assert torch.equal(torch.as_tensor(fresh_opt["state"][idx][key]), torch.as_tensor(value))
    # the same next update from both
    worker.update_actor(traj.clone())
    fresh.update_actor(traj.clone())
    for n, p in fresh.engine.trainable_state().items():
        assert torch.equal(p, worker.engine.trainable_state()[n])
