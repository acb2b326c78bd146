"""Sequence parallelism (``model.sequence_parallel``, Ulysses): k = 2 on two gloo ranks computes what k = 1 does.

Two CPU processes join a gloo group and split each video's tokens: the Wan and Wan2.2 transformers' outputs and LoRA
gradients, the engine's per-step log-probs and its gradients through FSDP2 equal one process's (fp32), and a recipe
on the Ray backend (2 ranks, one sequence-parallel group) trains the same LoRA with the same metrics as the local
worker. Bad settings are one-line errors before any worker starts.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch

from diffrl.config import ModelConfig, OptimConfig, SamplerConfig
from diffrl.recipes import compose
from helpers import start_ranks

PROMPTS = ["a cat", "a dog"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _close(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float = 1e-5, scale: float | None = None) -> tuple[float, float]:
    """Equal up to rounding: |got − want| ≤ rtol·scale, ``scale`` the largest |value| of ``want`` unless given (the
    tolerance scales with the values, never a bare absolute one); returns (max abs difference, that over the scale)."""
    assert got.shape == want.shape, what
    scale = want.abs().max().item() if scale is None else scale
    assert scale > 0, f"{what}: all zero, nothing compared"
    diff = (got - want).abs().max().item()
    assert diff <= rtol * scale, f"{what}: max |Δ| {diff:.3g} over max |value| {scale:.3g}"
    return diff, diff / scale


# -- the cases, run once by one process (k = 1) and once by each of two ranks (k = 2) ---------------------------------
def _lora_transformers(family: str, sp):
    """The family's tiny adapter with a LoRA whose B is random (so A has gradients too), split over ``sp`` if given."""
    from diffrl.engine import lora, sequence_parallel
    from pipelines import build_adapter

    adapter = build_adapter(family, path=None, seed=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # peft draws A from the global generator
        lora.attach_lora(adapter.denoiser, rank=4, alpha=4.0, dropout=0.0, target_modules=adapter.lora_target_modules)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sorted(adapter.denoiser.named_parameters()):
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    if sp is not None:
        for transformer in adapter.sequence_parallel_transformers():
            sequence_parallel.apply_wan(transformer, sp)
    return adapter


# latents of one video per family: Wan's 16×2×8×8 (32 tokens); the digits-video miniature's pixel clips 3×8×16×16 (64)
LATENTS = {"wan": (16, 2, 8, 8), "wan22": (16, 2, 8, 8), "digits_video": (3, 8, 16, 16)}


def _model_case(family: str, sp) -> dict:
    """One forward and backward of the denoiser on a batch of two videos (:data:`LATENTS`) at two noise
    levels (Wan2.2: one sample on each expert) with a fixed random cotangent; gradients summed over the group."""
    adapter = _lora_transformers(family, sp)
    module = adapter.denoiser
    gen = torch.Generator().manual_seed(2)
    latents = torch.randn(2, *LATENTS[family], generator=gen)
    text = torch.randn(2, 7, module.config.text_dim, generator=gen)
    timestep = torch.tensor([950.0, 300.0])
    out = module(hidden_states=latents, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]
    (out * torch.randn(out.shape, generator=gen)).sum().backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.requires_grad}
    if sp is not None:
        for g in grads.values():
            torch.distributed.all_reduce(g, group=sp.group)
    return {"output": out.detach(), **{f"grad/{n}": g for n, g in grads.items()}}


def _step_loss(step: dict, batch, k: int):
    """A policy-gradient loss on step ``k``'s log-probs with fixed advantages."""
    loss = -(step["log_prob"] * batch["advantages"]).mean()
    return loss, {"log_prob": step["log_prob"].mean().item()}


