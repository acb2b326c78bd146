"""The algorithm layer: old-policy EMA, gradient-accumulation invariance of every objective, DPO pairs
(online and offline), GRPO-Guard's recorded means, and exact resume of an NFT run."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_engine, tiny_run_overrides
from safetensors.torch import load_file
from tensordict import TensorDict

from diffrl.algorithms.awm import AWMObjective
from diffrl.algorithms.dpo import DPOObjective, online_pairs
from diffrl.algorithms.losses import make_step_loss, nft_reward_to_r
from diffrl.algorithms.nft import NFTObjective, old_decay
from diffrl.config import ModelConfig, OptimConfig, SamplerConfig
from diffrl.data import read_preference_pairs
from diffrl.distributed.workers import ActorRolloutRefWorker, WorkerConfig
from diffrl.engine import lora
from diffrl.engine.engine import lr_factor
from diffrl.recipes import compose
from diffrl.sampling.rollout import sample_trajectories
from diffrl.resume import RunFolderError
from diffrl.trainer import Trainer
from tests.conftest import randomise_lora

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = ["a red seven", "a blue two"]


def test_old_decay_schedules():
    assert [old_decay("copy", s) for s in (0, 10, 1000)] == [0.0, 0.0, 0.0]
    assert [old_decay("linear_to_0_5", s) for s in (0, 100, 499, 600)] == pytest.approx([0.0, 0.1, 0.499, 0.5])
    assert [old_decay("delayed_linear", s) for s in (0, 74, 75, 95, 1000)] == pytest.approx([0.0, 0.0, 0.0, 0.15, 0.999])
    assert old_decay("linear_to_0_5", 100, rate=0.01, max_decay=0.3) == pytest.approx(0.3)
    assert old_decay("constant", 3, max_decay=0.9) == 0.9
    with pytest.raises(ValueError, match="old_schedule"):
        old_decay("cosine", 1)


@pytest.mark.parametrize("lora_rank", [4, 0])
def test_old_policy_ema_semantics_lora_and_full_finetuning(tiny_adapter, lora_rank):
    engine = make_engine(tiny_adapter, SamplerConfig(num_steps=2), lora_rank=lora_rank)
    engine.initialize()
    if lora_rank:
        randomise_lora(engine.module, seed=1)
    engine.copy_to_old()

    def old_weights():
        if lora_rank:
            return {n.replace(".old.", ".default."): p.detach().clone() for n, p in lora.adapter_parameters(engine.module, "old").items()}
        return {n: p.detach().clone() for n, p in engine._old_copy.denoiser.named_parameters()}

    current = {n: p.detach().clone() for n, p in engine.trainable_state().items()}
    assert old_weights().keys() == current.keys()
    assert all(torch.equal(old_weights()[n], current[n]) for n in current)
    with torch.no_grad():
        for p in engine.trainable_parameters():
            p.add_(0.5)
    engine.ema_to_old(0.25)  # old ← 0.25·old + 0.75·current
    for n, value in old_weights().items():
        torch.testing.assert_close(value, 0.25 * current[n] + 0.75 * (current[n] + 0.5), rtol=0, atol=1e-6)
    # the old policy predicts with the old weights, and the trained policy is back afterwards
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    cond = tiny_adapter.encode_prompts(PROMPTS)
    sigma = torch.full((2,), 0.6)
    before = tiny_adapter.predict(x, sigma, cond, 1.0)
    with torch.no_grad(), engine.old_policy() as old:
        v_old = old.predict(x, sigma, cond, 1.0)
    assert not torch.allclose(v_old, before)
    torch.testing.assert_close(tiny_adapter.predict(x, sigma, cond, 1.0), before, rtol=0, atol=0)
    assert {n for n, p in engine.module.named_parameters() if p.requires_grad} == set(current)


def _trajectories(adapter, n: int = 8) -> TensorDict:
    settings = SamplerConfig(num_steps=3, noise_level=0.8)
    prompts = [PROMPTS[i % 2] for i in range(n)]
    td = sample_trajectories(adapter, prompts, settings=settings, seeds=list(range(100, 100 + n)), group_id=torch.arange(n) % 2)
    rewards = torch.linspace(-1, 1, n)
    td["advantages"] = rewards
    td["nft_r"] = nft_reward_to_r(rewards, td["group_id"])
    return td


def _accumulated_grads(objective, batch, micro_batch_size):
    from pipelines.digits import DigitsAdapter

    adapter = DigitsAdapter(path=None, seed=0)
    engine = make_engine(adapter, SamplerConfig(num_steps=3, noise_level=0.8), lora_rank=4, micro_batch_size=micro_batch_size)
    engine.initialize()
    randomise_lora(engine.module, seed=3)
    engine.copy_to_old()
    randomise_lora(engine.module, seed=4)  # old ≠ current
    captured = {}

    def capture(loss):
        captured.update({n: p.grad.clone() for n, p in engine.module.named_parameters() if p.requires_grad})
        engine.optimizer.zero_grad(set_to_none=True)
        return 0.0, False

    engine._optimizer_step = capture
    out = engine.train_batch(batch, objective, seed=11)
    return captured, out


def assert_micro_batch_invariant(objective, batch):
    """8 micro-batches of 1 and one batch of 8 give the same, non-zero gradient (fp32 tolerance); the two
    engines' ``train_batch`` outputs ``(whole, split)``."""
    whole, out_whole = _accumulated_grads(objective, batch, None)
    split, out_split = _accumulated_grads(objective, batch, 1)
    assert whole.keys() == split.keys() and whole
    assert any(g.abs().max() > 0 for g in whole.values())
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-4, atol=1e-7)
    return out_whole, out_split


