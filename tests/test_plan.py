"""``diffrl plan`` (issue 35): the fake-tensor trace against real runs, the H200 measurements, and bad input."""

from __future__ import annotations

import contextlib
import dataclasses
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


@pytest.fixture(autouse=True, scope="module")
def one_trace_per_tiny_recipe():
    """A recipe at tiny shape (no ``model.options.shape``: nothing here patches it) is traced once per test process and
    the copy returned to every later plan of the same resolved config: the default recipe was traced six times here,
    ~7 s each (a plan's recommendation re-plans the recipe it starts from)."""
    import copy

    from omegaconf import OmegaConf

    traced, original = {}, planner.trace_recipe

    def trace_recipe(cfg, gpus, **kwargs):
        if (cfg.model.options or {}).get("shape") not in (None, "tiny"):
            return original(cfg, gpus, **kwargs)
        key = (OmegaConf.to_yaml(cfg), gpus, tuple(sorted(kwargs.items())))
        if key not in traced:
            traced[key] = original(cfg, gpus, **kwargs)
        return copy.deepcopy(traced[key])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(planner, "trace_recipe", trace_recipe)
        yield


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


@pytest.mark.slow(seconds=69)
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


def test_named_variants_of_a_run_plan_with_their_own_settings():
    """``--variants``: each named variant of a file that trained becomes a row (FP8 rollouts and full fine-tuning too),
    planned with what its label changes; the default stays one plain variant per file."""
    assert plan_vs_measured.variant_overrides("compiled_fp8") == ["model.rollout_precision=fp8"]
    assert plan_vs_measured.variant_overrides("compiled_fuse") == ["model.fuse_lora_rollout=true"]
    assert plan_vs_measured.variant_overrides("compiled_full") == ["model.lora.rank=0"]
    assert plan_vs_measured.variant_overrides("eager") == []
    path = str(Path(__file__).resolve().parents[1] / "benchmarks/results/gpu_scale_sd35m_fp8fold_full_h200.json")
    rows = plan_vs_measured.measurements(path, variants=("compiled_fp8", "compiled_full", "reference"))
    assert [r["variant"] for r in rows] == ["compiled_fp8", "compiled_full"]  # the reference trained nothing
    assert rows[1]["peak_gib"] == 51.38 and rows[1]["step_s"] == pytest.approx(rows[1]["rollout_s"] + rows[1]["train_s"])
    assert [r["variant"] for r in plan_vs_measured.measurements(path)] == ["compiled_fp8"]


def test_recommends_the_cheapest_change_that_fits():
    """A budget below the default recipe's peak: the plan says it does not fit and names a change whose plan fits;
    a budget below the weights themselves: nothing tried fits."""
    short = ["sampler.num_steps=3", "trainer.prompts_per_step=2", "trainer.group_size=2"]  # the default recipe, smaller: a fifth of the trace
    full = planner.plan(short, recommend=False)
    budget = full["peak_gib"] * 0.8
    r = planner.plan(short, gpu_memory_gb=budget)
    assert not r["fits"] and r["recommendation"] is not None
    assert r["recommendation"]["peak_gib"] <= budget < r["peak_gib"]
    assert "DOES NOT FIT" in planner.report(r)
    nothing = planner.plan(short, gpu_memory_gb=full["resident_gib"]["weights"] / 100)
    assert nothing["recommendation"] is None and "nothing tried fits" in planner.report(nothing)


def test_sharding_divides_state_and_time_scales():
    """FSDP2 over N ranks: per-rank sharded state is 1/N (plus two gathered blocks); the step's FLOPs per rank fall
    with the per-rank batch, so the estimated seconds do too."""
    one = planner.plan(["trainer.prompts_per_step=4", "trainer.group_size=2", "sampler.num_steps=3"], recommend=False)
    two = planner.plan(["trainer.prompts_per_step=4", "trainer.group_size=2", "sampler.num_steps=3"], gpus=2, recommend=False)
    assert two["fsdp_sharded"] and not one["fsdp_sharded"]
    assert two["resident_gib"]["weights"] == pytest.approx(one["resident_gib"]["weights"] / 2, rel=1e-6)
    assert two["resident_gib"]["optimizer"] == pytest.approx(one["resident_gib"]["optimizer"] / 2, rel=1e-6)
    assert two["rollout_flops"] == pytest.approx(one["rollout_flops"] / 2, rel=0.02)
    assert two["step_s"] == pytest.approx(one["step_s"] / 2, rel=0.02)
    assert two["images_per_step"] == one["images_per_step"]