def _engine_case(sequence_parallel: int) -> dict:
    """A worker's engine: per-step log-probs of a recorded batch, then two optimizer steps (gradients captured before
    each step, no clipping), then the log-probs again."""
    from tensordict import TensorDict

    from diffrl.distributed.workers import TrainingWorker, WorkerConfig
    from diffrl.engine import parallel

    config = WorkerConfig(model=ModelConfig(family="wan", sequence_parallel=sequence_parallel),
                          sampler=SamplerConfig(num_steps=2, guidance_scale=5.0, height=32, width=32),
                          # eps 1e-3: Adam's first step is smooth in the gradient (with eps 1e-8 a near-zero element moves
                          # ±lr by its sign, which rounding can flip), so the second step's gradients compare tightly
                          optim=OptimConfig(lr=1e-2, eps=1e-3, max_grad_norm=0.0))
    worker = TrainingWorker(config)
    worker.reset()
    engine, adapter = worker.engine, worker.adapter
    named = list(engine.module.named_parameters())
    captured = []
    engine.optimizer.register_step_pre_hook(
        lambda *_: captured.append({n: parallel.full_tensor(p.grad).clone() for n, p in named if p.grad is not None}))
    gen = torch.Generator().manual_seed(3)
    sigmas = adapter.schedule(2)
    batch = TensorDict({
        "latents": torch.randn(2, 3, *adapter.latent_shape(32, 32), generator=gen), "sigmas": sigmas.expand(2, 3).clone(),
        "sde_mask": torch.ones(2, 2, dtype=torch.bool), "cond": adapter.encode_prompts(PROMPTS), "advantages": torch.tensor([1.0, -0.5]),
    }, batch_size=[2])
    before = engine.infer_batch(batch)["log_probs"]
    metrics = [engine.train_batch(batch, _step_loss)["metrics"] for _ in range(2)]
    after = engine.infer_batch(batch)["log_probs"]
    out = {"log_probs": before, "log_probs_after": after, "grad_norm": torch.tensor([m["grad_norm"] for m in metrics])}
    for i, grads in enumerate(captured):
        out.update({f"grad{i}/{n}": g for n, g in grads.items()})
    return out


