"""Mixed-precision full fine-tuning keeps fp32 master weights (issue 50, item 1; :mod:`diffrl.engine.precision`).

A tiny SD3 (the family's random config) takes one full fine-tuning AdamW step at lr 1e-5 on a fixed batch, from the
same starting weights (the bf16 rounding of one fp32 init):

* ``fp32``: the model in fp32, AdamW on fp32 weights: the reference update Δ_ref.
* ``bf16``: the model in bf16 (bf16 forward and backward) with fp32 masters: Δ_master = m₁ − m₀ must be Δ_ref up to
  the bf16 rounding of the forward (cosine > 0.99, norm within 3 %), and the bf16 weights must be round(m₁).
* ``pure bf16`` (what diffrl did before): AdamW stepping the bf16 weights with the same bf16 gradient.

Measured (torch 2.14, CPU): the masters' update has cosine 0.995 with Δ_ref and norm ratio 0.9999, and moves every
weight that has a gradient; pure bf16 AdamW leaves 96.8 % of those weights where they were, and what it applies is
98.7 % off (‖Δ_pure − Δ_ref‖ / ‖Δ_ref‖ = 0.987): nearly the whole update rounds away. Asserted: > 90 % unmoved, > 90 %
off. On two FSDP2 ranks: cosine 0.995 with Δ_ref, 0.9999 with the one-process masters.

The same bf16 step runs on two gloo ranks with FSDP2 (each rank's shard has its own fp32 master; gradients reduce-
scattered in fp32; the frozen reference sharded too) and matches the one-process masters; its checkpoint holds the
whole fp32 masters. A one-process
checkpoint resumes bit for bit. LoRA adapters on a bf16 base stay fp32 (no masters needed), float16 full fine-tuning
is refused before any work, and ``diffrl plan`` counts the masters.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from diffrl.config import LoraConfig, ModelConfig, OptimConfig, SamplerConfig
from helpers import start_ranks

LR = 1e-5
PROMPTS = ["a cat", "a dog"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_weights() -> dict[str, torch.Tensor]:
    """The tiny SD3's fp32 init rounded to bf16 (as fp32): the common start of every run."""
    from pipelines import build_adapter

    adapter = build_adapter("sd3", path=None, seed=0, dtype="bfloat16")
    return {n: p.detach().float().clone() for n, p in adapter.denoiser.named_parameters()}


def _engine(dtype: str, *, rank: int = 0, fsdp: bool = False, start: dict | None = None):
    """A full fine-tuning (or LoRA ``rank``) engine on the tiny SD3 in ``dtype``, starting from ``start``."""
    from diffrl.engine.engine import DiffusionEngine
    from pipelines import build_adapter

    adapter = build_adapter("sd3", path=None, seed=0, dtype=dtype)
    if start is not None:
        with torch.no_grad():
            for n, p in adapter.denoiser.named_parameters():
                p.copy_(start[n])
    model = ModelConfig(family="sd3", dtype=dtype, fsdp=fsdp, lora=LoraConfig(rank=rank, alpha=float(rank or 1)))
    engine = DiffusionEngine(adapter, model=model, optim=OptimConfig(lr=LR, max_grad_norm=0.0),
                             sampler=SamplerConfig(num_steps=2, guidance_scale=1.0, height=32, width=32))
    engine.initialize()
    return engine


def _batch(adapter):
    """Two recorded trajectories of two steps, the first one trained, fixed advantages."""
    from tensordict import TensorDict

    gen = torch.Generator().manual_seed(3)
    sigmas = adapter.schedule(2)
    return TensorDict({
        "latents": torch.randn(2, 3, *adapter.latent_shape(32, 32), generator=gen), "sigmas": sigmas.expand(2, 3).clone(),
        "sde_mask": torch.tensor([[True, False], [True, False]]), "cond": adapter.encode_prompts(PROMPTS),
        "advantages": torch.tensor([1.0, -0.5]),
    }, batch_size=[2])


def _step_loss(step: dict, batch, k: int):
    return -(step["log_prob"] * batch["advantages"]).mean(), {}


def _step(engine) -> dict:
    """One optimizer step; returns the weights the optimizer steps before and after it, their gradients (captured before
    the step, whole tensors) and the module's weights after it."""
    from diffrl.engine import parallel

    names = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    stepped = engine.stepped_parameters()
    before = [parallel.full_tensor(p.detach()).float().clone() for p in stepped]
    grads = []
    handle = engine.optimizer.register_step_pre_hook(lambda *_: grads.extend(parallel.full_tensor(p.grad).clone() for p in stepped))
    engine.train_batch(_batch(engine.adapter), _step_loss)
    handle.remove()
    after = [parallel.full_tensor(p.detach()).float().clone() for p in stepped]
    module = {n: parallel.full_tensor(p.detach()).clone() for n, p in engine.module.named_parameters() if p.requires_grad}
    return {"names": names, "before": dict(zip(names, before)), "after": dict(zip(names, after)), "grads": dict(zip(names, grads)), "module": module}


