"""``diffrl sample``, ``diffrl eval`` and ``diffrl export-lora`` on a tiny real run of the digits recipe.

* eval of the base model equals the trainer's step-0 evaluation, eval of the run's checkpoint equals its
  final evaluation (numbers and grid pixels);
* sample's JSON rewards equal the rewards called directly on the saved PNGs; a sample depends only on its
  prompt and seed;
* the exported LoRA loads with diffusers' own loaders (``StableDiffusion3Pipeline`` for digits,
  ``StableDiffusionPipeline`` for SD1.5) and reproduces diffrl's denoiser outputs and full samples;
* bad checkpoint paths and mismatched configs fail with a message naming the cause and the fix.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_engine
from PIL import Image

from diffrl.checkpoint import load_engine, save_engine
from diffrl.config import SamplerConfig
from diffrl.engine.engine import DiffusionEngine
from diffrl.logging import read_jsonl
from diffrl.sampling.rollout import sample_trajectories
from diffrl.tools.cli import main
from tests.conftest import randomise_lora

pytestmark = pytest.mark.usefixtures("single_thread")

RUN = ["trainer.steps=1", "trainer.prompts_per_step=2", "trainer.group_size=2", "sampler.num_steps=3", "sampler.eval_num_steps=3",
       "eval.seeds_per_prompt=2", "trainer.progress=false", "algorithm.lr=0.01"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, single_thread) -> Path:
    """One training step of the default recipe at tiny sizes: evaluations at steps 0 and 1, a checkpoint at 1."""
    out = tmp_path_factory.mktemp("commands") / "run"
    assert main(["train", f"trainer.output_dir={out}", *RUN]) == 0
    return out


def _pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def _png_tensor(path: Path) -> torch.Tensor:
    return torch.from_numpy(_pixels(path).copy()).permute(2, 0, 1)


def _same_image(a: torch.Tensor, b: torch.Tensor) -> bool:
    """uint8 images equal to one level per pixel (another batch size's float32 rounding), not a different sample."""
    return a.shape == b.shape and int((a.int() - b.int()).abs().max()) <= 1


def _evals(run: Path) -> tuple[dict, dict]:
    step0, step1 = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "eval"]
    return step0, step1


def test_eval_reproduces_the_trainers_evaluations(run, tmp_path):
    step0, step1 = _evals(run)
    keys = ("eval/digits", "eval/digits_gold", "eval/digits_gold2")  # the second judge (reward.judges) too
    assert step1["eval/digits"] != step0["eval/digits"]  # the checkpoint differs from the base model

    # the base model at the recipe's eval settings = the trainer's step-0 numbers, exactly
    assert main(["eval", *RUN, "--out", str(tmp_path / "base")]) == 0
    base = json.loads((tmp_path / "base" / "eval.json").read_text())
    assert {k: base["metrics"][k] for k in keys} == {k: step0[k] for k in keys}
    assert base["checkpoint"] is None
    assert np.array_equal(_pixels(tmp_path / "base" / "eval_grid.png"), _pixels(run / "images" / "eval_step_000000.png"))
    # per-image values: 60 prompts × 2 seeds; their mean is the metric, per-prompt means average pairs
    samples = base["samples"]
    assert len(samples) == 120 and samples[0]["prompt"] == samples[1]["prompt"] and samples[0]["seed"] != samples[1]["seed"]
    for name in ("digits", "digits_gold"):
        values = [s["rewards"][name] for s in samples]
        assert sum(values) / len(values) == pytest.approx(base["metrics"][f"eval/{name}"], rel=1e-6)
        first = samples[0]["prompt"]
        assert base["per_prompt"][first][name] == pytest.approx((values[0] + values[1]) / 2, rel=1e-12)

    # --run --base: the base model under the run's saved config
    assert main(["eval", "--run", str(run), "--base", "--out", str(tmp_path / "run_base")]) == 0
    run_base = json.loads((tmp_path / "run_base" / "eval.json").read_text())
    assert {k: run_base["metrics"][k] for k in keys} == {k: step0[k] for k in keys}

    # --run: its newest checkpoint reproduces the evaluation logged after the last step
    assert main(["eval", "--run", str(run), "--out", str(tmp_path / "trained")]) == 0
    trained = json.loads((tmp_path / "trained" / "eval.json").read_text())
    assert trained["step"] == 1 and trained["checkpoint"].endswith("step_000001")
    assert {k: trained["metrics"][k] for k in keys} == {k: step1[k] for k in keys}
    assert np.array_equal(_pixels(tmp_path / "trained" / "eval_grid.png"), _pixels(run / "images" / "eval_step_000001.png"))
    # --checkpoint of the same folder: the same numbers (its run's config.yaml is found)
    assert main(["eval", "--checkpoint", trained["checkpoint"], "--out", str(tmp_path / "ckpt")]) == 0
    assert json.loads((tmp_path / "ckpt" / "eval.json").read_text())["metrics"] == trained["metrics"]


