"""``model.compile``: the denoiser is compiled in place after LoRA is attached; state-dict keys do
not change, rollout and training run the compiled module, and their log-probs still agree exactly."""

from __future__ import annotations

import pytest
import torch
from helpers import make_engine

from diffrl.config import SamplerConfig
from diffrl.engine.engine import GradModeDispatch
from diffrl.sampling.rollout import sample_trajectories
from diffrl.sampling.seeding import Stream, derive
from pipelines.digits import DigitsAdapter
from pipelines.digits.adapter import TRANSFORMER_CONFIG
from tests.conftest import randomise_lora


class TwoBlockDigits(DigitsAdapter):
    """The digits miniature with 2 of its 4 joint blocks (a middle one and the last, context-only one): what is compiled
    is the same code, and dynamo and AOT autograd trace half as much."""

    transformer_config = {**TRANSFORMER_CONFIG, "num_layers": 2}


def _engine(compile_on: bool):
    adapter = TwoBlockDigits(path=None, seed=0)
    settings = SamplerConfig(num_steps=3, kind="flow_sde", noise_level=0.7, guidance_scale=3.0)
    # aot_eager traces and runs the same graphs as inductor without generating C++ (fast on CPU)
    engine = make_engine(adapter, settings, lora_rank=4, compile=compile_on, compile_backend="aot_eager")
    engine.initialize()
    randomise_lora(engine.module)
    return adapter, engine, settings


def test_compiled_engine_keeps_keys_and_log_prob_parity(single_thread):
    torch._dynamo.reset()
    prompts = [p for p in ("a red seven", "a blue two") for _ in range(2)]
    seeds = [derive(0, Stream.ROLLOUT, 0, i // 2, i % 2) for i in range(len(prompts))]

    adapter_e, eager, settings = _engine(False)
    adapter_c, compiled, _ = _engine(True)
    assert compiled.module._compiled_call_impl is not None and eager.module._compiled_call_impl is None
    assert list(compiled.module.state_dict()) == list(eager.module.state_dict())  # no "_orig_mod." prefix

    td_e = sample_trajectories(adapter_e, prompts, settings=settings, seeds=seeds)
    td_c = sample_trajectories(adapter_c, prompts, settings=settings, seeds=seeds)
    # the compiled rollout draws the same noise and lands within fp32 rounding of the eager one
    torch.testing.assert_close(td_c["latents"], td_e["latents"], rtol=0, atol=1e-4)
    # principle 1 holds through the compiled module: recomputed log-probs equal the rollout's exactly
    assert torch.equal(compiled.infer_batch(td_c)["log_probs"], td_c["log_probs"])
    torch._dynamo.reset()


@pytest.mark.exact  # counts calls and compares the graph path with itself bit for bit: not in the numerics rerun (conftest.py)
def test_reduce_overhead_replays_graphs_only_without_gradients(single_thread):
    """``compile_mode=reduce-overhead``: gradient-free calls (rollout, scoring) go to the CUDA-graph compile, training
    forwards to the default-mode one; each prediction without gradients starts a graph-tree step; the log-prob parity
    and the training step are those of the default mode."""
    torch._dynamo.reset()
    adapter = TwoBlockDigits(path=None, seed=0)
    settings = SamplerConfig(num_steps=3, kind="flow_sde", noise_level=0.7, guidance_scale=3.0)
    engine = make_engine(adapter, settings, lora_rank=4, compile=True, compile_backend="aot_eager", compile_mode="reduce-overhead")
    engine.initialize()
    randomise_lora(engine.module)
    dispatch = engine.module._compiled_call_impl
    assert isinstance(dispatch, GradModeDispatch) and adapter.cudagraph_steps
    calls = {"graphs": 0, "plain": 0}

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    dispatch.graphs, dispatch.plain = counted("graphs", dispatch.graphs), counted("plain", dispatch.plain)
    marks = []
    real_mark = torch.compiler.cudagraph_mark_step_begin
    torch.compiler.cudagraph_mark_step_begin = lambda: (marks.append(1), real_mark())
    try:
        prompts, seeds = ["a red seven", "a blue two"], [derive(0, Stream.ROLLOUT, 0, i, 0) for i in range(2)]
        td = sample_trajectories(adapter, prompts, settings=settings, seeds=seeds)
        # 3 steps × (conditional + unconditional) forwards, one graph-tree step per prediction
        assert calls == {"graphs": 6, "plain": 0} and len(marks) == 3
        assert torch.equal(engine.infer_batch(td)["log_probs"], td["log_probs"])
        assert calls["plain"] == 0 and len(marks) == 6
        with torch.enable_grad():
            out = adapter.predict(td["latents"][:, 0], td["sigmas"][:, 0], td["cond"], 1.0)
            out.float().pow(2).mean().backward()
        assert calls["plain"] == 1 and len(marks) == 6  # the training forward: default-mode graphs, no step mark
    finally:
        torch.compiler.cudagraph_mark_step_begin = real_mark
        torch._dynamo.reset()