def test_cli_and_bad_input(capsys, tmp_path, monkeypatch):
    out = tmp_path / "plan.json"
    assert main(["plan", "trainer.prompts_per_step=2", "trainer.group_size=2", "--gpus", "2", "--gpu", "h200", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "peak per GPU" in printed and "images/s" in printed
    saved = json.loads(out.read_text())
    assert saved["gpus"] == 2 and saved["gpu"] == "h200" and saved["fits"]
    monkeypatch.setattr(planner, "trace_recipe", lambda *a, **k: pytest.fail("bad input traced the recipe before its error"))
    for argv, words in [
        (["plan", "--gpu", "v100"], "unknown GPU 'v100'"),
        (["plan", "--gpus", "5"], "cannot be split evenly over distributed.num_workers=5"),
        (["plan", "model=sd3_tiny", "+model.options.shape=flux_dev"], "has no shape 'flux_dev'"),
        (["plan", "model=sd3_tiny", "model.path=someone/not-a-published-model"], "is not a published shape of family 'sd3'"),
        (["plan", "--mfu", "1.5"], "--mfu must be in (0, 1]"),
        (["plan", "--peak-tflops", "0"], "--peak-tflops must be > 0"),
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


# the text encoders of each published shape: families → the TEXT_ENCODER_PARAMS keys of what its pipeline loads
_TEXT_SIDE = {"sd3": ("clip_l", "clip_g", "t5"), "flux": ("clip_l_unprojected", "t5"), "flux_kontext": ("clip_l_unprojected", "t5"),
              "qwen_image": ("qwen2_5_vl",), "qwen_image_edit": ("qwen2_5_vl",), "wan": ("umt5",), "wan22": ("umt5",)}


def test_published_text_encoder_configs_have_the_published_parameter_counts():
    """Each published config, built with transformers' classes on ``meta``, has the parameters its model card states (T5-XXL's
    encoder 4.76 B, UMT5-XXL's 5.68 B, CLIP-L's text tower 123 M, OpenCLIP bigG's 695 M, Qwen2.5-VL-7B 8.29 B with its 677 M
    vision tower and 545 M lm_head); :data:`pipelines.shapes.TEXT_ENCODER_PARAMS` holds the exact counts."""
    from transformers import (CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel)

    from pipelines.qwen_image.adapter import qwen_text_config
    from pipelines.shapes import SHAPES, TEXT_ENCODER_PARAMS, TEXT_ENCODERS

    def count(module):
        return sum(p.numel() for p in module.parameters())

    with torch.device("meta"):
        built = {
            "clip_l": CLIPTextModelWithProjection(CLIPTextConfig(**TEXT_ENCODERS["clip_l"])),
            "clip_l_unprojected": CLIPTextModel(CLIPTextConfig(**TEXT_ENCODERS["clip_l"])),
            "clip_g": CLIPTextModelWithProjection(CLIPTextConfig(**TEXT_ENCODERS["clip_g"])),
            "t5": T5EncoderModel(T5Config(**TEXT_ENCODERS["t5"])),
            "umt5": UMT5EncoderModel(UMT5Config(**TEXT_ENCODERS["umt5"])),
        }
        from transformers import Qwen2_5_VLForConditionalGeneration
        built["qwen2_5_vl"] = qwen = Qwen2_5_VLForConditionalGeneration(qwen_text_config(1000, SHAPES["qwen_image"]))
    counts = {k: count(m) for k, m in built.items()}
    assert counts == TEXT_ENCODER_PARAMS
    published = {"clip_l": 123.65e6, "clip_l_unprojected": 123.06e6, "clip_g": 694.7e6, "t5": 4.762e9, "umt5": 5.681e9, "qwen2_5_vl": 8.292e9}
    for k, v in published.items():
        assert counts[k] == pytest.approx(v, rel=1e-3), k
    assert count(qwen.model.visual) == pytest.approx(676.6e6, rel=1e-3) and count(qwen.lm_head) == 152064 * 3584


@pytest.mark.parametrize("name", ["sd35_medium", "sd35_large", "flux_dev", "flux_kontext", "qwen_image", "qwen_image_edit", "wan21_1_3b",
                                  "wan21_14b", "wan22_a14b"])
def test_published_shapes_carry_the_published_text_encoders(name, monkeypatch):
    """A published shape built on ``meta`` holds its family's published text encoders, parameter for parameter (the 2-layer
    stand-ins of ``stand_in_text`` hold under a tenth of them)."""
    from pipelines import build_adapter
    from pipelines.base import known_families
    from pipelines.shapes import PARENT_SHAPES, SHAPES, TEXT_ENCODER_PARAMS

    known_families()  # each family registers its published shapes on import
    shape = SHAPES[name]
    adapter = build_adapter(shape.family, shape=name, device="meta", dtype="bfloat16")
    held = sum(p.numel() for m in adapter.text_encoders.values() for p in m.parameters())
    assert held == sum(TEXT_ENCODER_PARAMS[k] for k in _TEXT_SIDE[shape.family])
    for built in {name, PARENT_SHAPES.get(name, name)}:  # an editing shape builds through its parent's
        monkeypatch.setitem(SHAPES, built, dataclasses.replace(SHAPES[built], stand_in_text=True))
    stand_in = build_adapter(shape.family, shape=name, device="meta", dtype="bfloat16")
    assert 0 < sum(p.numel() for m in stand_in.text_encoders.values() for p in m.parameters()) < held / 10


def test_reward_models_are_counted_from_their_published_weights():
    """Each published reward checkpoint's parameters are those of its published architecture (built on ``meta``): PickScore's
    and HPSv2's CLIP ViT-H/14 986 M, CLIP ViT-L/14 428 M, …; a recipe's reward on ``cuda`` holds them at its dtype beside
    rank 0's policy (PickScore in fp32: 3.67 GiB), one on the CPU nothing, and a local checkpoint is listed as not counted."""
    from diffrl.recipes import compose
    from diffrl.tools.plan_rewards import REWARD_PARAMS, published_reward_model, reward_bytes

    with torch.device("meta"):
        counts = {ref: sum(p.numel() for p in published_reward_model(ref).parameters()) for ref in REWARD_PARAMS}
    assert counts == {ref: params for ref, (params, _) in REWARD_PARAMS.items()}
    assert counts["yuvalkirstain/PickScore_v1"] == pytest.approx(986e6, rel=1e-3)
    cfg = compose(["experiment=sd35m_pickscore_flow_grpo"])
    assert reward_bytes(cfg) == ({"pickscore": 4 * counts["yuvalkirstain/PickScore_v1"]}, [])
    half = compose(["experiment=sd35m_pickscore_flow_grpo", "+reward.options.pickscore.dtype=bfloat16"])
    assert reward_bytes(half)[0] == {"pickscore": 2 * counts["yuvalkirstain/PickScore_v1"]}
    assert reward_bytes(compose(["experiment=sd35m_pickscore_flow_grpo", "reward.options.pickscore.device=cpu"])) == ({}, [])
    local = compose(["experiment=sd35m_pickscore_flow_grpo", "+reward.options.pickscore.checkpoint=/models/my_pickscore"])
    held, missing = reward_bytes(local)
    assert held == {"pickscore": 0} and len(missing) == 1 and "/models/my_pickscore" in missing[0] and "+reward.options.pickscore.checkpoint" in missing[0]


def test_recommendations_start_from_the_peak_phase_and_end_with_the_overrides():
    """Dropping the text encoders first, then the knobs of the phase that peaks before the other's; ``param_offload`` on
    sharded ranks and more GPUs with it; the report's last line is the exact overrides to add."""
    from diffrl.recipes import compose

    cfg = compose(["experiment=sd35m_pickscore_flow_grpo"])
    rollout_first = [c[0] for c in planner.candidates(cfg, 1, "rollout_after_update")]
    train_first = [c[0] for c in planner.candidates(cfg, 1, "train")]
    assert rollout_first[0] == train_first[0] == "drop the text encoders after caching the prompts"
    assert rollout_first[1].startswith("rollout micro-batch") and train_first[1].startswith("training micro-batch")
    assert "drop the text encoders after caching the prompts" not in [c[0] for c in planner.candidates(cfg, 1, "train", text_encoders=False)]
    sharded = compose(["experiment=sd35m_pickscore_flow_grpo", "model.fsdp=true"])
    names = [c[0] for c in planner.candidates(sharded, 8, "train")]
    assert "FSDP2 shards on the host (param_offload)" in names and "16 GPUs (FSDP2, shards on the host)" in names
    assert names.index("16 GPUs (FSDP2)") < names.index("16 GPUs (FSDP2, shards on the host)")
    r = {"overrides": ["experiment=x"], "gpus": 1, "gpu": "h100", "recommendation": {"change": "c", "overrides": ["+model.options.drop_text_encoders=true"],
         "gpus": 1, "peak_gib": 70.0, "step_s": 1.0}}
    assert planner.next_step(r) == ("add +model.options.drop_text_encoders=true: "
                                    "diffrl plan experiment=x +model.options.drop_text_encoders=true --gpus 1 --gpu h100")
    r = {"overrides": ["experiment=x"], "gpus": 1, "gpu": "h100", "recommendation": None,
         "tried": [{"change": "a", "overrides": ["sampler.micro_batch_size=8"], "gpus": 1, "peak_gib": 90.0},
                   {"change": "b", "gpus": 2, "peak_gib": 150.0, "note": "its weights and optimizer state alone exceed the budget"}]}
    assert planner.next_step(r) == "closest: a at 90.0 GiB per GPU; try diffrl plan experiment=x sampler.micro_batch_size=8 --gpus 1 --gpu h200"


# a narrowed SD3.5-Medium (its three block kinds: 4 dual-attention, 4 plain, the last) and a narrowed FLUX.1 (4 double, 5 single)
_NARROW = {
    "sd35_medium": dict(num_layers=9, dual_attention_layers=(0, 1, 2, 3), num_attention_heads=2, attention_head_dim=32, caption_projection_dim=64),
    "flux_dev": dict(num_layers=4, num_single_layers=5, num_attention_heads=2, attention_head_dim=32, axes_dims_rope=(8, 12, 12)),
}


@pytest.mark.slow(seconds=37)  # 57 s in CI on 2 processes: the slow tier (the full trace of two narrowed published shapes)
@pytest.mark.parametrize("name", sorted(_NARROW))
def test_per_block_trace_equals_the_full_trace(name, monkeypatch):
    """Two blocks of each kind traced, then one more of each kind, extrapolated to the shape's depth: every phase's peak
    and remaining bytes, its FLOPs and each category of static bytes within 1 % of the trace of the whole model (LoRA,
    activation checkpointing of every block, CFG, the training micro-batch, a rollout after the update)."""
    from pipelines.base import known_families
    from pipelines.shapes import SHAPES
    from pipelines.tiny import TINY_VAE

    known_families()
    shape = SHAPES[name]
    narrow = dataclasses.replace(shape, transformer={**shape.transformer, **_NARROW[name]}, vae=dict(TINY_VAE, latent_channels=16), stand_in_text=True)
    monkeypatch.setitem(SHAPES, name, narrow)
    model = {"sd35_medium": "sd3_tiny", "flux_dev": "flux_tiny"}[name]
    overrides = [f"model={model}", f"+model.options.shape={name}", "+model.options.max_sequence_length=32", "sampler.height=32", "sampler.width=32",
                 "sampler.num_steps=3", "model.activation_checkpointing=true", "algorithm.micro_batch_size=2", "trainer.prompts_per_step=2",
                 "trainer.group_size=2", "model.dtype=bfloat16"]
    cfg, _ = planner.plan_config(overrides, 1)
    full = planner.trace_recipe(cfg, 1, per_block=False)
    depths = []
    trace_once = planner._trace_once
    monkeypatch.setattr(planner, "_trace_once", lambda *a: depths.append(sum(SHAPES[name].block_kinds().values())) or trace_once(*a))
    multiplied = planner.trace_recipe(cfg, 1, per_block=True)
    assert depths == ({"sd35_medium": [5, 6, 6], "flux_dev": [4, 5, 5]}[name])  # two of each kind, then one more of each
    assert set(multiplied.phases) == set(full.phases)
    for phase, f in full.phases.items():
        for key in ("peak_bytes", "after_bytes", "flops"):
            assert multiplied.phases[phase][key] == pytest.approx(f[key], rel=0.01), (phase, key)
    for key, value in full.categories.items():
        assert multiplied.categories[key] == pytest.approx(value, rel=0.01, abs=512), key
    assert multiplied.rollout_flops == pytest.approx(full.rollout_flops, rel=0.01)
    assert multiplied.train_flops == pytest.approx(full.train_flops, rel=0.01)
    assert multiplied.block_bytes == full.block_bytes
    depths.clear()
    planner.trace_recipe(cfg, 1)  # by default only where it saves: 17 or 14 blocks traced would not save on 9
    assert len(depths) == 1
