"""Wan2.1 text-to-video against diffusers' WanPipeline, and videos through rewards, logging and training.

The shared family suite (tests/test_families.py) covers parity, batch invariance, CFG, save/reload and
LoRA for ``wan``; here: the UMT5 prompt embeddings, the flow-matching sigmas, an ODE rollout with CFG and
the decode against WanPipeline; frame-wise and whole-video rewards; the FLOPs formula against
FlopCounterMode; the eval grid and GIFs of videos; the tiny recipe training 2 steps through the CLI.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from diffrl.config import SamplerConfig
from diffrl.sampling.rollout import sample_trajectories
from pipelines import build_adapter

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = ["a cat", "  a  dog &amp;amp; a cat\n"]  # the second exercises WanPipeline's prompt cleaning
_BASE = {}


def base():
    if "wan" not in _BASE:
        _BASE["wan"] = build_adapter("wan", path=None, seed=0)
    return _BASE["wan"]


def wan_pipeline(adapter):
    """diffusers' WanPipeline over the adapter's components, with FlowMatchEulerDiscreteScheduler(shift=flow_shift)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    parts = dict(adapter.components())
    parts["scheduler"] = FlowMatchEulerDiscreteScheduler(shift=adapter.shift)
    return WanPipeline(**parts).to("cpu")


# ------------------------------------------------------------------------------------------------
# against WanPipeline
# ------------------------------------------------------------------------------------------------


def test_prompt_embeddings_match_wan_pipeline_encode_prompt():
    adapter = base()
    pipe = wan_pipeline(adapter)
    ours = adapter.encode_prompts(PROMPTS)
    pe, npe = pipe.encode_prompt(PROMPTS, negative_prompt="", do_classifier_free_guidance=True, max_sequence_length=adapter.max_sequence_length)
    assert ours["prompt_embeds"].shape == (2, adapter.max_sequence_length, 32)
    assert torch.equal(ours["prompt_embeds"], pe) and torch.equal(ours["negative_prompt_embeds"], npe)
    # rows past each prompt's token count are exactly zero (the pipeline's trim + zero padding)
    lengths = adapter.tokenizers["tokenizer"](["a cat", "a dog & a cat", ""], return_attention_mask=True).attention_mask
    lengths = [sum(m) for m in lengths]
    for row, n in zip([ours["prompt_embeds"][0], ours["prompt_embeds"][1], ours["negative_prompt_embeds"][0]], lengths):
        assert n < adapter.max_sequence_length
        assert torch.count_nonzero(row[n:]) == 0 and bool((row[:n].abs().sum(-1) > 0).all())
    # a custom negative prompt reaches the unconditional slot
    other = build_adapter("wan", path=None, seed=0, negative_prompt="blurry")
    _, npe2 = pipe.encode_prompt(PROMPTS, negative_prompt="blurry", max_sequence_length=adapter.max_sequence_length)
    assert torch.equal(other.encode_prompts(PROMPTS)["negative_prompt_embeds"], npe2)


