"""FP8 rollouts (model.rollout_precision=fp8): the rowwise e4m3 product against its formula, the two kernels against
each other, the layers restored after a rollout, and a run whose rollouts sample in FP8 while evaluations and training
stay in the model's precision, corrected by truncated importance weights; the FP8 weights persist across rollouts in
the same buffers (CUDA graphs read them in place), refreshed on every entry."""

from __future__ import annotations

import json

import pytest
import torch

from diffrl.engine.fp8 import (E4M3_MAX, effective_weight, fp8_layers, fp8_linear, fp8_linears, fp8_weight, quantize, release_fp8_buffers,
                               rowwise_scale)
from diffrl.recipes import compose
from diffrl.tools.cli import main
from diffrl.trainer import Trainer
from tests.helpers import make_engine, tiny_run_overrides

pytestmark = pytest.mark.usefixtures("single_thread")


def test_rowwise_e4m3_product_equals_its_formula():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 24, generator=g) * torch.tensor([1.0, 50.0, 1e-3, 0.0]).view(1, 4, 1)  # rows of very different size, one zero
    w = torch.randn(10, 24, generator=g) * 3.0
    b = torch.randn(10, generator=g)
    # the formula, step by step in float64: scales amax/448 per row, e4m3 rounding of x/s, dequantise, multiply
    s_w = (w.abs().amax(1, keepdim=True) / E4M3_MAX).double()
    rows = x.reshape(-1, 24)
    amax = rows.abs().amax(1, keepdim=True).double()
    s_x = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    w_dq = (w.double() / s_w).to(torch.float8_e4m3fn).double() * s_w
    x_dq = (rows.double() / s_x).to(torch.float8_e4m3fn).double() * s_x
    expected = (x_dq @ w_dq.t() + b.double()).reshape(3, 4, 10)
    scale = rowwise_scale(w)
    assert torch.equal(scale, s_w.float())
    q = quantize(w, scale)
    assert q.dtype == torch.float8_e4m3fn and q.float().abs().max() == E4M3_MAX  # each row's largest value maps to ±448
    got = fp8_linear(x, q, scale, b, "emulate")
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:, 3], b.expand(3, 10))  # the zero rows: only the bias
    # torch._scaled_mm (FP8 tensor cores on the GPU; torch's kernel on the CPU) computes the same product
    torch.testing.assert_close(fp8_linear(x, q, scale, b, "scaled_mm"), got, rtol=1e-6, atol=1e-5)
    # e4m3 keeps 3 mantissa bits: each operand within 2^-4 relative of its value, the product close to the exact one
    exact = x @ w.t() + b
    assert (got - exact).abs().max() < 0.1 * exact.abs().max()


def test_fp8_layers_run_in_rollouts_and_are_restored(tiny_adapter):
    from diffrl.config import SamplerConfig

    engine = make_engine(tiny_adapter, SamplerConfig(), rollout_precision="fp8", rollout_fp8_kernel="emulate")
    engine.initialize()
    module = engine.module
    layers = fp8_layers(module)
    assert layers and not any("lora_" in name for name, m in module.named_modules() if m in layers)
    x = torch.randn(2, *tiny_adapter.latent_shape(16, 16), generator=torch.Generator().manual_seed(1))
    cond = tiny_adapter.encode_prompts(["a red seven", "a blue two"])
    sigma = torch.tensor([0.7, 0.3])
    with torch.no_grad():
        full = tiny_adapter.predict(x, sigma, cond, 1.0)
        with engine.rollout_weights():
            low = tiny_adapter.predict(x, sigma, cond, 1.0)
        with engine.rollout_weights(low_precision=False):  # evaluations: the model's precision
            same = tiny_adapter.predict(x, sigma, cond, 1.0)
        after = tiny_adapter.predict(x, sigma, cond, 1.0)
    assert torch.equal(same, full) and torch.equal(after, full)  # every layer's own forward is back
    assert all(fp8_weight(layer) is None for layer in layers)  # compile_mode "default": the FP8 copy freed after the rollout
    engine.model.compile_mode = "reduce-overhead"  # CUDA graphs: the FP8 copy stays, at fixed addresses
    with torch.no_grad(), engine.rollout_weights():
        pass
    assert all(fp8_weight(layer) is not None for layer in layers)
    release_fp8_buffers(module)
    err = (low - full).abs().max() / full.abs().max()
    assert 1e-4 < err < 0.2, err  # FP8 changes the prediction, by e4m3's precision
    with pytest.raises(RuntimeError, match="gradient-free"), fp8_linears(module):
        pass