def test_sample_writes_grid_and_json_whose_rewards_match_direct_calls(run, tmp_path):
    from rewards.digits import DigitsGold, DigitsReward

    prompts, seeds = ["a red seven", "a blue two", "a green zero"], [3, 11]
    out = tmp_path / "sample"
    assert main(["sample", "--run", str(run), "--prompts", *prompts, "--seeds", *map(str, seeds), "--out", str(out)]) == 0
    record = json.loads((out / "samples.json").read_text())
    samples = record["samples"]
    assert [(s["prompt"], s["seed"]) for s in samples] == [(p, s) for p in prompts for s in seeds]
    images = torch.stack([_png_tensor(out / s["image"]) for s in samples])
    assert images.shape == (6, 3, 16, 16) and images.dtype == torch.uint8
    listed = [s["prompt"] for s in samples]
    direct = {**DigitsReward()(images, listed), **DigitsGold()(images, listed)}
    for name in ("digits", "digits_gold"):
        assert [s["rewards"][name] for s in samples] == direct[name].tolist()
        assert record["mean"][name] == pytest.approx(direct[name].mean().item(), rel=1e-6)
        assert record["per_prompt"]["a blue two"][name] == pytest.approx(direct[name][2:4].mean().item(), rel=1e-6)
    assert 0.0 < direct["digits"].min() and direct["digits"].max() < 1.0
    # the grid: one row per prompt, one column per seed, 1-pixel borders, 4× nearest upscaling
    grid = _pixels(out / "grid.png")
    assert grid.shape == ((3 * 17 + 1) * 4, (2 * 17 + 1) * 4, 3)
    for i in range(6):
        r, c = divmod(i, 2)
        cell = grid[(1 + 17 * r) * 4 : (17 + 17 * r) * 4 : 4, (1 + 17 * c) * 4 : (17 + 17 * c) * 4 : 4]
        assert np.array_equal(cell, images[i].permute(1, 2, 0).numpy())
    # a sample depends only on its prompt and seed, not on the batch it is drawn in
    alone = tmp_path / "alone"
    assert main(["sample", "--run", str(run), "--prompts", "a blue two", "--seeds", "11", "--rewards", "none", "--out", str(alone)]) == 0
    # (to one uint8 level: a batch of one runs other float32 kernel blockings than a batch of six, which can move a pixel
    # across a rounding boundary: seen under ATEN_CPU_CAPABILITY=default on an AVX2 CPU, 2026-12-07)
    assert _same_image(_png_tensor(alone / "images" / "0000.png"), images[3])
    # --stochastic: the rollout SDE, reproducible per seed and unlike the ODE sample
    sde = [tmp_path / "sde_a", tmp_path / "sde_b"]
    for folder, extra in zip(sde, (["a red seven", "--seeds", "3"], ["a red seven", "a blue two", "--seeds", "3", "11"])):
        assert main(["sample", "--run", str(run), "--stochastic", "--rewards", "none", "--prompts", *extra, "--out", str(folder)]) == 0
    sde_image = _png_tensor(sde[0] / "images" / "0000.png")
    assert _same_image(sde_image, _png_tensor(sde[1] / "images" / "0000.png")) and not _same_image(sde_image, images[0])
    assert json.loads((sde[0] / "samples.json").read_text())["sampler"]["num_steps"] == 3
    # the base model draws other images from the same noise
    base = tmp_path / "base"
    assert main(["sample", "--run", str(run), "--base", "--prompts", *prompts, "--seeds", *map(str, seeds), "--out", str(base)]) == 0
    base_images = torch.stack([_png_tensor(base / "images" / f"{i:04d}.png") for i in range(6)])
    assert not torch.equal(base_images, images)