@pytest.mark.parametrize("which", ["flow_grpo", "grpo_guard", "nft", "dpo", "awm"])
def test_gradient_accumulation_invariance(tiny_adapter, which):
    """8 micro-batches of 1, accumulated, give the gradient of one batch of 8 (fp32 tolerance)."""
    batch = _trajectories(tiny_adapter)
    if which == "flow_grpo":
        objective = make_step_loss("flow_grpo", clip_range=0.2, kl_beta=0.05)
    elif which == "grpo_guard":
        batch = batch.exclude("log_probs")
        td = sample_trajectories(tiny_adapter, [PROMPTS[i % 2] for i in range(8)], settings=SamplerConfig(num_steps=3, noise_level=0.8),
                                 seeds=list(range(100, 108)), record_means=True)
        batch["log_probs"], batch["means"] = td["log_probs"], td["means"]
        objective = make_step_loss("grpo_guard", clip_range=0.2)
    elif which == "nft":
        objective = NFTObjective(nft_beta=0.7, adaptive_weight=True, kl_beta=0.1, num_timesteps=2, policy_scale=1.0)
    elif which == "awm":
        batch["advantages"] = torch.tensor([1.5, -0.5, 0.25, -2.0, 0.0, 0.75, -1.0, 3.0])
        objective = AWMObjective(weighting="ghuber", ghuber_power=0.25, num_timesteps=2, adv_clip_max=5.0, kl_beta=0.1,
                                 timestep_sampling="shuffle", timestep_fraction=1.0, advantage_max=1.0, ema_beta=0.0)
    else:
        pairs = online_pairs(batch, torch.tensor([0.1, 0.9, 0.5, 0.2, 0.7, 0.3, 0.3, 0.8]))
        batch = torch.cat([pairs, pairs])  # 4 pairs
        batch["seeds"] = torch.arange(4)
        objective = DPOObjective(dpo_beta=50.0, num_timesteps=2)
    out_whole, out_split = assert_micro_batch_invariant(objective, batch)
    assert out_split["loss"] == pytest.approx(out_whole["loss"], rel=1e-5, abs=1e-7)


def test_online_pairs_take_best_and_worst_and_skip_ties(tiny_adapter):
    td = sample_trajectories(tiny_adapter, ["a red seven"] * 3 + ["a blue two"] * 3, settings=SamplerConfig(num_steps=2, kind="ode"), seeds=list(range(6)))
    pairs = online_pairs(td, torch.tensor([0.2, 0.9, 0.4, 0.5, 0.5, 0.5]))
    assert pairs.shape == (1,)  # the second group is all ties
    assert torch.equal(pairs["latents_w"][0], td["latents"][1, -1]) and torch.equal(pairs["latents_l"][0], td["latents"][0, -1])
    assert pairs["reward_gap"][0].item() == pytest.approx(0.7)


def _write_pairs(tmp_path, rows):
    from PIL import Image

    (tmp_path / "img").mkdir(exist_ok=True)
    for value in (0, 128, 255):
        Image.new("RGB", (16, 16), (value, 255 - value, 0)).save(tmp_path / "img" / f"{value}.png")
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _encode_pairs(path, adapter):
    worker = ActorRolloutRefWorker(WorkerConfig(model=ModelConfig(path=None), sampler=SamplerConfig(num_steps=2)))
    worker.init_model()
    worker.adapter = adapter
    return worker.encode_pairs(read_preference_pairs(path))