def test_a_run_samples_in_fp8_and_trains_the_model_precision_policy(tmp_path):
    prompts = ["a red seven", "a blue two"]
    fp8 = Trainer(compose(tiny_run_overrides(tmp_path, tmp_path / "fp8", 2, prompts, "model.rollout_precision=fp8", "trainer.wandb=disabled")))
    fp8.fit()
    base = Trainer(compose(tiny_run_overrides(tmp_path, tmp_path / "base", 2, prompts, "trainer.wandb=disabled")))
    base.fit()
    read = lambda run: [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    a, b = read(tmp_path / "fp8"), read(tmp_path / "base")
    assert a[0]["kind"] == "eval" and a[0]["eval/digits"] == b[0]["eval/digits"]  # evaluations sample the model's precision
    train = [r for r in a if r["kind"] == "train"]
    for record in train:
        # the behaviour policy is the FP8 one: truncated importance weights p_model / p_fp8 correct it, bounded by the cap
        assert 0.2 < record["rollout_is_weight_mean"] <= 2.0 and record["rollout_is_weight_mean"] != 1.0
    assert [r["reward_mean"] for r in train] != [r["reward_mean"] for r in b if r["kind"] == "train"]  # FP8 samples differ


def test_fp8_with_an_uncorrected_loss_is_a_one_line_error(tmp_path, capsys):
    code = main(["train", "experiment=digits_grpo_guard", "model.rollout_precision=fp8", f"trainer.output_dir={tmp_path / 'r'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "grpo_guard does not correct that" in err and not (tmp_path / "r").exists()


def test_the_scale_benchmark_measures_fp8_rollouts(tmp_path):
    """``benchmarks/speed/gpu_scale.py``'s ``*_fp8`` variants (the H200 run of issue 38): FP8 rollouts beside the model-precision
    ones, with the FP8-vs-model |Δ log p| of every trained step in ``max_abs_dlogp`` (exactly 0 without FP8)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "speed"))
    from gpu_scale import main as scale

    out = scale(["--shape", "tiny_sd3", "--variants", "eager,eager_fp8", "--device", "cpu", "--batch", "4", "--group", "2", "--micro-batch", "2",
                 "--steps", "4", "--window-range", "0", "3", "--repeats", "1", "--e2e-iters", "0", "--rank", "4", "--alpha", "8",
                 "--out", str(tmp_path / "fp8.json")])
    model, low = out["variants"]["eager"], out["variants"]["eager_fp8"]
    assert "error" not in model and "error" not in low
    assert model["max_abs_dlogp"] <= 1e-6 < low["max_abs_dlogp"] < 1.0
    assert low["rollout_images_per_s"] > 0


@pytest.mark.exact  # the loop runs and times its reward: no float compared: not in the numerics rerun (conftest.py)
def test_the_scale_benchmark_runs_a_real_reward_in_the_loop(tmp_path):
    """``--reward ocr`` (issue 38 item 2): the end-to-end loop scores with PP-OCRv4 on the CPU cores instead of the free
    brightness stand-in, and reports the reward's seconds per iteration."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "speed"))
    from gpu_scale import main as scale

    out = scale(["--shape", "tiny_sd3", "--variants", "eager", "--device", "cpu", "--batch", "4", "--group", "2", "--micro-batch", "2",
                 "--steps", "4", "--window-range", "0", "3", "--repeats", "1", "--e2e-iters", "1", "--rank", "4", "--alpha", "8",
                 "--reward", "ocr", "--out", str(tmp_path / "ocr.json")])
    run = out["variants"]["eager"]
    assert "error" not in run and run["reward"] == "ocr" and 0 < run["e2e_reward_s"] < run["e2e_iteration_s"]


def test_a_lora_layer_runs_as_one_fp8_linear_of_its_folded_weight():
    """A peft LoRA layer runs in FP8 as one linear of ``W + scale·B·A`` (folded in float32, then quantised): no thin LoRA
    matmuls and no bf16 copy; with its adapters disabled (the reference policy), of ``W`` alone."""
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 16))
    model = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["0"]), model)
    lora = model[0]
    torch.nn.init.normal_(lora.lora_B["default"].weight, std=0.5)
    x = torch.randn(5, 32)
    layers = fp8_layers(model)
    assert layers == [lora, model[2]]  # the LoRA layer as one unit (not its base, not lora_A/lora_B), and the plain linear
    w = lora.base_layer.weight.double() + 2.0 * lora.lora_B["default"].weight.double() @ lora.lora_A["default"].weight.double()

    def formula(x, w, b):
        s = rowwise_scale(w.float())
        return fp8_linear(x, quantize(w.float(), s), s, b, "emulate")

    with torch.no_grad():
        with fp8_linears(model, "emulate") as n:
            got = model(x)
        h = formula(x, w, lora.base_layer.bias)
        expected = formula(torch.nn.functional.gelu(h), model[2].weight.double(), model[2].bias)
        assert n == 2 and torch.allclose(got, expected, rtol=1e-5, atol=1e-6)
        lora.enable_adapters(False)  # the reference policy: the base weight alone
        assert torch.equal(effective_weight(lora)[0], lora.base_layer.weight)
        lora.enable_adapters(True)
        # the fold is the LoRA layer's own product up to e4m3 rounding, and every forward is restored on exit
        exact = model(x)
        assert (got - exact).abs().max() < 0.1 * exact.abs().max() and "forward" not in lora.__dict__



def lora_mlp(seed: int = 0):
    """A LoRA layer (32 → 48, rank 4, scale 2, non-zero B) and a plain linear (48 → 16): both kinds of FP8 layer."""
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 16))
    model = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["0"]), model)
    torch.nn.init.normal_(model[0].lora_B["default"].weight, std=0.5)
    return model


