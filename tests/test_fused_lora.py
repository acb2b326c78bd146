"""``model.fuse_lora_rollout``: the active LoRA adapter folded into the base weights for rollouts
(``diffrl.engine.lora.FusedWeights``), and ``model.compile_vae``: the VAE decoder compiled with the denoiser."""

from __future__ import annotations

import pytest
import torch
from helpers import make_engine

from diffrl.config import LoraConfig, ModelConfig, SamplerConfig
from diffrl.distributed.workers import ActorRolloutRefWorker, WorkerConfig
from diffrl.engine import lora
from diffrl.recipes import compose
from diffrl.sampling.rollout import sample_trajectories
from diffrl.sampling.seeding import Stream, derive
from diffrl.recipes import check_sizes
from pipelines import build_adapter
from pipelines.digits import DigitsAdapter
from tests.conftest import randomise_lora
from tests.test_workers import _request

PROMPTS = ["a red seven", "a red seven", "a blue two", "a blue two"]
SEEDS = [derive(0, Stream.ROLLOUT, 0, i // 2, i % 2) for i in range(4)]


def _engine(**model_options):
    adapter = DigitsAdapter(path=None, seed=0)
    settings = SamplerConfig(num_steps=3, kind="flow_sde", noise_level=0.7, guidance_scale=3.0)
    engine = make_engine(adapter, settings, lora_rank=4, **model_options)
    engine.initialize()
    randomise_lora(engine.module, scale=0.2)
    return adapter, engine, settings


def _lora_calls(module) -> list[int]:
    """A counter of forward calls into every ``lora_A`` module."""
    calls = [0]
    for name, m in module.named_modules():
        if name.endswith("lora_A.default"):
            m.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_fused_rollout_equals_unfused_and_restores_weights_exactly():
    adapter, engine, settings = _engine(fuse_lora_rollout=True)
    module = engine.module
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    plain = sample_trajectories(adapter, PROMPTS, settings=settings, seeds=SEEDS)
    calls = _lora_calls(module)
    with torch.no_grad(), engine.rollout_weights():
        fused = sample_trajectories(adapter, PROMPTS, settings=settings, seeds=SEEDS)
        # inside, every LoRA layer's base weight is W + scale·B·A and the LoRA path does not run
        layer = engine._fused.layers()[0]
        base = layer.get_base_layer().weight
        expect = before[[n for n in before if n.endswith(".base_layer.weight")][0]]
        delta = layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
        assert (delta.abs() > 1e-3).any()
        torch.testing.assert_close(base, expect + delta, rtol=0, atol=1e-6)
        address = base.data_ptr()
    assert calls[0] == 0, "the LoRA path ran inside the fused context"
    # the same trajectories up to float32 rounding of the fused weights, not the base model's
    torch.testing.assert_close(fused["latents"], plain["latents"], rtol=0, atol=1e-5)
    torch.testing.assert_close(fused["log_probs"], plain["log_probs"], rtol=0, atol=1e-4)
    with lora.adapters_disabled(module):
        base_model = sample_trajectories(adapter, PROMPTS, settings=settings, seeds=SEEDS)
    assert (fused["latents"] - base_model["latents"]).abs().max() > 1e-2
    # after: the base weights are the very tensors from before, bit for bit; the LoRA path runs again
    for n, p in module.named_parameters():
        assert torch.equal(p, before[n]), n
    assert all(not m.merged for m in engine._fused.layers())
    sample_trajectories(adapter, PROMPTS[:1], settings=settings, seeds=SEEDS[:1])
    assert calls[0] > 0
    # a second fusion reuses the buffers (CUDA graphs recorded on them stay valid) and follows the trained LoRA
    randomise_lora(module, scale=0.3, seed=1)
    with torch.no_grad(), engine.rollout_weights():
        assert base.data_ptr() == address
        delta = layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
        torch.testing.assert_close(base, expect + delta, rtol=0, atol=1e-6)


def test_fused_context_follows_the_active_adapter_and_refuses_gradients():
    adapter, engine, settings = _engine(fuse_lora_rollout=True)
    lora.copy_adapter(engine.module, "default", "old")
    randomise_lora(engine.module, scale=0.3, seed=5)  # default and old now differ (copy_adapter copied before)
    for p in lora.adapter_parameters(engine.module, "old").values():
        p.data.mul_(-1.0)
    with lora.adapter_active(engine.module, "old"):
        plain_old = sample_trajectories(adapter, PROMPTS, settings=settings, seeds=SEEDS)
        with torch.no_grad(), engine.rollout_weights():
            fused_old = sample_trajectories(adapter, PROMPTS, settings=settings, seeds=SEEDS)
    plain_default = sample_trajectories(adapter, PROMPTS, settings=settings, seeds=SEEDS)
    torch.testing.assert_close(fused_old["latents"], plain_old["latents"], rtol=0, atol=1e-5)
    assert (fused_old["latents"] - plain_default["latents"]).abs().max() > 1e-2
    with pytest.raises(RuntimeError, match="gradient-free"):
        with engine.rollout_weights():
            pass


def test_fuse_lora_rollout_needs_a_lora_adapter():
    adapter = DigitsAdapter(path=None, seed=0)
    engine = make_engine(adapter, SamplerConfig(num_steps=2), lora_rank=0, fuse_lora_rollout=True)
    with pytest.raises(ValueError, match="needs a LoRA adapter"):
        engine.initialize()


def test_sharded_weights_sample_unfused():
    """FSDP2-sharded actor ranks (evaluation beside rollout replicas) sample through the LoRA path, unfused."""
    adapter, engine, settings = _engine(fuse_lora_rollout=True)
    engine.sharded = True  # what apply_fsdp sets; the weights stay whole here, the engine must not fuse them anyway
    calls = _lora_calls(engine.module)
    with torch.no_grad(), engine.rollout_weights():
        sample_trajectories(adapter, PROMPTS[:1], settings=settings, seeds=SEEDS[:1])
    assert calls[0] > 0 and not any(m.merged for m in engine._fused.layers())


def test_bad_fuse_settings_fail_before_any_work():
    with pytest.raises(ValueError, match=r"model.fuse_lora_rollout=true needs a LoRA adapter"):
        check_sizes(compose(["model.fuse_lora_rollout=true", "model.lora.rank=0"]))
    with pytest.raises(ValueError, match=r"model.fuse_lora_rollout=true with distributed.num_workers=2: .*sharded"):
        check_sizes(compose(["model.fuse_lora_rollout=true", "distributed.num_workers=2", "distributed.backend=ray"]))
    # sampling on replicas (whole weights) while the actor ranks are sharded is allowed
    check_sizes(compose(["model.fuse_lora_rollout=true", "distributed.num_workers=2", "distributed.backend=ray", "distributed.rollout_replicas=1"]))


def test_worker_rollout_with_fused_lora_matches_and_trains():
    def worker(fuse: bool):
        cfg = WorkerConfig(model=ModelConfig(family="digits", path=None, lora=LoraConfig(rank=4), fuse_lora_rollout=fuse),
                           sampler=SamplerConfig(num_steps=3, noise_level=0.7))
        w = ActorRolloutRefWorker(cfg, role="actor_rollout_ref")
        w.init_model()
        randomise_lora(w.engine.module, scale=0.2)
        return w

    unfused, fused = worker(False), worker(True)
    plain, traj = unfused.generate_sequences(_request()), fused.generate_sequences(_request())
    # the MFU counter counts the fused rollout without its LoRA matmuls, training with them
    assert unfused.flops_counter().rollout_sample_flops is None
    counter = fused.flops_counter()
    assert counter.rollout_sample_flops < counter.sample_flops
    torch.testing.assert_close(traj["latents"], plain["latents"], rtol=0, atol=1e-5)
    # the training pass (unfused) recomputes the fused rollout's log-probs to float32 rounding
    del traj["metrics"]
    recomputed = fused.infer_actor_batch(traj.clone())["log_probs"]
    torch.testing.assert_close(recomputed, traj["log_probs"], rtol=0, atol=1e-4)


def test_compile_decoder_compiles_an_autoencoder_kl_and_keeps_its_output():
    adapter = build_adapter("sd3", shape="tiny", dtype="float32", device="cpu")
    latents = torch.randn(2, *adapter.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    eager = adapter.decode(latents)
    torch._dynamo.reset()
    assert adapter.compile_decoder(backend="eager")
    assert adapter.vae.decoder._compiled_call_impl is not None
    torch.testing.assert_close(adapter.decode(latents), eager, rtol=0, atol=1e-6)
    torch._dynamo.reset()
    assert not DigitsAdapter(path=None, seed=0).compile_decoder(backend="eager")  # pixel space: nothing to compile
