"""The editing protocol: (source, instruction) records from files, sources through rollout into the
trajectory and to the rewards that ask for them, and the SSIM preservation reward by its closed forms."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from tensordict import TensorDict

from diffrl.config import SamplerConfig
from diffrl.data import check_edit_prompts, read_edit_records, read_prompts
from diffrl.recipes import compose
from diffrl.sampling.rollout import sample_trajectories
from diffrl.trainer import Trainer
from pipelines.base import EditPrompt, resize_sources, split_prompts
from pipelines.digits.adapter import DigitsAdapter
from rewards.base import Reward, RewardError, build_reward, call_reward, score
from rewards.edit import gaussian_window, ssim


def _image(seed: int, size: int = 16) -> torch.Tensor:
    return torch.randint(0, 256, (3, size, size), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def _save(img: torch.Tensor, path) -> None:
    Image.fromarray(img.permute(1, 2, 0).numpy()).save(path)


class EditingDigits(DigitsAdapter):
    """The digits adapter made an editing model for the protocol's tests: the source (in [-1, 1]) enters the
    conditioning and is added to the velocity, so a different source gives a different sample."""

    editing = True

    def __init__(self, **kw):
        super().__init__(**kw)
        self.encode_calls = 0

    def encode_prompts(self, prompts, images=None):
        self.encode_calls += 1
        cond = super().encode_prompts(prompts)
        src = images * 2.0 - 1.0
        cond["source_latents"] = src
        cond["negative_source_latents"] = src.clone()
        return cond

    def _forward(self, latents, sigma, cond):
        return super()._forward(latents, sigma, cond) + 0.5 * cond["source_latents"].to(latents.dtype)


# -- records ------------------------------------------------------------------------------------------
def test_jsonl_and_folder_records_read_exactly_and_bad_rows_are_named(tmp_path):
    imgs = [_image(i) for i in range(3)]
    for i, img in enumerate(imgs):
        _save(img, tmp_path / f"src{i}.png")
    rows = [{"source": "src0.png", "instruction": "make it blue"}, {"file_name": "src1.png", "prompt": "make it red"},
            {"source": str(tmp_path / "src2.png"), "instruction": "turn the three into an eight"}]
    (tmp_path / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    for source in (tmp_path / "metadata.jsonl", tmp_path):  # the file, and the folder holding it
        records = read_prompts(source)
        assert [r.instruction for r in records] == ["make it blue", "make it red", "turn the three into an eight"]
        for r, img in zip(records, imgs):
            assert torch.equal(r.source, img)  # PNG is lossless: the bytes come back
    assert str(records[0]) == "make it blue" and records[1].name == "src1.png"

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"source": "src0.png"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl: line 1 lacks instruction"):
        read_edit_records(bad)
    bad.write_text(json.dumps({"source": "nope.png", "instruction": "x"}) + "\n")
    with pytest.raises(FileNotFoundError, match=r"line 1 names source image .*nope.png"):
        read_edit_records(bad)
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        read_edit_records(bad)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty/metadata.jsonl do not exist"):
        read_edit_records(tmp_path / "empty")
    with pytest.raises(ValueError, match="uint8 RGB image"):
        EditPrompt("x", torch.zeros(3, 4, 4))


def test_split_resize_and_family_checks():
    a, b = EditPrompt("make it blue", _image(0, 16)), EditPrompt("make it red", _image(1, 24))
    with pytest.raises(ValueError, match="different sizes"):
        split_prompts([a, b])
    resized = resize_sources([a, b, "text"], 16, 16)
    assert resized[0].source is a.source  # the right size already: kept as it is
    assert resized[1].source.shape == (3, 16, 16) and resized[1].source.dtype == torch.uint8
    assert resized[2] == "text"
    flat = torch.full((3, 24, 24), 77, dtype=torch.uint8)
    assert torch.equal(resize_sources([EditPrompt("x", flat)], 16, 16)[0].source, torch.full((3, 16, 16), 77, dtype=torch.uint8))
    with pytest.raises(ValueError, match="mixes text prompts and EditPrompt"):
        split_prompts(resized)
    texts, sources = split_prompts(resized[:2])
    assert texts == ["make it blue", "make it red"] and sources.shape == (2, 3, 16, 16)
    assert split_prompts(["a", "b"]) == (["a", "b"], None)

    sampler = SamplerConfig(height=16, width=16)
    with pytest.raises(ValueError, match="'digits' is text-to-image; use an editing family"):
        check_edit_prompts([a], "digits", sampler, editing=False)



def test_offline_dpo_pairs_on_an_editing_family_fail_before_anything_is_written(tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("")  # never read: the check comes first
    cfg = compose(["experiment=digits_edit_flow_grpo", "algorithm=dpo", f"algorithm.preference_pairs={pairs}",
                   f"trainer.output_dir={tmp_path / 'run'}", "trainer.progress=false", "trainer.wandb=disabled"])
    with pytest.raises(ValueError, match=r"offline DPO pairs\) has no source images, and model family 'digits_edit' edits images"):
        Trainer(cfg)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

# -- rollout ------------------------------------------------------------------------------------------
def test_rollout_encodes_each_prompt_source_pair_once_and_keeps_the_sources():
    adapter = EditingDigits()
    s0, s1 = _image(0), _image(1)
    prompts = ["a blue seven"] * 4
    sources = torch.stack([s0, s0, s1, s1])
    settings = SamplerConfig(num_steps=3, height=16, width=16, guidance_scale=1.0)
    td = sample_trajectories(adapter, prompts, settings=settings, seeds=[5, 5, 5, 5], source_images=sources)
    assert adapter.encode_calls == 2  # one per distinct (instruction, source), not one per instruction
    assert torch.equal(td["source_images"], sources)
    assert td["group_id"].tolist() == [0, 0, 1, 1]
    assert torch.equal(td["cond", "source_latents"], sources.float() / 255.0 * 2 - 1)
    # the same seed: equal samples within a (prompt, source) pair, different across sources
    assert torch.equal(td["images"][0], td["images"][1])
    assert (td["images"][0].float() - td["images"][2].float()).abs().mean() > 10.0

    with pytest.raises(ValueError, match="is an editing model: every prompt needs a source image"):
        sample_trajectories(adapter, prompts, settings=settings, seeds=[0, 1, 2, 3])
    with pytest.raises(ValueError, match="text-to-image model and takes no source images"):
        sample_trajectories(DigitsAdapter(), prompts, settings=settings, seeds=[0, 1, 2, 3], source_images=sources)
    with pytest.raises(ValueError, match=r"source_images must be uint8 \[4, 3, H, W\]"):
        sample_trajectories(adapter, prompts, settings=settings, seeds=[0, 1, 2, 3], source_images=sources[:2])


# -- rewards ------------------------------------------------------------------------------------------
class SourceMean(Reward):
    """Mean of the source's first channel: shows which source each sample received."""

    scale = (0.0, 255.0)
    batch_size = 3
    needs_source = True

    def __call__(self, images, prompts, metadata=None, *, source_images=None):
        return {"source_mean": source_images[:, 0].float().mean(dim=(1, 2))}