def fp8_formula(model, x):
    """The FP8 product of each layer computed afresh from its current effective weight (the quantisation of every entry)."""
    def layer(layer, x):
        w, b = effective_weight(layer)
        s = rowwise_scale(w)
        return fp8_linear(x, quantize(w, s), s, b, "emulate")

    return layer(model[2], torch.nn.functional.gelu(layer(model[0], x)))


def test_fp8_weights_persist_in_the_same_buffers_and_are_refreshed_on_each_entry():
    """Issue 55, ``keep_buffers`` (the engine's setting under ``model.compile_mode=reduce-overhead``): the FP8 weights live
    in buffers allocated on a layer's first FP8 rollout and quantised in place on every later one (same addresses, same installed forward objects, for CUDA graphs), holding the current weights (LoRA
    changed by a step between two rollouts), while outside the context each layer runs its own forward, gradients
    included."""
    model = lora_mlp()
    lora, plain = model[0], model[2]
    x = torch.randn(5, 32)
    with torch.no_grad():
        with fp8_linears(model, "emulate", keep_buffers=True):
            first = model(x)
            forwards = [lora.__dict__["forward"], plain.__dict__["forward"]]
            weights = [fp8_weight(lora), fp8_weight(plain)]
            ptrs = [(w.q.data_ptr(), w.scale.data_ptr()) for w in weights]
        assert torch.equal(first, fp8_formula(model, x))
        lora.lora_B["default"].weight.add_(torch.randn(48, 4))  # a training step between two rollouts
        plain.weight.mul_(-3.0)
        with fp8_linears(model, "emulate", keep_buffers=True):
            second = model(x)
            assert lora.__dict__["forward"] is forwards[0] and plain.__dict__["forward"] is forwards[1]  # the same functions
            assert fp8_weight(lora) is weights[0] and fp8_weight(plain) is weights[1]
            assert [(w.q.data_ptr(), w.scale.data_ptr()) for w in weights] == ptrs
        assert torch.equal(second, fp8_formula(model, x)) and not torch.allclose(second, first)  # refreshed, not stale
        assert weights[0].q.dtype == torch.float8_e4m3fn and weights[0].scale.shape == (48, 1)
    # outside: each layer's own (float32) forward, W + scale·B·A by peft's LoRA path, and gradients reach the adapter
    assert "forward" not in lora.__dict__ and "forward" not in plain.__dict__
    a, b = lora.lora_A["default"].weight, lora.lora_B["default"].weight
    h = torch.nn.functional.linear(x, lora.base_layer.weight, lora.base_layer.bias) + 2.0 * x @ a.t() @ b.t()
    exact = torch.nn.functional.linear(torch.nn.functional.gelu(h), plain.weight, plain.bias)
    out = model(x)
    torch.testing.assert_close(out, exact)
    out.square().sum().backward()
    assert b.grad is not None and b.grad.abs().sum() > 0
    # a change of kernel or of a layer's shape gets new buffers; release_fp8_buffers frees them (never inside the context)
    plain.weight, plain.bias = torch.nn.Parameter(torch.randn(32, 48)), torch.nn.Parameter(torch.zeros(32))
    with torch.no_grad(), fp8_linears(model, "scaled_mm", keep_buffers=True):
        assert fp8_weight(lora) is not weights[0] and fp8_weight(lora).kernel == "scaled_mm"
        assert fp8_weight(plain).q.shape == (32, 48)
        with pytest.raises(RuntimeError, match="inside fp8_linears"):
            release_fp8_buffers(model)
    assert release_fp8_buffers(model) == 48 * 32 + 48 * 4 + 32 * 48 + 32 * 4  # 1 byte a weight, 4 a row's scale
    assert fp8_weight(lora) is None and fp8_weight(plain) is None and release_fp8_buffers(model) == 0
    with torch.no_grad(), fp8_linears(model, "emulate", keep_buffers=False):
        assert fp8_weight(lora) is not None
    assert fp8_weight(lora) is None  # keep_buffers=False (the default): freed on exit


def test_compiled_fp8_rollouts_recompile_nothing_between_rollouts():
    """Under ``torch.compile`` the FP8 forward and the layer's own one are two cached variants: after the first FP8
    rollout, an evaluation and a training call, later rollouts (the LoRA weights changed in between) compile nothing,
    and compute the FP8 product of the current weights."""
    model = lora_mlp()
    compiles = []

    def counting_backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counting_backend, dynamic=False)
    x = torch.randn(5, 32)
    try:
        for step in range(3):
            with torch.no_grad(), fp8_linears(model, "emulate"):
                got = compiled(x)
            assert torch.equal(got, fp8_formula(model, x))
            with torch.no_grad():
                compiled(x)  # an evaluation (the model's precision)
            compiled(x).sum().backward()  # training
            with torch.no_grad():
                model[0].lora_B["default"].weight.add_(0.1)
            assert len(compiles) == 3, (step, len(compiles))
    finally:
        torch._dynamo.reset()