def _digits_engine(path: str, rank: int = 8, alpha: float = 16.0) -> DiffusionEngine:
    from pipelines.digits import DigitsAdapter

    engine = make_engine(DigitsAdapter(path=path), SamplerConfig(num_steps=3), lora_rank=rank, lora_alpha=alpha)
    engine.initialize()
    return engine


def test_export_lora_digits_loads_into_sd3_pipeline_and_reproduces_samples(run, tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from omegaconf import OmegaConf
    from safetensors.torch import load_file

    from pipelines.digits import DigitsAdapter

    out = tmp_path / "lora"
    assert main(["export-lora", "--run", str(run), "--out", str(out)]) == 0
    ckpt = run / "checkpoints" / "step_000001"
    model_path = OmegaConf.load(run / "config.yaml").model.path
    trained = _digits_engine(model_path)
    load_engine(trained, ckpt)

    state = StableDiffusion3Pipeline.lora_state_dict(str(out))
    stored = load_file(str(ckpt / "model.safetensors"))
    assert len(state) == len([k for k in stored if ".default." in k]) > 0
    assert all(k.startswith("transformer.") and (".lora_A.weight" in k or ".lora_B.weight" in k) for k in state)
    key = "transformer_blocks.0.attn.to_q.lora_B"
    torch.testing.assert_close(state[f"transformer.{key}.weight"], 2.0 * stored[f"{key}.default.weight"], rtol=0, atol=0)  # α/r = 16/8

    # a fresh transformer of the base model inside diffusers' SD3 pipeline, LoRA loaded by diffusers
    fresh = DigitsAdapter(path=model_path)
    pipe = StableDiffusion3Pipeline(
        transformer=fresh.denoiser, scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0), vae=None, text_encoder=None, tokenizer=None,
        text_encoder_2=None, tokenizer_2=None, text_encoder_3=None, tokenizer_3=None,
    )
    pipe.load_lora_weights(str(out))
    g = torch.Generator().manual_seed(0)
    x, sigma = torch.randn(2, 3, 16, 16, generator=g), torch.tensor([0.7, 0.3])
    cond = trained.adapter.encode_prompts(["a red seven", "a cyan four"])
    with torch.no_grad():
        ours = trained.adapter.predict(x, sigma, cond, 1.0)
        theirs = fresh.predict(x, sigma, cond, 1.0)
        with trained.reference() as base:
            base_out = base.predict(x, sigma, cond, 1.0)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert (ours - base_out).abs().max() > 1e-3  # the LoRA changes the output far beyond the tolerance

    # the same file as a plain dict (no metadata, so lora_alpha = r): the folded scale gives the same model
    plain = SD3Transformer2DModel.from_pretrained(f"{model_path}/transformer", local_files_only=True)
    plain.load_lora_adapter({k: v.clone() for k, v in state.items()}, prefix="transformer")
    with torch.no_grad():
        via_dict = plain(hidden_states=x, encoder_hidden_states=cond["prompt_embeds"], pooled_projections=cond["pooled_prompt_embeds"], timestep=1000 * sigma, return_dict=False)[0]
    torch.testing.assert_close(via_dict, ours, rtol=1e-5, atol=1e-5)

    # a full deterministic sample with CFG: diffusers' pipeline from diffrl's initial noise = diffrl's sample
    settings = SamplerConfig(num_steps=3, kind="ode", noise_level=0.0, guidance_scale=2.0)
    prompts = ["a red seven", "a cyan four"]
    td = sample_trajectories(trained.adapter, prompts, settings=settings, seeds=[5, 6])
    c = td["cond"]
    with torch.no_grad():
        result = pipe(
            prompt_embeds=c["prompt_embeds"], pooled_prompt_embeds=c["pooled_prompt_embeds"], negative_prompt_embeds=c["negative_prompt_embeds"],
            negative_pooled_prompt_embeds=c["negative_pooled_prompt_embeds"], guidance_scale=2.0, num_inference_steps=3,
            sigmas=td["sigmas"][0, :-1].tolist(), latents=td["latents"][:, 0].clone(), height=16, width=16, output_type="latent",
        ).images
    torch.testing.assert_close(result, td["latents"][:, -1], rtol=1e-5, atol=1e-5)
    info = json.loads((out / "diffrl_lora.json").read_text())
    assert info["pipeline"] == "StableDiffusion3Pipeline" and info["scale_folded_into_lora_B"] == 2.0 and info["step"] == 1


