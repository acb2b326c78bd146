"""``diffrl plan`` (issue 35): the fake-tensor trace against real runs, the H200 measurements, and bad input."""

from __future__ import annotations

import contextlib
import json
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from diffrl.tools import plan as planner
from diffrl.tools.cli import main

pytestmark = pytest.mark.exact  # fake-tensor traces: byte and FLOP counts, no float kernels compared (conftest.py)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "parity"))
import plan_vs_measured  # noqa: E402  (benchmarks/parity/plan_vs_measured.py: the comparison itself)


class RealBytes(TorchDispatchMode):
    """Live bytes of real CPU tensors (each storage once, freed when Python frees it): the real run's tracker."""

    def __init__(self):
        super().__init__()
        self.seen = WeakIdKeyDictionary()
        self.current = self.peak = 0
        self.phases = {}

    def _free(self, n):
        self.current -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                if st not in self.seen:
                    self.seen[st] = True
                    self.current += st.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(st, self._free, st.nbytes())
        return out

    @contextlib.contextmanager
    def phase(self, name):
        start = self.peak = self.current
        yield
        self.phases[name] = {"start": start, "peak": self.peak, "after": self.current}


def _fake_phases(tr):
    out, level = {}, 0
    for name, p in tr.phases.items():
        out[name] = {"start": level, "peak": p["peak_bytes"], "after": p["after_bytes"]}
        level = p["after_bytes"]
    return out


SP_TINY = ["experiment=wan_tiny_flow_grpo", "+model.options.num_frames=9", "sampler.height=64", "sampler.width=64", "trainer.prompts_per_step=2",
           "trainer.group_size=4"]  # 3 latent frames × 4 × 4 patches = 48 video tokens per sample, 2 heads


@pytest.mark.parametrize("overrides,gpus", [
    ([], 1),  # the default digits recipe: LoRA, Flow-GRPO
    (["model=sd3_tiny", "+model.options.max_sequence_length=16", "sampler.height=32", "sampler.width=32", "sampler.guidance_scale=4.5",
      "model.activation_checkpointing=true", "algorithm.micro_batch_size=4", "trainer.prompts_per_step=2", "trainer.group_size=4"], 1),
    ([*SP_TINY, "model.sequence_parallel=2"], 2),  # one rank of a sequence-parallel pair: half of each sample's tokens
])
def test_trace_equals_the_real_run_at_tiny_shape(overrides, gpus):
    """The same step on fake tensors (the plan) and on real ones (a live-storage tracker): parameters, every
    phase's peak above its start and the bytes left after it agree within 10 % (CPU bytes, no 512-byte rounding).
    With sequence parallelism both run one rank of the group, its collectives as local copies of the same shapes."""
    cfg, _ = planner.plan_config(overrides, gpus)
    tr = planner.trace_recipe(cfg, gpus, allocation_unit=1)
    fake = _fake_phases(tr)
    real = RealBytes()
    torch.manual_seed(0)
    with real, planner._local_collectives():
        sizes = planner.step_recipe(cfg, gpus, real.phase)
    params = sum(v for k, v in sizes["categories"].items() if k not in ("gradients", "optimizer"))
    assert sizes["categories"]["optimizer"] == pytest.approx(2 * sizes["categories"]["trainable"], rel=0.01)  # AdamW: two moments
    assert real.phases["build"]["after"] == pytest.approx(params, rel=0.10)  # the tracker sees every parameter
    for name, r in real.phases.items():
        f = fake[name]
        assert f["after"] == pytest.approx(r["after"], rel=0.10), name
        if name == "build":  # loading weights passes through copies whose life differs; the plan reports no build peak
            continue
        assert f["peak"] == pytest.approx(r["peak"], rel=0.10), name
        assert f["peak"] - f["after"] == pytest.approx(r["peak"] - r["after"], rel=0.10), name  # the transient: activations, buffers
    assert tr.phases["train"]["peak_bytes"] > tr.phases["build"]["after_bytes"] + sizes["categories"]["gradients"]  # activations above the weights
    assert tr.categories["optimizer"] == sizes["categories"]["optimizer"] > 0