def _rank_main(rank: int, port: int, folder: str) -> None:
    from diffrl.engine import parallel, sequence_parallel

    torch.set_num_threads(1)
    parallel.init_distributed(rank, 2, "127.0.0.1", port, "gloo", timeout_s=120)
    sp = sequence_parallel.new_groups(2)
    results = {}
    for family in LATENTS:
        results.update({f"{family}/{k}": v for k, v in _model_case(family, sp).items()})
    results.update({f"engine/{k}": v for k, v in _engine_case(2).items()})
    torch.save(results, Path(folder) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every k = 2 result of both ranks (one spawn of two gloo processes serves all parity tests)."""
    folder = tmp_path_factory.mktemp("sp")
    start_ranks(_rank_main, (_free_port(), str(folder)))
    return [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(2)]


def _one_process(prefix: str, case) -> dict:
    """``case()``'s results computed here, whole (k = 1), keyed as the ranks' are."""
    torch.set_num_threads(1)
    return {f"{prefix}/{k}": v for k, v in case().items()}


@pytest.mark.ranks
@pytest.mark.parametrize("family", list(LATENTS))
def test_transformer_outputs_and_lora_gradients_equal_one_rank(two_ranks, family):
    want = _one_process(family, lambda: _model_case(family, None))
    for rank, got in enumerate(two_ranks):
        # both ranks of the group return the whole prediction, bit for bit the same
        assert torch.equal(got[f"{family}/output"], two_ranks[0][f"{family}/output"])
    got = two_ranks[0]
    diffs = {"output": _close(got[f"{family}/output"], want[f"{family}/output"], "output")}
    grads = [k for k in want if k.startswith(f"{family}/grad/") and "lora" in k]
    assert grads and all(k in got for k in grads)
    for key in grads:
        diffs[key] = _close(got[key], want[key], key)
    if family == "wan22":  # one sample on each expert: both experts' LoRAs have gradients
        experts = {k.split("/")[-1].split(".")[0] for k in grads}
        assert experts == {"high", "low"}, experts
    worst = max(r for k, (_, r) in diffs.items() if k != "output")
    print(f"{family}: output max |Δ| {diffs['output'][0]:.2e}; LoRA gradients ({len(grads)} tensors) worst max |Δ| / max |value| {worst:.2e}")


@pytest.mark.ranks
def test_engine_log_probs_and_fsdp2_gradients_equal_one_rank(two_ranks):
    want = _one_process("engine", lambda: _engine_case(1))
    got = two_ranks[0]
    for key in ("log_probs", "log_probs_after"):
        assert torch.equal(two_ranks[1][f"engine/{key}"], got[f"engine/{key}"])
        _close(got[f"engine/{key}"], want[f"engine/{key}"], key)
    # the global gradient norm and every LoRA gradient (FSDP2 over both ranks, backwards scaled by k): a missing scale
    # would halve them
    _close(got["engine/grad_norm"], want["engine/grad_norm"], "grad_norm")
    grads = [k for k in want if "/grad" in k and "lora" in k]
    # the first step's A gradients are exactly 0 (B starts at 0); the second step's are not
    zero = [k for k in grads if k.startswith("engine/grad0/") and "lora_A" in k]
    assert zero and all(torch.count_nonzero(want[k]) == 0 and torch.count_nonzero(got[k]) == 0 for k in zero)
    grads = [k for k in grads if k not in zero]
    assert any(k.startswith("engine/grad1/") and "lora_A" in k for k in grads)
    # each tensor against the largest gradient of its step: the summation order of the all-to-all's and FSDP2's sums
    # moves an element by ~1e-7 of the terms summed, whatever that element's own size
    step_scale = {i: max(want[k].abs().max().item() for k in grads if k.startswith(f"engine/grad{i}/")) for i in (0, 1)}
    worst = max(_close(got[k], want[k], k, scale=step_scale[int(k.split("/")[1][4:])])[1] for k in grads)
    print(f"engine: log-probs max |Δ| {(got['engine/log_probs'] - want['engine/log_probs']).abs().max().item():.2e}, "
          f"grad norms {got['engine/grad_norm'].tolist()} vs {want['engine/grad_norm'].tolist()}; LoRA gradients ({len(grads)} tensors, two "
          f"steps) worst max |Δ| / the step's largest gradient {worst:.2e}")


# -- through the trainer ------------------------------------------------------------------------------------------
def _overrides(tmp_path, out, *extra) -> list[str]:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return ["experiment=wan_tiny_flow_grpo", "trainer.steps=2", "eval.every=100", "eval.seeds_per_prompt=1", "trainer.threads=1",
            "trainer.checkpoint_every=100", "trainer.progress=false", "trainer.wandb=disabled", f"trainer.prompts={prompts}",
            f"trainer.output_dir={out}", *extra]


def _train_records(run: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if "time" not in k and "seconds" not in k and not k.startswith("perf/")} for r in lines if r["kind"] == "train"]


@pytest.mark.ray
@pytest.mark.slow  # Ray actors: the slow tier (the gloo parity above is fast)
def test_ray_sequence_parallel_trains_what_the_local_worker_trains(tmp_path, ray_local):
    """``distributed.backend=ray distributed.num_workers=2 model.sequence_parallel=2``: one group of two ranks samples,
    scores and trains each video split in two; LoRA weights and per-step metrics equal the local worker's."""
    from diffrl.trainer import Trainer

    local = Trainer(compose(_overrides(tmp_path, tmp_path / "local")))
    local.fit()
    expected = local.workers.trainable_state()
    split = Trainer(compose(_overrides(tmp_path, tmp_path / "sp", "distributed.backend=ray", "distributed.num_workers=2", "model.sequence_parallel=2")))
    try:
        assert (split.workers.world_size, split.workers.dp_size) == (2, 1)
        split.fit()
        got = split.workers.trainable_state()
    finally:
        split.close()
    assert got.keys() == expected.keys() and expected
    moved = max(expected[k].abs().max().item() for k in expected if "lora_B" in k)
    assert moved > 1e-4  # the LoRA did train
    # as tests/test_scale_out.py: the runs differ in gradient summation order (~1e-7 relative), which Adam can magnify on
    # near-zero gradients to a visible share of one step: 1 % of the largest LoRA movement (a wrong split moves 50–100 %)
    worst = 0.0
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-2 * moved)
        worst = max(worst, (got[key] - expected[key]).abs().max().item())
    a, b = _train_records(tmp_path / "local"), _train_records(tmp_path / "sp")
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for key, value in ra.items():
            if isinstance(value, float) and key != "ratio_std":  # ratio_std: a per-rank std averaged over groups
                assert rb[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    print(f"trainer: LoRA max |Δ| {worst:.2e} (largest movement {moved:.2e}); rewards {[r.get('reward_mean') for r in b]}")
    # the sequence-parallel run's checkpoint samples in one local process (diffrl sample: whole videos, the same weights)
    from diffrl.tools.cli import main

    for name in ("local", "sp"):
        assert main(["sample", "--run", str(tmp_path / name), "--prompts", "a cat", "--seeds", "3", "--out", str(tmp_path / f"sample_{name}")]) == 0
    a, b = (json.loads((tmp_path / f"sample_{name}" / "samples.json").read_text())["samples"] for name in ("local", "sp"))
    assert len(a) == len(b) == 1 and a[0]["rewards"].keys() == b[0]["rewards"].keys()
    for key, value in a[0]["rewards"].items():
        assert b[0]["rewards"][key] == pytest.approx(value, rel=1e-3), key


# -- bad input ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, message", [
    (["model.sequence_parallel=2"], r"model.sequence_parallel=2 needs ranks in groups of 2: distributed.backend=ray"),
    (["distributed.backend=ray", "distributed.num_workers=2", "model.sequence_parallel=4"], r"distributed.num_workers a multiple of 4"),
    (["distributed.backend=ray", "distributed.num_workers=4", "model.sequence_parallel=4", "trainer.group_size=4"],
     r"must divide the transformer's 2 attention heads; valid: \[1, 2\]"),
    (["distributed.backend=ray", "distributed.num_workers=2", "model.sequence_parallel=2", "+model.options.num_frames=1", "sampler.height=48",
      "sampler.width=48"], r"must divide the 9 video tokens per sample .*valid: \[1, 3, 9\]"),
    (["model=digits", "model.sequence_parallel=2"], r"model family 'digits' is not a video family"),
])
def test_bad_sequence_parallel_settings_fail_before_any_worker(tmp_path, capsys, extra, message):
    """Each refusal is one line with exit status 2, before any worker or Ray starts and before the run folder exists."""
    import re

    import ray

    from diffrl.tools.cli import main

    out = tmp_path / "run"
    assert main(["train", *_overrides(tmp_path, out, *extra)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("diffrl: error: ") and re.search(message, err[0]), err
    assert not ray.is_initialized() and not out.exists()


def test_group_size_below_one_is_a_config_error(tmp_path):
    from diffrl.recipes import ConfigError, validate

    with pytest.raises(ConfigError, match=r"model.sequence_parallel=0 is invalid: it must be"):
        validate(compose(_overrides(tmp_path, tmp_path / "run", "model.sequence_parallel=0")))


def test_batch_sizes_split_over_data_parallel_groups_not_ranks():
    """4 ranks in groups of k = 2 are 2 data-parallel groups: 6 trajectories (3 × 2) split over them although not over 4
    ranks; 3 trajectories split over neither, and the error names the groups."""
    from diffrl.recipes import check_sizes

    base = ["experiment=wan_tiny_flow_grpo", "distributed.backend=ray", "distributed.num_workers=4", "model.sequence_parallel=2",
            "trainer.group_size=2"]
    check_sizes(compose(base + ["trainer.prompts_per_step=3"]))
    with pytest.raises(ValueError, match="cannot be split evenly over distributed.num_workers=4:"):
        check_sizes(compose(base[:-2] + ["model.sequence_parallel=1", "trainer.group_size=2", "trainer.prompts_per_step=3"]))
    with pytest.raises(ValueError, match=r"over 2 data-parallel groups \(distributed.num_workers=4 / model.sequence_parallel=2\)"):
        check_sizes(compose(base[:-1] + ["trainer.group_size=3", "trainer.prompts_per_step=1"]))