def test_export_lora_sd15_loads_into_stable_diffusion_pipeline_and_reproduces_samples(tmp_path):
    from diffusers import DDIMScheduler, StableDiffusionPipeline
    from omegaconf import OmegaConf

    from diffrl.recipes import compose
    from pipelines.sd15.adapter import SD15Adapter, build_tiny_components

    # an SD1.5 run folder: config.yaml + a checkpoint written by diffrl.checkpoint (LoRA r = 4, α = 12: scale 3);
    # the config says α = 16 (its default): the rank and alpha recorded in the checkpoint's state.json win
    run = tmp_path / "sd15_run"
    run.mkdir()
    (run / "config.yaml").write_text(OmegaConf.to_yaml(compose(["model=sd15_tiny", "model.lora.rank=4"])))
    settings = SamplerConfig(num_steps=3, kind="ddim", noise_level=0.0, guidance_scale=3.0, height=32, width=32)
    engine = make_engine(SD15Adapter(path=None, seed=0), settings, lora_rank=4, lora_alpha=12.0)
    engine.initialize()
    randomise_lora(engine.module, scale=0.05, seed=1)
    ckpt = save_engine(engine, run / "checkpoints", global_step=7)
    assert json.loads((ckpt / "state.json").read_text())["lora"] == {"rank": 4, "alpha": 12.0}
    out = tmp_path / "lora"
    assert main(["export-lora", "--checkpoint", str(ckpt), "--out", str(out)]) == 0

    parts = build_tiny_components(seed=0)
    pipe = StableDiffusionPipeline(
        vae=parts["vae"], text_encoder=parts["text_encoder"], tokenizer=parts["tokenizer"], unet=parts["unet"],
        scheduler=DDIMScheduler(**{k: v for k, v in parts["scheduler"].items() if not k.startswith("_")}),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(out))
    adapter = engine.adapter
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(2, 4, 16, 16, generator=g), torch.tensor([801, 301])
    text = adapter.encode_prompts(["a cat", "a dog"])["prompt_embeds"]
    with torch.no_grad():
        ours = adapter.denoiser(x, t, encoder_hidden_states=text, return_dict=False)[0]
        theirs = pipe.unet(x, t, encoder_hidden_states=text, return_dict=False)[0]
        with engine.reference() as base:
            base_out = base.denoiser(x, t, encoder_hidden_states=text, return_dict=False)[0]
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert (ours - base_out).abs().max() > 1e-2

    # full DDIM (η = 0) samples with CFG 3 from diffrl's initial noise: latents and decoded images
    prompts = ["a cat", "a dog"]
    td = sample_trajectories(adapter, prompts, settings=settings, seeds=[1, 2])
    kwargs = dict(prompt=prompts, num_inference_steps=3, guidance_scale=3.0, eta=0.0, height=32, width=32)
    with torch.no_grad():
        latents = pipe(**kwargs, latents=td["latents"][:, 0].clone(), output_type="latent").images
        images = pipe(**kwargs, latents=td["latents"][:, 0].clone(), output_type="pt").images
    torch.testing.assert_close(latents, td["latents"][:, -1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(images, adapter.decode(td["latents"][:, -1]), rtol=1e-4, atol=1e-5)
    info = json.loads((out / "diffrl_lora.json").read_text())
    assert info["pipeline"] == "StableDiffusionPipeline" and info["step"] == 7 and info["scale_folded_into_lora_B"] == 3.0


def test_bad_checkpoints_and_configs_fail_with_a_clear_message(run, tmp_path, capsys):
    def error(*argv) -> str:
        capsys.readouterr()
        assert main(list(argv)) == 2
        return capsys.readouterr().err

    missing = tmp_path / "no_run" / "checkpoints" / "step_000001"
    err = error("eval", "--checkpoint", str(missing), "--out", str(tmp_path / "o1"))
    assert str(missing) in err and "does not exist" in err and "--run" in err
    partial = tmp_path / "partial" / "checkpoints" / "step_000002"
    shutil.copytree(run / "checkpoints" / "step_000001", partial)
    (partial / "model.safetensors").unlink()
    err = error("sample", "--checkpoint", str(partial), "--prompts", "a red one", "--out", str(tmp_path / "o2"))
    assert "not a complete diffrl checkpoint" in err and "model.safetensors" in err
    err = error("eval", "--checkpoint", str(run), "--out", str(tmp_path / "o3"))
    assert "is a run folder" in err and f"--run {run}" in err
    empty = tmp_path / "empty_run"
    empty.mkdir()
    err = error("export-lora", "--run", str(empty), "--out", str(tmp_path / "o4"))
    assert "no complete checkpoint" in err and str(empty) in err
    # a config that does not fit the checkpoint, an unknown key, a group selection on a run's config
    err = error("eval", "--run", str(run), "model.lora.rank=4", "--out", str(tmp_path / "o5"))
    assert "does not fit" in err and "model.lora.rank=4" in err
    err = error("eval", "--run", str(run), "sampler.num_stepz=4", "--out", str(tmp_path / "o6"))
    assert "sampler.num_stepz" in err and "num_steps" in err
    err = error("eval", "--run", str(run), "experiment=digits_dpo", "--out", str(tmp_path / "o7"))
    assert "selects a config group" in err and "--recipe-config" in err
    err = error("sample", "--run", str(run), "--out", str(tmp_path / "o8"))
    assert "--prompts" in err
    # a run folder whose config.yaml names a key this diffrl's schema for its algorithm lacks: one line naming it
    edited = tmp_path / "edited_run"
    shutil.copytree(run, edited)
    text = (edited / "config.yaml").read_text()
    (edited / "config.yaml").write_text(text.replace("\n  clip_range:", "\n  clip_rang:", 1))
    err = error("eval", "--run", str(edited), "--out", str(tmp_path / "o11"))
    assert err.count("\n") == 1 and "does not fit this diffrl's config schema" in err and "'algorithm.clip_rang'" in err, err
    # full fine-tuning has no LoRA to export
    full = _digits_engine(None, rank=0)
    ckpt = save_engine(full, tmp_path / "full" / "checkpoints", global_step=1)
    err = error("export-lora", "--checkpoint", str(ckpt), "--out", str(tmp_path / "o9"))
    assert "full fine-tuned weights" in err and "no LoRA" in err
    # results are never overwritten silently
    (tmp_path / "o10").mkdir()
    (tmp_path / "o10" / "eval.json").write_text("{}")
    err = error("eval", "--run", str(run), "--out", str(tmp_path / "o10"))
    assert "already holds eval.json" in err and "--overwrite" in err