def test_schedule_is_flow_match_euler_with_the_pipeline_flow_shift():
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler

    adapter = base()
    assert adapter.scheduler_config["_class_name"] == "UniPCMultistepScheduler" and adapter.shift == 3.0  # flow_shift
    for shift, a in ((3.0, adapter), (5.0, build_adapter("wan", path=None, seed=0, flow_shift=5.0))):
        for K in (1, 4, 10):
            scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
            scheduler.set_timesteps(K)
            ours = a.schedule(K)
            assert ours.shape == (K + 1,) and ours[0] == 1.0 and ours[-1] == 0.0
            torch.testing.assert_close(ours, scheduler.sigmas.float(), rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose((1000 * ours[:-1]).numpy(), scheduler.timesteps.numpy(), rtol=1e-6)
    assert not torch.allclose(adapter.schedule(4), adapter.schedule(4, 1.0))  # an explicit shift overrides


def test_ode_rollout_with_cfg_and_decode_match_wan_pipeline():
    adapter = base()
    pipe = wan_pipeline(adapter)
    g = 5.0
    s = SamplerConfig(num_steps=4, kind="ode", noise_level=0.0, guidance_scale=g, height=32, width=32)
    td = sample_trajectories(adapter, PROMPTS, settings=s, seeds=[3, 4])
    x0 = td["latents"][:, 0]
    assert x0.shape == (2, 16, 2, 4, 4)  # [C, (5 − 1)/4 + 1, 32/8, 32/8]
    common = dict(
        prompt=PROMPTS, negative_prompt="", latents=x0, num_inference_steps=4, guidance_scale=g, height=32, width=32,
        num_frames=5, max_sequence_length=adapter.max_sequence_length,
    )
    out = pipe(output_type="latent", **common).frames
    torch.testing.assert_close(td["latents"][:, -1], out.float(), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(out, x0, atol=1e-2)
    # decode: latents / (1/latents_std) + latents_mean → AutoencoderKLWan → [0, 1], frames [B, F, 3, H, W]
    video = pipe(output_type="pt", **common).frames
    ours = adapter.decode(out)
    assert ours.shape == video.shape == (2, 5, 3, 32, 32)
    torch.testing.assert_close(ours, video.float(), rtol=1e-4, atol=1e-5)
    assert td["images"].dtype == torch.uint8 and td["images"].shape == (2, 5, 3, 32, 32)
    torch.testing.assert_close(td["images"].float(), (adapter.decode(td["latents"][:, -1]) * 255).round(), rtol=0, atol=1.0)
    # encode_videos inverts the normalisation: (mean(VAE.encode(2x − 1)) − latents_mean) / latents_std
    lat = adapter.encode_videos(ours)
    mean = adapter.vae.encode(ours.permute(0, 2, 1, 3, 4) * 2 - 1).latent_dist.mean
    torch.testing.assert_close(lat * adapter.latents_std + adapter.latents_mean, mean, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="encode_videos"):
        adapter.encode_images(ours[:, 0])


def test_latent_shape_follows_num_frames_and_rejects_bad_sizes():
    from diffrl.recipes import compose

    cfg = compose(["experiment=wan_tiny_flow_grpo", "+model.options.num_frames=9"])
    assert cfg.model.family == "wan" and dict(cfg.model.options) == {"num_frames": 9}
    adapter = base()
    assert adapter.latent_shape(32, 48) == (16, 2, 4, 6)
    assert build_adapter("wan", path=None, seed=0, num_frames=9).latent_shape(32, 32) == (16, 3, 4, 4)
    assert build_adapter("wan", path=None, seed=0, num_frames=1).latent_shape(32, 32) == (16, 1, 4, 4)
    with pytest.raises(ValueError, match="num_frames=6"):
        build_adapter("wan", path=None, seed=0, num_frames=6)
    with pytest.raises(ValueError, match="divisible by 16"):
        adapter.latent_shape(40, 32)


def test_saved_folder_loads_in_wan_pipeline_and_missing_parts_are_named(tmp_path):
    from diffusers import WanPipeline

    adapter = base()
    folder = adapter.save_pretrained(tmp_path / "wan")
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline" and index["transformer"] == ["diffusers", "WanTransformer3DModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKLWan"] and index["text_encoder"] == ["transformers", "UMT5EncoderModel"]
    pipe = WanPipeline.from_pretrained(str(folder), local_files_only=True)
    assert type(pipe.scheduler).__name__ == "UniPCMultistepScheduler" and pipe.scheduler.config.flow_shift == 3.0
    for name, param in adapter.denoiser.state_dict().items():
        assert torch.equal(pipe.transformer.state_dict()[name], param)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_adapter("wan", path=str(tmp_path / "nowhere"))
    shutil.rmtree(folder / "text_encoder")
    with pytest.raises(FileNotFoundError, match="text_encoder"):
        build_adapter("wan", path=str(folder))


def test_prompt_cache_keeps_the_negative_prompt_after_dropping_the_encoder():
    adapter = build_adapter("wan", path=None, seed=0, drop_text_encoders=True, negative_prompt="blurry")
    before = adapter.encode_prompts(PROMPTS)
    adapter.cache_prompts(PROMPTS)
    assert not adapter.text_encoders_loaded
    after = adapter.encode_prompts(PROMPTS[::-1])
    assert torch.equal(after["prompt_embeds"], before["prompt_embeds"].flip(0))
    assert torch.equal(after["negative_prompt_embeds"], before["negative_prompt_embeds"])
    with pytest.raises(ValueError, match="not in the prompt-embedding cache"):
        adapter.encode_prompts(["never cached"])


# ------------------------------------------------------------------------------------------------
# rewards receive frames
# ------------------------------------------------------------------------------------------------


class FrameRecorder:
    """A per-image reward (mean red level − 0.01·prompt length) that records every call; pil or uint8 input."""

    name = "red"
    scale = (-10.0, 1.0)

    def __init__(self, batch_size=None, input="uint8"):
        self.batch_size, self.input, self.calls = batch_size, input, []

    def __call__(self, images, prompts, metadata=None):
        if self.input == "pil":
            from rewards.base import from_pil

            images = from_pil(images)
        self.calls.append((tuple(images.shape), list(prompts), metadata))
        red = images[:, 0].float().mean(dim=(1, 2)) / 255
        return {"red": red - 0.01 * torch.tensor([len(p) for p in prompts]), "count": torch.ones(len(prompts))}


def videos(b=3, f=5, seed=0):
    return torch.randint(0, 256, (b, f, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("batch_size,input", [(None, "uint8"), (4, "uint8"), (2, "pil")])
def test_frame_rewards_are_the_mean_of_per_frame_scores(batch_size, input):
    from rewards.base import call_reward, score

    v = videos()
    prompts = ["a", "bb", "ccc"]
    fn = FrameRecorder(batch_size, input)
    out = call_reward("red", fn, v, prompts, metadata=["m0", "m1", "m2"])
    manual = torch.stack([FrameRecorder()(v[i], [prompts[i]] * 5)["red"].mean() for i in range(3)])
    torch.testing.assert_close(out["red"], manual, rtol=0, atol=1e-6)
    assert torch.equal(out["count"], torch.ones(3))
    # the declared batch_size counts frames: 15 frames in chunks of batch_size; prompts/metadata repeated per frame
    chunk = batch_size or 15
    assert [c[0][0] for c in fn.calls] == [min(chunk, 15 - s) for s in range(0, 15, chunk)]
    assert sum((c[1] for c in fn.calls), []) == [p for p in prompts for _ in range(5)]
    assert sum((list(c[2]) for c in fn.calls), []) == [m for m in ["m0", "m1", "m2"] for _ in range(5)]
    scored = score({"red": (FrameRecorder(batch_size, input), 2.0)}, v, prompts)
    torch.testing.assert_close(scored["rewards"], 2 * manual, rtol=0, atol=1e-6)
    # 4-D images are unchanged: one call with the images themselves
    img_fn = FrameRecorder(batch_size, input)
    per_image = call_reward("red", img_fn, v[:, 2], prompts)
    torch.testing.assert_close(per_image["red"], FrameRecorder()(v[:, 2], prompts)["red"], rtol=0, atol=0)


def test_video_reward_receives_whole_videos():
    from rewards.base import Reward, call_reward, reward_spec

    class Motion(Reward):
        name = "motion"
        video = True
        batch_size = 2

        def __init__(self):
            self.shapes = []

        def __call__(self, images, prompts, metadata=None):
            self.shapes.append(tuple(images.shape))
            return {"motion": (images[:, 1:].float() - images[:, :-1].float()).abs().mean(dim=(1, 2, 3, 4))}

    v = videos()
    fn = Motion()
    assert reward_spec(fn)["video"] is True and reward_spec(FrameRecorder())["video"] is False
    out = call_reward("motion", fn, v, ["a", "b", "c"])
    assert fn.shapes == [(2, 5, 3, 8, 8), (1, 5, 3, 8, 8)]  # batch_size counts videos
    expected = (v[:, 1:].float() - v[:, :-1].float()).abs().mean(dim=(1, 2, 3, 4))
    torch.testing.assert_close(out["motion"], expected, rtol=0, atol=1e-6)


def test_nan_in_one_frame_names_the_video_and_frame():
    from rewards.base import RewardError, call_reward, check_images

    v = videos()
    v[1, 3] = 7  # marks frame 3 of video 1

    def bad(images, prompts, metadata=None):
        value = images[:, 0, 0, 0].float()
        return {"bad": torch.where(value == 7, torch.tensor(float("nan")), value)}

    with pytest.raises(RewardError, match=r"reward 'bad' returned nan for video 1 \(frame 3\)"):
        call_reward("bad", bad, v, ["a", "b", "c"])
    bad.batch_size = 4  # chunked: still the index in the whole batch
    with pytest.raises(RewardError, match=r"video 1 \(frame 3\)"):
        call_reward("bad", bad, v, ["a", "b", "c"])
    def whole(images, prompts, metadata=None):  # a video reward: errors name the video
        return {"whole": torch.tensor([0.0, float("nan"), 0.0])}

    whole.video = True
    with pytest.raises(RewardError, match="for sample 1 "):
        call_reward("whole", whole, v, ["a", "b", "c"])
    with pytest.raises(ValueError, match="3 prompts for 2 videos"):
        check_images(v[:2], ["a", "b", "c"])
    with pytest.raises(ValueError, match=r"\[B, F, 3, H, W\]"):
        check_images(v.float(), ["a", "b", "c"])


# ------------------------------------------------------------------------------------------------
# FLOPs, logging, training
# ------------------------------------------------------------------------------------------------

WAN_T2V_1_3B = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
    freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)


@pytest.mark.parametrize("full", [False, True])
def test_wan_flops_formula_matches_flop_counter(full):
    from diffusers import WanTransformer3DModel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from diffrl.engine.flops import counter_for_adapter
    from pipelines.flops import wan_forward_flops
    from pipelines.wan.adapter import TINY_WAN_TRANSFORMER

    if full:  # Wan2.1-T2V-1.3B, 33 frames at 480×832: latents [16, 9, 60, 104], 512 UMT5 tokens (meta tensors)
        config, latent, n_text, device = WAN_T2V_1_3B, (16, 9, 60, 104), 512, "meta"
        with torch.device("meta"):
            model = WanTransformer3DModel(**config).eval()
    else:
        config, latent, n_text, device = TINY_WAN_TRANSFORMER, (16, 2, 4, 6), 32, "cpu"
        model = base().denoiser
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:
        model(
            hidden_states=torch.zeros(1, *latent, device=device), timestep=torch.ones(1, device=device),
            encoder_hidden_states=torch.zeros(1, n_text, config["text_dim"], device=device), return_dict=False,
        )
    counted = float(counter.get_total_flops())
    tokens = latent[1] * (latent[2] // 2) * (latent[3] // 2)
    analytic = wan_forward_flops(config, tokens, n_text)
    assert analytic == pytest.approx(counted, rel=0.05)
    if full:
        assert tokens == 14040 and 7.0e13 < analytic < 7.6e13  # ≈ 72.9 TFLOP per 33-frame 480p video per forward
    else:
        # the family declares its FLOPs: the Wan formula over its video tokens and all 32 (padded) UMT5 tokens
        assert base().forward_flops(32, 48) == analytic and base().prompt_tokens() == 32
        c = counter_for_adapter(base(), 32, 48)
        assert c.forward_flops(1) == analytic
        assert base().forward_flops(32, 48, lora_rank=4) == wan_forward_flops(config, tokens, n_text, lora_rank=4) > analytic
        assert counter_for_adapter(base(), 32, 48, lora_rank=4).forward_flops(1) == base().forward_flops(32, 48, lora_rank=4)


def test_eval_logging_of_videos_uses_the_middle_frame_and_writes_gifs(tmp_path):
    import numpy as np
    from PIL import Image

    from diffrl.logging import RunLogger, image_grid, save_gif

    v = videos(b=4, f=5, seed=1)
    with RunLogger(tmp_path, wandb_mode="disabled") as logger:
        grid = logger.log_eval_samples(3, v, ["a", "a", "b", "b"], [0, 1, 0, 1], {"red": torch.arange(4.0)}, samples_per_prompt=2, grid_scale=1)
    expected = image_grid(v[[0, 2], 2], columns=2)
    assert np.array_equal(np.asarray(Image.open(grid)), np.asarray(expected))
    rows = [json.loads(line) for line in (tmp_path / "images" / "eval_step_000003.jsonl").read_text().splitlines()]
    assert [r["grid_index"] for r in rows] == [0, None, 1, None] and [r["red"] for r in rows] == [0.0, 1.0, 2.0, 3.0]
    gif = Image.open(tmp_path / "images" / "eval_step_000003" / "0002.gif")
    assert gif.n_frames == 5
    # a GIF of lossless palette content reads back exactly
    flat = torch.zeros(3, 3, 4, 4, dtype=torch.uint8)
    flat[1] = 255
    path = save_gif(flat, tmp_path / "x.gif")
    frames = Image.open(path)
    frames.seek(1)
    assert (np.asarray(frames.convert("RGB")) == 255).all()


def test_wan_tiny_flow_grpo_recipe_trains_two_steps(tmp_path):
    from PIL import Image

    from diffrl.tools.cli import main

    out = tmp_path / "run"
    rc = main([
        "train", "experiment=wan_tiny_flow_grpo", "trainer.wandb=disabled", "trainer.progress=false", f"trainer.output_dir={out}",
        "+model.options.num_frames=9",  # the adapter option reaches the adapter (and `sample --run` reads it back)
    ])
    assert rc in (0, None)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("kind") == "train"]
    assert [r["step"] for r in train] == [1, 2]
    losses = [v for r in train for k, v in r.items() if "loss" in k and isinstance(v, (int, float))]
    assert losses and all(math.isfinite(v) for v in losses)
    rewards = [r["reward/jpeg_compressibility_mean"] for r in train]
    assert all(math.isfinite(x) and x < 0 for x in rewards)  # −kB, mean over each video's frames
    assert (out / "images" / "eval_step_000002.png").is_file()
    gifs = sorted((out / "images" / "eval_step_000002").glob("*.gif"))  # one per grid video (the 8 built-in prompts)
    assert len(gifs) == 8 and all(Image.open(g).n_frames == 9 for g in gifs)
    # `diffrl sample` from the run: NNNN.png (the middle frame) and an animated NNNN.gif per video
    sample = tmp_path / "sample"
    assert main(["sample", "--run", str(out), "--prompts", "a cat", "--seeds", "1", "2", "--out", str(sample)]) == 0
    record = json.loads((sample / "samples.json").read_text())
    assert [s["image"] for s in record["samples"]] == ["images/0000.png", "images/0001.png"]
    assert all(math.isfinite(s["rewards"]["jpeg_compressibility"]) for s in record["samples"])
    for i in range(2):
        assert Image.open(sample / "images" / f"{i:04d}.png").size == (32, 32)
        assert Image.open(sample / "images" / f"{i:04d}.gif").n_frames == 9


def test_offline_wandb_logs_videos_as_gifs_and_middle_frames(tmp_path):
    import numpy as np
    from PIL import Image

    from diffrl.logging import RunLogger
    from diffrl.tools.analysis import read_wandb_offline

    v = videos(b=4, f=5, seed=2)
    scores = {"red": torch.tensor([0.5, 0.25, 0.125, 1.0])}
    with RunLogger(tmp_path, wandb_mode="offline", run_name="t", max_table_rows=3) as logger:
        logger.log_eval_samples(2, v, ["a", "a", "b", "b"], [0, 1, 0, 1], scores, samples_per_prompt=2, grid_scale=1)
        logger.log({"step": 2, "kind": "eval", "eval/red": 0.5})
    run = read_wandb_offline(tmp_path)
    row = {r["_step"]: r for r in run.history}[2]
    assert row["eval/videos"]["_type"] == "videos" and row["eval/videos"]["count"] == 2
    assert row["eval/videos"]["captions"] == ["a | red=0.5", "b | red=0.125"]
    assert row["eval/images"]["captions"] == ["a | red=0.5", "b | red=0.125"]
    table = run.table("eval/samples", 2)
    assert len(table) == 3
    for i, r in enumerate(table.itertuples(index=False)):  # the table's image is the video's middle frame
        assert (np.asarray(Image.open(r.image).convert("RGB")) == v[i, 2].permute(1, 2, 0).numpy()).all()


def test_export_lora_loads_into_wan_pipeline(tmp_path):
    from helpers import make_engine
    from omegaconf import OmegaConf

    from diffrl.checkpoint import save_engine
    from diffrl.recipes import compose
    from diffrl.tools.cli import main
    from tests.conftest import randomise_lora

    run = tmp_path / "wan_run"
    run.mkdir()
    (run / "config.yaml").write_text(OmegaConf.to_yaml(compose(["experiment=wan_tiny_flow_grpo", "model.lora.rank=4"])))
    settings = SamplerConfig(num_steps=2, kind="ode", noise_level=0.0, guidance_scale=5.0, height=32, width=32)
    engine = make_engine(build_adapter("wan", path=None, seed=0), settings, lora_rank=4, lora_alpha=8.0)
    engine.initialize()
    randomise_lora(engine.module, scale=0.05, seed=1)
    ckpt = save_engine(engine, run / "checkpoints", global_step=3)
    out = tmp_path / "lora"
    assert main(["export-lora", "--checkpoint", str(ckpt), "--out", str(out)]) == 0
    assert json.loads((out / "diffrl_lora.json").read_text())["pipeline"] == "WanPipeline"

    pipe = wan_pipeline(build_adapter("wan", path=None, seed=0))
    pipe.load_lora_weights(str(out))
    adapter = engine.adapter
    x = torch.randn(2, *adapter.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    text = adapter.encode_prompts(PROMPTS)["prompt_embeds"]
    t = torch.tensor([800.0, 300.0])
    with torch.no_grad():
        ours = adapter.denoiser(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        theirs = pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        with engine.reference() as ref:
            base_out = ref.denoiser(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert (ours - base_out).abs().max() > 1e-3  # the LoRA changes the output, so the check can fail
