"""The digits epsilon UNet (family ``digits_eps``, DDPO's base model): schedule against diffusers, the shipped
weights generate digits, rollout/training log-prob parity with LoRA, and the DDPO recipe's training step."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import make_engine

from diffrl.config import SamplerConfig
from diffrl.sampling.rollout import sample_trajectories
from pipelines import build_adapter
from pipelines.digits import ASSET_DIR
from tests.conftest import randomise_lora

pytestmark = pytest.mark.usefixtures("single_thread")
EPS_DIR = ASSET_DIR.parent / "digits_eps"


@pytest.fixture(scope="module")
def shipped():
    return build_adapter("digits_eps", path=str(EPS_DIR))


def test_schedule_is_ddim_on_the_linear_ddpm_betas(shipped):
    from diffusers import DDIMScheduler

    reference = DDIMScheduler(**{k: v for k, v in shipped.scheduler_config.items() if not k.startswith("_")})
    reference.set_timesteps(10)
    sigmas = shipped.schedule(10)
    torch.testing.assert_close(sigmas[:-1], torch.sqrt(1 - reference.alphas_cumprod[reference.timesteps]), rtol=1e-5, atol=1e-6)
    assert torch.equal(shipped.timestep(sigmas[:-1]), reference.timesteps)
    # the linear schedule: β_0 = 1e-4, so the last level is √(1 − ᾱ_0) = √β_0 = 0.01
    assert sigmas[-1].item() == pytest.approx(0.01, rel=1e-4)


def test_shipped_model_draws_the_prompted_digit_well_above_chance(shipped):
    from rewards.digits import judge_correct
    from rewards.digits.classifiers import DigitsClassifier
    from rewards.digits.data import all_prompts

    judge = DigitsClassifier.from_pretrained(ASSET_DIR / "gold_classifier").eval()
    prompts = all_prompts()  # 60 digit × colour prompts: chance is 1/60
    settings = SamplerConfig(num_steps=10, kind="ddim", noise_level=0.0, clip_sample=1.0)
    td = sample_trajectories(shipped, prompts, settings=settings, seeds=list(range(len(prompts))))
    accuracy = judge_correct(judge, td["images"], prompts).float().mean().item()
    meta = json.loads((EPS_DIR / "metadata.json").read_text())
    assert meta["base_gold_accuracy_by_guidance"]["1.0"] >= 0.3  # measured by pretrain_eps (20 DDIM steps, 240 samples)
    assert 0.15 <= accuracy <= 0.7, accuracy  # pretrained yet imperfect: RL has room


def test_rollout_training_parity_with_lora_and_cfg():
    adapter = build_adapter("digits_eps", path=None, seed=0)
    settings = SamplerConfig(num_steps=3, kind="ddim", noise_level=1.0, clip_sample=1.0, guidance_scale=2.0)
    engine = make_engine(adapter, settings, lora_rank=4)
    engine.initialize()
    randomise_lora(engine.module, scale=0.02)
    prompts = ["a red one", "a red one", "a blue seven", "a blue seven"]
    td = sample_trajectories(adapter, prompts, settings=settings, seeds=[1, 2, 3, 4])
    assert torch.equal(engine.infer_batch(td)["log_probs"], td["log_probs"])
    alone = sample_trajectories(adapter, prompts[2:3], settings=settings, seeds=[3])  # batch-size invariance
    torch.testing.assert_close(alone["latents"][0], td["latents"][2], rtol=1e-4, atol=1e-4)  # conv kernels vary with B


def test_ddpo_recipe_trains_on_jpeg_compressibility(tmp_path):
    from diffrl.logging import read_jsonl
    from diffrl.tools.cli import main

    out = tmp_path / "ddpo"
    args = ["train", "experiment=digits_ddpo", f"trainer.output_dir={out}", "trainer.steps=2", "trainer.prompts_per_step=2",
            "trainer.group_size=4", "sampler.num_steps=4", "sampler.eval_num_steps=4", "eval.seeds_per_prompt=1",
            "eval.every=100", "trainer.progress=false", "trainer.wandb=disabled"]
    assert main(args) == 0
    cfg = (out / "config.yaml").read_text()
    assert "family: digits_eps" in cfg and "kind: ddim" in cfg and "loss: ddpo" in cfg
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        # −(JPEG size in kB) of 16×16 images: between a flat image (−0.63) and pure noise (−0.92)
        assert -0.95 < r["reward_mean"] < -0.6, r
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reward_before"] < 0 and 0.0 <= summary["gold_accuracy_before"] <= 1.0
    # paired per-sample change on the same held-out (prompt, seed) pairs: its mean is the change of the means
    paired = summary["paired_change"]
    assert paired["steps"] == [0, 2]
    for name in ("jpeg_compressibility", "digits_gold"):
        key = f"eval/{name}"
        assert paired[name]["n"] == len(read_jsonl(out / "images" / "eval_step_000000.jsonl"))
        # eval/<name> is a float32 mean over the n samples and mean_change a float64 mean of their differences: they
        # agree up to the float32 rounding of the two means, which depends on the CPU's summation kernels (AVX2 and
        # AVX-512 sum in different orders); pairwise summation bounds each mean's error by ⌈log2 n⌉·ε32·max|mean|
        before, after = summary["eval_before"][key], summary["eval_after"][key]
        n = paired[name]["n"]
        float32_rounding = 2 * math.ceil(math.log2(n)) * float(torch.finfo(torch.float32).eps) * max(abs(before), abs(after))
        assert paired[name]["mean_change"] == pytest.approx(after - before, abs=float32_rounding)
        assert float32_rounding < 0.01 * abs(after - before) or after == before  # the check still sees the change
        assert paired[name]["improved_fraction"] + paired[name]["worsened_fraction"] <= 1.0


def test_stochastic_evaluation_samples_the_rollout_step_on_fixed_seeds(shipped):

    from diffrl.distributed.workers import ActorRolloutRefWorker
    from diffrl.recipes import compose
    from diffrl.sampling.request import SampleRequest, sample_batch
    from diffrl.run_setup import worker_config

    prompts, seeds = ["a red seven", "a blue two", "a green one"], [11, 12, 13]

    def eval_images(*overrides):
        cfg = compose(["experiment=digits_ddpo", "sampler.eval_num_steps=4", *overrides])
        worker = ActorRolloutRefWorker(worker_config(cfg))
        worker.init_model()
        return worker.generate_sequences(sample_batch(prompts, seeds, SampleRequest(eval_num_steps=4)))

    stochastic = eval_images("sampler.eval_stochastic=true")
    again = eval_images("sampler.eval_stochastic=true")
    deterministic = eval_images("sampler.eval_stochastic=false")
    # the same held-out seeds fix every draw: a repeated evaluation gives the same images
    assert torch.equal(stochastic["images"], again["images"])
    # DDIM with η = 1 at every step (log-probs recorded), drawn exactly like a rollout of the base model
    direct = sample_trajectories(shipped, prompts, settings=SamplerConfig(num_steps=4, kind="ddim", noise_level=1.0, clip_sample=1.0),
                                 seeds=seeds)
    assert torch.equal(stochastic["latents"], direct["latents"])
    assert bool((stochastic["log_probs"] != 0).all()) and bool((deterministic["log_probs"] == 0).all())
    assert not torch.equal(stochastic["images"], deterministic["images"])
