"""FP8 rollouts (model.rollout_precision=fp8): the rowwise e4m3 product against its formula, the two kernels against
each other, the layers restored after a rollout, and a run whose rollouts sample in FP8 while evaluations and training
stay in the model's precision, corrected by truncated importance weights."""

from __future__ import annotations

import json

import pytest
import torch

from diffrl.engine.fp8 import E4M3_MAX, effective_weight, fp8_layers, fp8_linear, fp8_linears, quantize, rowwise_scale
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