def _flat(d: dict) -> torch.Tensor:
    return torch.cat([d[n].flatten().double() for n in sorted(d)])


def _pure_bf16_update(run: dict) -> dict:
    """AdamW (as configured) stepping the bf16 weights directly with the run's bf16 gradient: the old behaviour."""
    params = {n: torch.nn.Parameter(run["before"][n].to(torch.bfloat16)) for n in run["names"]}
    for n, p in params.items():
        p.grad = run["grads"][n].to(torch.bfloat16)  # exact: the masters' gradient is one bf16 backward, upcast
    torch.optim.AdamW(list(params.values()), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0).step()
    return {n: p.detach().float() - run["before"][n] for n, p in params.items()}


def _agreement(update: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(cosine, norm ratio) of two flattened updates."""
    cosine = float(update @ reference / (update.norm() * reference.norm()))
    return cosine, float(update.norm() / reference.norm())


@pytest.fixture(scope="module")
def one_process():
    """The fp32 reference step and the bf16 step with masters, from the same start (one process)."""
    torch.set_num_threads(1)
    start = _start_weights()
    reference = _step(_engine("float32", start=start))
    engine = _engine("bfloat16")
    assert engine.master_weights is not None
    reference_log_probs = engine.infer_batch(_batch(engine.adapter), reference=True)["log_probs"]
    bf16 = _step(engine)
    return {"start": start, "fp32": reference, "bf16": bf16, "reference_log_probs": reference_log_probs}


def test_bf16_step_moves_the_fp32_master_like_an_fp32_step(one_process):
    ref, run = one_process["fp32"], one_process["bf16"]
    # the masters start at the common start, exactly, and the optimizer steps fp32 tensors
    assert all(torch.equal(run["before"][n], one_process["start"][n]) for n in run["names"])
    assert all(run["module"][n].dtype == torch.bfloat16 for n in run["names"])
    delta_ref = _flat({n: ref["after"][n] - ref["before"][n] for n in ref["names"]})
    delta_master = _flat({n: run["after"][n] - run["before"][n] for n in run["names"]})
    trained = delta_ref != 0  # (a weight without gradient moves in neither)
    cosine, ratio = _agreement(delta_master, delta_ref)
    assert cosine > 0.99 and abs(ratio - 1) < 0.03, (cosine, ratio)
    # the bf16 working copy is the masters rounded to nearest
    assert all(torch.equal(run["module"][n], run["after"][n].to(torch.bfloat16)) for n in run["names"])
    # pure bf16 AdamW on the same gradient: most weights do not move, and its update is far from the reference
    pure = _flat(_pure_bf16_update(run))
    unmoved = float((pure[trained] == 0).double().mean())
    off = float((pure - delta_ref).norm() / delta_ref.norm())
    moved_master = float((delta_master[trained] != 0).double().mean())
    print(f"one process: master vs fp32 update cosine {cosine:.5f}, norm ratio {ratio:.4f}; masters moved {moved_master:.1%} of the trained weights; "
          f"pure bf16 AdamW: {unmoved:.1%} of weights unmoved, ‖Δ_pure − Δ_ref‖/‖Δ_ref‖ = {off:.3f}")
    assert moved_master > 0.99
    assert unmoved > 0.9 and off > 0.9, (unmoved, off)


def test_gradients_accumulate_in_fp32_across_backwards():
    """Each backward's bf16 gradient is upcast into the master's and freed: ``g_m = fp32(g₁) + fp32(g₂)`` exactly, which a
    bf16 accumulation ``bf16(g₁ + g₂)`` is not."""
    from diffrl.engine.precision import MasterWeights

    layer = torch.nn.Linear(64, 64).to(torch.bfloat16)
    masters = MasterWeights(list(layer.named_parameters()))
    gen = torch.Generator().manual_seed(0)
    x1, x2 = (torch.randn(8, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    grads = []
    for x in (x1, x2):
        ref = torch.nn.Linear(64, 64).to(torch.bfloat16)
        ref.load_state_dict(layer.state_dict())
        ref(x).float().square().sum().backward()
        grads.append(ref.weight.grad.float())
        layer(x).float().square().sum().backward()
        assert layer.weight.grad is None  # moved into the master's
    summed = masters.masters["weight"].grad
    assert summed.dtype == torch.float32 and torch.equal(summed, grads[0] + grads[1])
    assert not torch.equal(summed, (grads[0] + grads[1]).to(torch.bfloat16).float())


def test_checkpoint_resumes_masters_bit_for_bit(tmp_path, one_process):
    from diffrl import checkpoint
    from safetensors.torch import load_file

    torch.set_num_threads(1)
    straight = _engine("bfloat16")
    batch = _batch(straight.adapter)
    straight.train_batch(batch, _step_loss)
    path = checkpoint.save_engine(straight, tmp_path, global_step=1)
    saved = load_file(str(path / "model.safetensors"))
    masters = {n: m.clone() for n, m in straight.master_state().items()}
    assert masters and all(saved[n].dtype == torch.float32 and torch.equal(saved[n], m) for n, m in masters.items())
    # the masters carry what bf16 cannot: after one lr-1e-5 step most differ from their rounding
    below = [bool((m != m.to(torch.bfloat16).float()).any()) for m in masters.values()]
    assert sum(below) > len(below) // 2
    state = {k: v.clone() for k, v in straight.optimizer.state[straight.stepped_parameters()[0]].items()}
    assert state["exp_avg"].dtype == torch.float32
    straight.train_batch(batch, _step_loss)

    resumed = _engine("bfloat16")
    checkpoint.load_engine(resumed, path)
    assert all(torch.equal(resumed.master_state()[n], m) for n, m in masters.items())
    assert all(torch.equal(v, resumed.optimizer.state[resumed.stepped_parameters()[0]][k]) for k, v in state.items())
    resumed.train_batch(batch, _step_loss)
    for name, m in straight.master_state().items():
        assert torch.equal(resumed.master_state()[name], m), name
    for (name, a), b in zip(straight.module.named_parameters(), resumed.module.parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(straight.stepped_parameters(), resumed.stepped_parameters()):
        sa, sb = straight.optimizer.state[a], resumed.optimizer.state[b]
        assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_lora_adapters_stay_fp32_on_a_bf16_base():
    torch.set_num_threads(1)
    engine = _engine("bfloat16", rank=4)
    lora_params = {n: p for n, p in engine.module.named_parameters() if "lora_" in n}
    assert lora_params and all(p.dtype == torch.float32 for p in lora_params.values())
    assert all(p.dtype == torch.bfloat16 for n, p in engine.module.named_parameters() if "lora_" not in n)
    # fp32 adapters are stepped as they are: no masters, the optimizer holds the adapters themselves
    assert engine.master_weights is None
    assert {id(p) for p in engine.stepped_parameters()} == {id(p) for p in engine.trainable_parameters()}


def test_float16_full_fine_tuning_is_refused_before_any_work():
    from diffrl.engine.engine import DiffusionEngine
    from pipelines import build_adapter

    adapter = build_adapter("sd3", path=None, seed=0, dtype="float16")
    engine = DiffusionEngine(adapter, model=ModelConfig(family="sd3", dtype="float16", lora=LoraConfig(rank=0)), optim=OptimConfig(lr=LR),
                             sampler=SamplerConfig(num_steps=2, height=32, width=32))
    with pytest.raises(ValueError, match=r"^model.dtype=float16: full fine-tuning .*without a loss scaler.*; use model.dtype=bfloat16"):
        engine.initialize()
    assert engine._reference_copy is None and engine.optimizer is None and not engine.initialized  # no copy made, nothing built


# -- two gloo ranks, FSDP2 --------------------------------------------------------------------------------------------
def _rank_main(rank: int, port: int, folder: str) -> None:
    from torch.distributed.tensor import DTensor

    from diffrl import checkpoint
    from diffrl.engine import parallel

    torch.set_num_threads(1)
    parallel.init_distributed(rank, 2, "127.0.0.1", port, "gloo", timeout_s=180)
    engine = _engine("bfloat16", fsdp=True)
    assert engine.sharded and engine.master_weights is not None
    params = [p for p in engine.module.parameters() if p.requires_grad]
    masters = engine.stepped_parameters()
    layout = {
        "params_bf16_dtensor": all(isinstance(p, DTensor) and p.dtype == torch.bfloat16 for p in params),
        "masters_fp32_dtensor": all(isinstance(m, DTensor) and m.dtype == torch.float32 and m.placements == p.placements for m, p in zip(masters, params)),
        "local_master_elements": sum(m.to_local().numel() for m in masters),
        "all_elements": sum(m.numel() for m in masters),
        "reference_sharded": all(isinstance(p, DTensor) for p in engine._reference_copy.denoiser.parameters()),
    }
    reference_log_probs = engine.infer_batch(_batch(engine.adapter), reference=True)["log_probs"]
    run = _step(engine)  # every rank the whole batch: FSDP2's mean over ranks is the one-process gradient
    layout["moments_fp32"] = all(engine.optimizer.state[m]["exp_avg"].dtype == torch.float32 for m in masters)
    checkpoint.save_engine(engine, Path(folder) / "ckpt", global_step=1)
    torch.save({"run": run, "layout": layout, "reference_log_probs": reference_log_probs}, Path(folder) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp_masters")
    start_ranks(_rank_main, (_free_port(), str(folder)))
    return folder, [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.ranks
def test_fsdp2_shards_fp32_masters_and_matches_one_process(two_ranks, one_process):
    folder, ranks = two_ranks
    for got in ranks:
        layout = got["layout"]
        assert layout["params_bf16_dtensor"] and layout["masters_fp32_dtensor"] and layout["moments_fp32"]
        assert layout["local_master_elements"] <= 0.55 * layout["all_elements"]  # each rank its shard's master
        # the frozen reference of full fine-tuning is sharded too, and scores as the whole one does
        assert layout["reference_sharded"]
        torch.testing.assert_close(got["reference_log_probs"], one_process["reference_log_probs"], rtol=1e-3, atol=1e-3)
    run, one = ranks[0]["run"], one_process["bf16"]
    assert all(torch.equal(ranks[1]["run"]["after"][n], run["after"][n]) for n in run["names"])
    ref = one_process["fp32"]
    delta_ref = _flat({n: ref["after"][n] - ref["before"][n] for n in ref["names"]})
    delta_fsdp = _flat({n: run["after"][n] - run["before"][n] for n in run["names"]})
    delta_one = _flat({n: one["after"][n] - one["before"][n] for n in one["names"]})
    cosine, ratio = _agreement(delta_fsdp, delta_ref)
    cosine_one, ratio_one = _agreement(delta_fsdp, delta_one)
    pure = _flat(_pure_bf16_update(run))
    unmoved = float((pure[delta_ref != 0] == 0).double().mean())
    print(f"FSDP2, 2 ranks: master vs fp32 update cosine {cosine:.5f}, norm ratio {ratio:.4f}; vs one process cosine {cosine_one:.6f}, "
          f"ratio {ratio_one:.5f}; pure bf16 AdamW: {unmoved:.1%} of weights unmoved")
    assert cosine > 0.99 and abs(ratio - 1) < 0.03, (cosine, ratio)
    assert cosine_one > 0.999 and abs(ratio_one - 1) < 0.01, (cosine_one, ratio_one)
    assert all(torch.equal(run["module"][n], run["after"][n].to(torch.bfloat16)) for n in run["names"])
    assert unmoved > 0.9
    # the sharded run's checkpoint holds the whole fp32 masters; a one-process engine loads them exactly
    from diffrl import checkpoint

    engine = _engine("bfloat16")
    checkpoint.load_engine(engine, folder / "ckpt" / "step_000001")
    for name, m in engine.master_state().items():
        assert m.dtype == torch.float32 and torch.equal(m, run["after"][name]), name
    exp_avg = engine.optimizer.state[engine.stepped_parameters()[0]]["exp_avg"]
    assert exp_avg.dtype == torch.float32 and exp_avg.abs().sum() > 0


# -- diffrl plan ------------------------------------------------------------------------------------------------------
def test_plan_counts_the_fp32_masters():
    """Full fine-tuning in bf16: 2 bytes a weight for the working copy, 4 for its master, 4 for its gradient and 8 for
    AdamW's two moments; a LoRA plan has no master category."""
    from diffrl.tools import plan as planner

    tiny = ["model=sd3_tiny", "+model.options.max_sequence_length=16", "sampler.height=32", "sampler.width=32", "trainer.prompts_per_step=1",
            "trainer.group_size=2", "model.dtype=bfloat16"]
    cfg, _ = planner.plan_config([*tiny, "model.lora.rank=0"], 1)
    c = planner.trace_recipe(cfg, 1).categories
    assert c["trainable"] > 0 and c["master_weights"] == 2 * c["trainable"]
    assert c["gradients"] == c["master_weights"] and c["optimizer"] == pytest.approx(2 * c["master_weights"], rel=1e-3)
    cfg, _ = planner.plan_config(tiny, 1)
    c = planner.trace_recipe(cfg, 1).categories
    assert "master_weights" not in c and c["gradients"] == c["trainable"]