def test_offline_pairs_file_loading_and_errors(tmp_path, tiny_adapter):
    path = _write_pairs(tmp_path, [
        {"prompt": "a red seven", "image_0": "img/0.png", "image_1": "img/255.png", "label_0": 1},
        {"prompt": "a blue two", "image_0": "img/0.png", "image_1": "img/128.png", "label_0": 0},
        {"prompt": "a blue two", "image_0": "img/0.png", "image_1": "img/128.png", "label_0": 0.5},
    ])
    pairs = _encode_pairs(path, tiny_adapter)
    assert pairs.shape == (2,)  # the tie is skipped
    assert pairs["latents_w"][0, 0, 0, 0].item() == pytest.approx(-1.0)  # red channel 0 → latent −1
    assert pairs["latents_w"][1, 0, 0, 0].item() == pytest.approx(128 / 255 * 2 - 1, abs=1e-6)  # label 0: image_1 wins
    assert pairs["latents_l"][1, 0, 0, 0].item() == pytest.approx(-1.0)
    torch.testing.assert_close(pairs["cond"]["prompt_embeds"][1], tiny_adapter.encode_prompts(["a blue two"])["prompt_embeds"][0])
    bad = _write_pairs(tmp_path, [{"prompt": "a red seven", "image_0": "img/0.png", "image_1": "img/missing.png", "label_0": 1}])
    with pytest.raises(FileNotFoundError, match="missing.png"):
        read_preference_pairs(bad)
    bad = _write_pairs(tmp_path, [{"prompt": "a red seven", "image_0": "img/0.png", "label_0": 1}])
    with pytest.raises(ValueError, match="image_1"):
        read_preference_pairs(bad)


def _tiny_overrides(tmp_path, out, steps, *extra):
    return tiny_run_overrides(tmp_path, out, steps, PROMPTS, *extra)


def test_offline_dpo_trains_from_a_pair_file(tmp_path):
    path = _write_pairs(tmp_path, [
        {"prompt": p, "image_0": "img/0.png", "image_1": "img/255.png", "label_0": i % 2} for i, p in enumerate(PROMPTS * 2)
    ])
    cfg = compose(_tiny_overrides(tmp_path, tmp_path / "run", 2, "experiment=digits_dpo", f"algorithm.preference_pairs={path}"))
    summary = Trainer(cfg).fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["pairs"] for r in train] == [2, 2]
    assert train[0]["implicit_accuracy"] == 0.0 and train[0]["loss"] == pytest.approx(0.693147, abs=1e-5)  # model = reference
    assert train[1]["reward_margin"] > 0  # one update moved the model towards the winners
    assert summary["steps"] == 2


NFT = ("experiment=digits_nft", "algorithm.old_schedule=constant", "algorithm.old_decay_max=0.5", "algorithm.nft_num_timesteps=2")


def _train_records(run):
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time", "perf/")) and "seconds" not in k} for r in records if r["kind"] == "train"]


@pytest.mark.exact  # a resumed run against a straight one, bit for bit on the same kernels: not in the numerics rerun (conftest.py)
def test_nft_resume_restores_the_old_adapter_exactly(tmp_path):
    straight = tmp_path / "straight"
    Trainer(compose(_tiny_overrides(tmp_path, straight, 4, *NFT))).fit()
    resumed = tmp_path / "resumed"
    Trainer(compose(_tiny_overrides(tmp_path, resumed, 2, *NFT))).fit()
    # a checkpoint write cut by a kill leaves a temporary folder: it must be ignored
    (resumed / "checkpoints" / "step_000004.tmp-999").mkdir()
    with pytest.raises(RunFolderError, match="trainer.resume=auto"):
        Trainer(compose(_tiny_overrides(tmp_path, resumed, 4, *NFT)))
    Trainer(compose(_tiny_overrides(tmp_path, resumed, 4, *NFT, "trainer.resume=auto"))).fit()

    a = load_file(str(straight / "checkpoints" / "step_000004" / "model.safetensors"))
    b = load_file(str(resumed / "checkpoints" / "step_000004" / "model.safetensors"))
    old_keys = [k for k in a if ".old." in k]
    assert old_keys and a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert _train_records(straight) == _train_records(resumed)
    state = json.loads((resumed / "checkpoints" / "step_000004" / "state.json").read_text())
    assert state["global_step"] == 4 and state["window"]["count"] == 4


def test_stat_tracker_state_is_checkpointed(tmp_path):
    run = tmp_path / "run"
    Trainer(compose(_tiny_overrides(tmp_path, run, 2, "algorithm.adv_stat_tracker=true", "algorithm.adv_tracker_min_count=2"))).fit()
    tracker = json.loads((run / "checkpoints" / "step_000002" / "state.json").read_text())["advantages"]["tracker"]
    assert sorted(tracker["buffers"]) == sorted(PROMPTS)
    assert all(len(v) == 6 for v in tracker["buffers"].values())  # 2 steps × group of 3


def test_lr_schedules():
    cosine = OptimConfig(lr_schedule="cosine", warmup_steps=2)
    assert [round(lr_factor(s, cosine, 12), 6) for s in (0, 1, 2, 7, 12)] == [0.5, 1.0, 1.0, 0.5, 0.0]
    linear = OptimConfig(lr_schedule="linear")
    assert [lr_factor(s, linear, 10) for s in (0, 5, 10)] == pytest.approx([1.0, 0.5, 0.0])
    assert lr_factor(100, OptimConfig()) == 1.0
    with pytest.raises(ValueError, match="total number of optimizer steps"):
        lr_factor(0, OptimConfig(lr_schedule="cosine"))