class PilSourceWidth(Reward):
    input = "pil"
    needs_source = True

    def __call__(self, images, prompts, metadata=None, *, source_images=None):
        return {"w": torch.tensor([float(np.asarray(s)[0, 0, 0]) for s in source_images])}


class Plain(Reward):
    def __call__(self, images, prompts, metadata=None):
        return {"plain": images.float().mean(dim=(1, 2, 3))}


def test_sources_reach_only_the_rewards_that_ask_in_the_right_chunks():
    images = torch.stack([_image(i, 8) for i in range(7)])
    sources = torch.stack([torch.full((3, 8, 8), 10 * i, dtype=torch.uint8) for i in range(7)])
    out = score({"source_mean": (SourceMean(), 1.0), "plain": (Plain(), 0.0), "w": (PilSourceWidth(), 0.0)}, images, ["p"] * 7, None, sources)
    assert out["reward/source_mean"].tolist() == [10.0 * i for i in range(7)]  # chunks of 3 keep the pairing
    assert out["reward/w"].tolist() == [10.0 * i for i in range(7)]  # PIL sources for a PIL reward
    assert torch.equal(out["reward/plain"], images.float().mean(dim=(1, 2, 3)))
    with pytest.raises(RewardError, match="needs the source images"):
        call_reward("source_mean", SourceMean(), images, ["p"] * 7)
    with pytest.raises(RewardError, match=r"source_images must be uint8 \[7, 3, H, W\]"):
        call_reward("source_mean", SourceMean(), images, ["p"] * 7, None, sources[:3])
    # videos scored per frame: every frame of a video is compared with that video's source
    video = images[:2].unsqueeze(1).repeat(1, 3, 1, 1, 1)
    per_video = call_reward("source_mean", SourceMean(), video, ["p"] * 2, None, sources[:2])
    assert per_video["source_mean"].tolist() == [0.0, 10.0]