def test_sequence_parallel_plans_half_the_transformer_per_rank():
    """``model.sequence_parallel=2`` on 2 GPUs against 1 GPU whole: the same samples per rank and per step, each rank's
    training FLOPs (the transformer alone) about half — all but the patch embedding, the condition embedders and the
    text's cross-attention keys and values, which every rank of the pair computes whole — and its training activations
    lower; the rollout (VAE decode and text encoder whole on each rank) falls by less."""
    one = planner.plan(SP_TINY, gpus=1, recommend=False)
    two = planner.plan([*SP_TINY, "model.sequence_parallel=2"], gpus=2, recommend=False)
    assert two["images_per_step"] == one["images_per_step"] == 8
    train = two["train_flops"] / one["train_flops"]
    assert 0.5 < train < 0.6, train
    rollout = two["rollout_flops"] / one["rollout_flops"]
    assert train < rollout < 1.0, (train, rollout)
    assert two["phases_gib"]["train"] < one["phases_gib"]["train"]
    assert two["sequence_parallel"] == 2 and "each sample's tokens split over 2 of them" in planner.report(two)


def test_trace_flops_closed_forms():
    """Executed FLOPs on fake tensors: a linear layer 2·M·K·N (+ its two backward matmuls for weight and input
    gradients), the CPU-fake fused attention 4·B·H·L²·D forward (not in torch's registry; the GPU kernels are)."""
    B, H, L, D, M, K, N = 2, 3, 64, 16, 32, 48, 40
    with planner.tracing.shape_trace() as trace:
        x = torch.randn(M, K, requires_grad=True)
        w = torch.randn(N, K, requires_grad=True)
        with trace.phase("linear"):
            y = torch.nn.functional.linear(x, w)
        with trace.phase("backward"):
            y.sum().backward()
        q, k, v = (torch.randn(B, H, L, D) for _ in range(3))
        with trace.phase("attention"):
            torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert trace.phases["linear"]["flops"] == 2 * M * K * N
    assert trace.phases["backward"]["flops"] == 2 * (2 * M * K * N)
    assert trace.phases["attention"]["flops"] == 4 * B * H * L * L * D
    # live bytes after the linear layer: x, w and its output y, each rounded up to CUDA's 512-byte blocks
    def block(n):
        return -(-n // 512) * 512

    assert trace.phases["linear"]["after_bytes"] == block(M * K * 4) + block(N * K * 4) + block(M * N * 4)


@pytest.mark.slow
def test_plan_against_the_h200_measurements(tmp_path):
    """One landed H200 run with a training measurement per model (``benchmarks/parity/plan_vs_measured.py`` compares them
    all): the plan of the same configuration within ±15 % of the measured peak, and its step time at the run's
    measured MFU within ±20 % of the measured one."""
    rows = list({row["shape"]: row for row in reversed(plan_vs_measured.measurements())}.values())  # each shape's first run
    assert len(rows) >= 5
    for row in rows:
        r = plan_vs_measured.compare(row, tmp_path)
        assert abs(r["peak_error"]) <= 0.15, r
        assert abs(r["step_error"]) <= 0.20, r


def test_recommends_the_cheapest_change_that_fits():
    """A budget below the default recipe's peak: the plan says it does not fit and names a change whose plan fits;
    a budget below the weights themselves: nothing tried fits."""
    full = planner.plan([], recommend=False)
    budget = full["peak_gib"] * 0.8
    r = planner.plan([], gpu_memory_gb=budget)
    assert not r["fits"] and r["recommendation"] is not None
    assert r["recommendation"]["peak_gib"] <= budget < r["peak_gib"]
    assert "DOES NOT FIT" in planner.report(r)
    nothing = planner.plan([], gpu_memory_gb=full["resident_gib"]["weights"] / 100)
    assert nothing["recommendation"] is None and "nothing tried fits" in planner.report(nothing)


def test_sharding_divides_state_and_time_scales():
    """FSDP2 over N ranks: per-rank sharded state is 1/N (plus two gathered blocks); the step's FLOPs per rank fall
    with the per-rank batch, so the estimated seconds do too."""
    one = planner.plan(["trainer.prompts_per_step=4"], recommend=False)
    two = planner.plan(["trainer.prompts_per_step=4"], gpus=2, recommend=False)
    assert two["fsdp_sharded"] and not one["fsdp_sharded"]
    assert two["resident_gib"]["weights"] == pytest.approx(one["resident_gib"]["weights"] / 2, rel=1e-6)
    assert two["resident_gib"]["optimizer"] == pytest.approx(one["resident_gib"]["optimizer"] / 2, rel=1e-6)
    assert two["rollout_flops"] == pytest.approx(one["rollout_flops"] / 2, rel=0.02)
    assert two["step_s"] == pytest.approx(one["step_s"] / 2, rel=0.02)
    assert two["images_per_step"] == one["images_per_step"]


def test_cli_and_bad_input(capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert main(["plan", "--gpus", "2", "--gpu", "h200", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "peak per GPU" in printed and "images/s" in printed
    saved = json.loads(out.read_text())
    assert saved["gpus"] == 2 and saved["gpu"] == "h200" and saved["fits"]
    for argv, words in [
        (["plan", "--gpu", "v100"], "unknown GPU 'v100'"),
        (["plan", "--gpus", "5"], "cannot be split evenly over distributed.num_workers=5"),
        (["plan", "model=sd3_tiny", "+model.options.shape=flux_dev"], "has no shape 'flux_dev'"),
        (["plan", "model=sd3_tiny", "model.path=someone/not-a-published-model"], "is not a published shape of family 'sd3'"),
        (["plan", "--mfu", "1.5"], "--mfu must be in (0, 1]"),
        (["plan", "experiment=wan_tiny_flow_grpo", "model.sequence_parallel=2", "--gpus", "3"], "--gpus must be a multiple of 2, got 3"),
        (["plan", "model.sequence_parallel=2", "--gpus", "2"], "model family 'digits' is not a video family"),
        (["plan", "experiment=wan_tiny_flow_grpo", "model.sequence_parallel=2", "model.fsdp=false", "--gpus", "2"], "add model.fsdp=true"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("diffrl: error:") and words in err[0], err


def test_published_recipe_plans_from_its_hub_id():
    """A published recipe names a Hub repo: the plan builds its published shape (no download) and the MFU it
    uses is the H200 measurement of that model."""
    cfg, shape = planner.plan_config(["experiment=sd35m_pickscore_flow_grpo"], 8)
    assert shape == "sd35_medium" and cfg.model.path is None
    rollout, train, source = planner.mfu_for("sd35_medium", False, None)
    assert (rollout, train) == planner.MEASURED_MFU[("sd35_medium", False)][:2] and "H200" in source
    assert planner.mfu_for("qwen_image_edit", True, None)[2].endswith("(qwen_image's)")


def test_train_warns_before_a_gpu_run_that_does_not_fit():
    """The check ``diffrl train`` runs first on GPU runs: a warning (not a refusal) naming the peak and a fix;
    nothing with trainer.plan_check=false or on a CPU run."""
    from diffrl.recipes import compose

    overrides = ["model.device=cuda"]
    cfg = compose(overrides)
    warning = planner.preflight(overrides, cfg, memory_gib=0.001, device_name="NVIDIA H100 80GB HBM3")
    assert warning.startswith("diffrl: warning:") and "above the device's 0.0 GiB" in warning and "plan_check=false" in warning
    assert planner.preflight(overrides, cfg, memory_gib=80.0, device_name="NVIDIA H100 80GB HBM3") is None
    off = ["model.device=cuda", "trainer.plan_check=false"]
    assert planner.preflight(off, compose(off), memory_gib=0.01) is None
    assert planner.preflight([], compose([]), memory_gib=0.01) is None  # a CPU run
    assert planner.gpu_kind("NVIDIA H200") == "h200" and planner.gpu_kind("NVIDIA A100-SXM4-40GB").startswith("a100")