# -- SSIM ---------------------------------------------------------------------------------------------
def test_ssim_closed_forms_and_the_source_similarity_reward():
    g = gaussian_window(11)
    assert float(g.sum()) == pytest.approx(1.0, abs=1e-12) and float(g[5] / g[4]) == pytest.approx(np.exp(1 / (2 * 1.5**2)), rel=1e-12)
    x = torch.rand(2, 3, 20, 20, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(ssim(x, x), torch.ones(2), atol=1e-6)
    assert torch.allclose(ssim(x, x.flip(0)), ssim(x.flip(0), x), atol=1e-7)  # symmetric
    # two flat images a, b: σ = 0, so SSIM = (2ab + C1) / (a² + b² + C1)
    for a, b in ((0.2, 0.7), (0.5, 0.5), (0.0, 1.0)):
        val = ssim(torch.full((1, 3, 16, 16), a), torch.full((1, 3, 16, 16), b))
        assert float(val) == pytest.approx((2 * a * b + 1e-4) / (a * a + b * b + 1e-4), rel=1e-5)
    # y = x + constant shift c (contrast and structure kept): SSIM = luminance term only, position by position
    base = torch.rand(1, 1, 11, 11, generator=torch.Generator().manual_seed(1)) * 0.5
    c = 0.3
    w = torch.outer(g, g).float()
    mx = float((w * base[0, 0]).sum())
    assert float(ssim(base, base + c)) == pytest.approx((2 * mx * (mx + c) + 1e-4) / (mx**2 + (mx + c) ** 2 + 1e-4), rel=1e-5)
    # anti-correlated structure scores below 0
    assert bool((ssim(x, 1.0 - x) < 0.0).all())

    reward = build_reward("source_similarity")
    src = (x * 255).round().to(torch.uint8)
    noisy = (src.float() + torch.randn(src.shape, generator=torch.Generator().manual_seed(2)) * 40).clamp(0, 255).to(torch.uint8)
    out = score({"source_similarity": (reward, 1.0)}, torch.cat([src, noisy]), ["keep it"] * 4, None, torch.cat([src, src]))
    sim = out["reward/source_similarity"]
    assert sim[:2].tolist() == pytest.approx([1.0, 1.0], abs=1e-6) and bool((sim[2:] < 0.9).all())


def test_editing_conditioning_is_in_the_trajectory_so_training_recomputes_the_log_probs():
    """The source enters ``cond`` in the rollout; recomputing each recorded step's log-prob from the
    trajectory alone (``cond`` included) gives the rollout's values exactly in fp32."""
    from diffrl.sampling.sde import run_step

    adapter = EditingDigits()
    settings = SamplerConfig(num_steps=4, height=16, width=16, guidance_scale=2.0, noise_level=0.7)
    sources = torch.stack([_image(3), _image(4)])
    td = sample_trajectories(adapter, ["a blue two", "a red five"], settings=settings, seeds=[1, 2], source_images=sources)
    cond = TensorDict(dict(td["cond"].items()), batch_size=[2])
    for k in range(settings.num_steps):
        x, sigma = td["latents"][:, k], td["sigmas"][0, k]
        out = adapter.predict(x, torch.full((2,), float(sigma)), cond, settings.guidance_scale)
        step = run_step(settings.kind, out, x, float(sigma), float(td["sigmas"][0, k + 1]), noise_level=settings.noise_level, prev_sample=td["latents"][:, k + 1])
        assert torch.equal(step.log_prob, td["log_probs"][:, k])
