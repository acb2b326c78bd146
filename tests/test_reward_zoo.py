"""The built-in model rewards: OCR (real PP-OCRv4 models from the rapidocr wheel) and the CLIP family
(clip_score, aesthetic, hpsv2 via open_clip; pickscore via transformers) on tiny random models.

CLIP-family checks: the torch preprocessing equals open_clip's and transformers' image processors on
the same PIL images (within 2 uint8 levels), and every score equals a hand computation through the
reference pipeline (PIL preprocessing, the model's own embedding calls, the score's formula).
"""

from __future__ import annotations

import numpy as np
import pytest

from diffrl.hub import HubError
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw, ImageFont

from rewards.base import RewardError, build_reward, score
from rewards.clip_models import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    Aesthetic,
    ClipScore,
    HPSv2,
    PickScore,
    clip_preprocess,
)
from rewards.ocr import OcrReward, edit_distance, ocr_score, quoted_text

TINY_OPEN_CLIP = {
    "embed_dim": 16, "quick_gelu": True,
    "vision_cfg": {"image_size": 224, "layers": 1, "width": 32, "head_width": 16, "patch_size": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}
TINY_HF_CLIP = {
    "text_config": {"hidden_size": 32, "intermediate_size": 37, "num_attention_heads": 2, "num_hidden_layers": 1},
    "vision_config": {"hidden_size": 32, "intermediate_size": 37, "num_attention_heads": 2, "num_hidden_layers": 1,
                      "patch_size": 32, "image_size": 224},
    "projection_dim": 16,
}
PROMPTS = ['a sign that says "HELLO"', "a photo of a red cat", "an oil painting of a lighthouse at dusk"]
ONE_LEVEL = 1 / 255 / min(OPENAI_CLIP_STD)  # one uint8 step after normalisation (≈ 0.0151)


def to_pil(image: torch.Tensor) -> Image.Image:
    return Image.fromarray(image.permute(1, 2, 0).numpy())


def sample_images(h: int = 96, w: int = 64, seed: int = 0) -> torch.Tensor:
    """Three uint8 images: noise, a smooth pattern, rendered text (the hard, easy and typical cases)."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 256, (3, h, w), generator=g, dtype=torch.uint8)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
    smooth = (torch.stack([yy, xx, (7 * yy * xx).sin() * 0.5 + 0.5]) * 255).round().to(torch.uint8)
    return torch.stack([noise, smooth, render_text("Hi", (w, h), 32)])


def render_text(text: str, size: tuple[int, int] = (384, 128), font_px: int = 64) -> torch.Tensor:
    """Black ``text`` centred on white, PIL's default scalable font at ``font_px``; uint8 ``[3, H, W]``."""
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=font_px)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    draw.text(((size[0] - (right - left)) / 2 - left, (size[1] - (bottom - top)) / 2 - top), text, fill="black", font=font)
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()


# -- OCR ------------------------------------------------------------------------------------------
def test_edit_distance_and_score_closed_forms():
    assert edit_distance("kitten", "sitting") == 3 and edit_distance("", "abc") == 3 and edit_distance("abc", "abc") == 0
    assert ocr_score("Hello World", "helloworld") == 1.0  # case and spaces are ignored
    assert ocr_score("HELLO", "WORLD") == pytest.approx(1 - 4 / 5)
    assert ocr_score("a much longer reading", "HI") == 0.0  # distance capped at the target length
    assert quoted_text('a sign that says "HELLO"') == "HELLO"
    assert quoted_text('“Open” and "Closed"') == "Open Closed"
    with pytest.raises(ValueError, match="a red seven"):
        quoted_text("a red seven")


@pytest.fixture(scope="module")
def ocr():
    return OcrReward(threads=1)


@pytest.mark.exact  # onnxruntime and PIL compute it: no ATen kernel to switch: not in the numerics rerun (conftest.py)
def test_ocr_reads_rendered_text(ocr):
    """Real PP-OCRv4 models: ≥ 0.9 when the rendered text is the prompt's, ≤ 0.3 when it is another."""
    texts = ["HELLO", "diffrl", "RL 2026", "Cat"]
    images = torch.stack([render_text(t) for t in texts])
    match = ocr(images, [f'a sign that says "{t}"' for t in texts])["ocr"]
    other = ocr(images, [f'a sign that says "{t}"' for t in ["WORLD", "banana", "xyz", "DOGS"]])["ocr"]
    print("match", match.tolist(), "mismatch", other.tolist())
    assert match.shape == (4,) and match.dtype == torch.float32
    assert (match >= 0.9).all(), match
    assert (other <= 0.3).all(), other
    blank = torch.full((1, 3, 64, 64), 255, dtype=torch.uint8)
    assert ocr(blank, ['"HELLO"'])["ocr"].item() == 0.0  # nothing to read: score 0
    with pytest.raises(ValueError, match="a photo of a cat"):
        ocr(images[:1], ["a photo of a cat"])
    # the detector reads at the image's own size (PaddleOCR's default); RapidOCR's upscaling reads the same text
    assert ocr.engine.text_det.limit_type == "max"
    upscaled = build_reward("ocr", det_limit_type="min")
    assert upscaled.engine.text_det.limit_type == "min" and (upscaled(images, [f'"{t}"' for t in texts])["ocr"] >= 0.9).all()
    with pytest.raises(ValueError, match="det_limit_type must be 'max' or 'min', got 'mid'"):
        build_reward("ocr", det_limit_type="mid")


# -- preprocessing ---------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [(96, 64), (300, 200), (31, 47), (224, 224), (256, 320)])
def test_clip_preprocess_matches_reference_processors(size):
    import open_clip
    from transformers import CLIPImageProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    images = sample_images(*size)
    references = {
        "open_clip": (torch.stack([open_clip.image_transform(224, is_train=False)(to_pil(x)) for x in images]), "round"),
        "transformers_pil": (CLIPImageProcessorPil()(images=[to_pil(x) for x in images], return_tensors="pt").pixel_values, "floor"),
        "transformers_torchvision": (CLIPImageProcessor()(images=[to_pil(x) for x in images], return_tensors="pt").pixel_values, "floor"),
    }
    for name, (reference, crop_offset) in references.items():
        ours = clip_preprocess(images, 224, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD, crop_offset=crop_offset)
        diff = (ours - reference).abs()
        assert ours.shape == reference.shape == (3, 3, 224, 224)
        assert diff.max() <= 2 * ONE_LEVEL + 1e-4, (name, diff.max())  # at most 2 uint8 levels anywhere
        assert diff.mean() <= 0.02 * ONE_LEVEL, (name, diff.mean())  # and almost everywhere exact


# -- CLIP-family scores ----------------------------------------------------------------------------
def open_clip_reference(reward, images: torch.Tensor, prompts: list[str] | None):
    """Normalised embeddings through open_clip's own PIL transform, tokenizer and encode_* calls."""
    import open_clip

    transform = open_clip.image_transform(224, is_train=False)
    pixels = torch.stack([transform(to_pil(x)) for x in images])
    with torch.no_grad():
        img = reward.model.encode_image(pixels, normalize=True)
        txt = reward.model.encode_text(open_clip.get_tokenizer("ViT-L-14")(prompts), normalize=True) if prompts else None
    return img, txt


@pytest.fixture(scope="module")
def zoo_images():
    return sample_images(96, 64)


def test_clip_score_and_hpsv2_equal_hand_computation(zoo_images):
    clip = ClipScore(random_init=True, model_config=TINY_OPEN_CLIP, multiplier=100.0, seed=3)
    img, txt = open_clip_reference(clip, zoo_images, PROMPTS)
    expected = 100.0 * (img * txt).sum(-1)
    got = clip(zoo_images, PROMPTS)["clip_score"]
    print("clip_score", got.tolist(), "hand", expected.tolist())
    assert torch.allclose(got, expected, atol=0.05), (got, expected)  # 100 × cos, preprocessing within 2 levels
    assert got.abs().max() <= 100.0
    assert got.std() > 0.1  # the three images/prompts are told apart
    through_score = score({"clip_score": (clip, 1.0)}, zoo_images, PROMPTS)  # the trainer's path: declared scale checked
    assert torch.equal(through_score["reward/clip_score"], got) and clip.scale == (-100.0, 100.0)

    hps = HPSv2(random_init=True, model_config=TINY_OPEN_CLIP, seed=4)
    img, txt = open_clip_reference(hps, zoo_images, PROMPTS)
    got = hps(zoo_images, PROMPTS)["hpsv2"]
    assert torch.allclose(got, (img * txt).sum(-1), atol=5e-4)
    assert got.abs().max() <= 1.0
    # batching does not change the scores
    hps.batch_size = 2
    assert torch.allclose(hps(zoo_images, PROMPTS)["hpsv2"], got, atol=1e-6)


def test_aesthetic_is_the_affine_mlp_of_the_normalised_embedding(zoo_images, tmp_path):
    reward = Aesthetic(random_init=True, model_config=TINY_OPEN_CLIP, seed=5)
    img, _ = open_clip_reference(reward, zoo_images, None)
    # the LAION head has no activations: collapse its five linear layers into w·e + b by hand
    linears = [m for m in reward.head.layers if isinstance(m, torch.nn.Linear)]
    weight, bias = torch.eye(img.shape[1]), torch.zeros(img.shape[1])
    for layer in linears:
        weight, bias = layer.weight @ weight, layer.weight @ bias + layer.bias
    expected = (img @ weight.T + bias)[:, 0]
    got = reward(zoo_images, PROMPTS)["aesthetic"]
    print("aesthetic", got.tolist(), "hand", expected.tolist())
    assert torch.allclose(got, expected, atol=5e-4)
    # the head loads from a LAION-style .pth (layers.{0,2,4,6,7}.*) and gives the same scores
    state = reward.head.state_dict()
    assert sorted({k.rsplit(".", 1)[0] for k in state}) == ["layers.0", "layers.2", "layers.4", "layers.6", "layers.7"]
    torch.save(state, tmp_path / "head.pth")
    reloaded = Aesthetic(random_init=True, model_config=TINY_OPEN_CLIP, seed=5, head_checkpoint=str(tmp_path / "head.pth"))
    assert torch.equal(reloaded(zoo_images, PROMPTS)["aesthetic"], got)


def test_open_clip_checkpoint_file_loads_hps_style_state_dict(zoo_images, tmp_path):
    """An HPS-style checkpoint ({"state_dict": {"module.…": …}}) loaded by path gives the same model."""
    source = HPSv2(random_init=True, model_config=TINY_OPEN_CLIP, seed=6)
    torch.save({"state_dict": {f"module.{k}": v for k, v in source.model.state_dict().items()}}, tmp_path / "hps.pt")
    loaded = HPSv2(checkpoint=str(tmp_path / "hps.pt"), model_config=TINY_OPEN_CLIP, seed=99)
    assert torch.equal(loaded(zoo_images, PROMPTS)["hpsv2"], source(zoo_images, PROMPTS)["hpsv2"])
    torch.save({"layers.0.weight": torch.zeros(2, 2)}, tmp_path / "not_clip.pt")
    with pytest.raises(RewardError, match="not_clip.pt"):
        HPSv2(checkpoint=str(tmp_path / "not_clip.pt"), model_config=TINY_OPEN_CLIP)


def test_pickscore_equals_hand_computation_and_reloads(zoo_images, tmp_path):
    import open_clip
    from transformers import CLIPImageProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    reward = PickScore(random_init=True, model_config=TINY_HF_CLIP, seed=7)
    # the offline tokenizer is the CLIP BPE: same ids as open_clip's tokenizer (up to padding)
    ids = reward.tokenizer(PROMPTS, padding="max_length", max_length=77, return_tensors="pt").input_ids
    ref_ids = open_clip.get_tokenizer("ViT-H-14")(PROMPTS)
    assert torch.equal(ids * (ref_ids != 0), ref_ids)
    # hand computation through transformers' PIL processor and the model's feature calls
    pixels = CLIPImageProcessorPil()(images=[to_pil(x) for x in zoo_images], return_tensors="pt").pixel_values
    tokens = reward.tokenizer(PROMPTS, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        img = reward.model.get_image_features(pixel_values=pixels)
        txt = reward.model.get_text_features(**tokens)
        img, txt = (t if isinstance(t, torch.Tensor) else t.pooler_output for t in (img, txt))
        expected = reward.model.logit_scale.exp() * (F.normalize(img, dim=-1) * F.normalize(txt, dim=-1)).sum(-1)
    got = reward(zoo_images, PROMPTS)["pickscore"]
    print("pickscore", got.tolist(), "hand", expected.tolist())
    assert torch.allclose(got, expected, atol=0.01)  # logit scale 1/0.07 ≈ 14.3 × cos
    assert got.abs().max() <= reward.model.logit_scale.exp().item() <= 100.0
    # a local folder (CLIPModel + tokenizer + preprocessor config) reproduces the scores
    reward.model.save_pretrained(tmp_path / "pick")
    reward.tokenizer.save_pretrained(tmp_path / "pick")
    CLIPImageProcessor().save_pretrained(tmp_path / "pick")
    loaded = PickScore(checkpoint=str(tmp_path / "pick"))
    assert torch.allclose(loaded(zoo_images, PROMPTS)["pickscore"], got, atol=1e-5)


@pytest.mark.parametrize("name", ["clip_score", "aesthetic", "hpsv2", "pickscore"])
def test_missing_weights_say_where_to_put_them(name, tmp_path):
    # no option: the published weights, here offline with an empty cache -> one line naming the repository and the fetch command
    repo = {"clip_score": "timm/vit_large_patch14_clip_224.openai", "aesthetic": "timm/vit_large_patch14_clip_224.openai",
            "hpsv2": "xswu/HPSv2", "pickscore": "yuvalkirstain/PickScore_v1"}[name]
    with pytest.raises(HubError, match=rf"reward\.options\.{name}\.checkpoint={repo}.*not in the Hugging Face cache.*hf download {repo}") as info:
        build_reward(name)
    assert "\n" not in str(info.value)
    with pytest.raises(FileNotFoundError, match="no_such_file"):
        build_reward(name, checkpoint=str(tmp_path / "no_such_file"))


# -- training with the OCR reward ------------------------------------------------------------------
# The digits family cannot take quoted-text prompts (its text encoder knows 17 words, 3 per prompt), so
# the run uses the tiny SD1.5 family (byte-level CLIP tokenizer: any prompt) with DDIM rollouts.
OCR_RUN = ["experiment=digits_flow_grpo", "model=sd15_tiny", "reward=ocr", "reward.gold=null", "sampler.kind=ddim",
           "sampler.height=32", "sampler.width=32", "sampler.num_steps=3", "sampler.eval_num_steps=3", "trainer.steps=2",
           "trainer.prompts_per_step=2", "trainer.group_size=2", "eval.seeds_per_prompt=1", "eval.every=2",
           "trainer.progress=false"]


def test_flow_grpo_trains_with_the_ocr_reward(tmp_path, monkeypatch, single_thread):
    from diffrl.logging import read_jsonl
    from diffrl.recipes import compose
    from diffrl.trainer import Trainer

    calls = []
    original = OcrReward.__call__

    def recording(self, images, prompts, metadata=None):
        out = original(self, images, prompts, metadata)
        calls.append((tuple(images.shape), images.dtype, list(prompts), out["ocr"].clone()))
        return out

    monkeypatch.setattr(OcrReward, "__call__", recording)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('a sign that says "HELLO"\na poster reading "RL"\n')
    cfg = compose([*OCR_RUN, f"trainer.prompts={prompts}", f"trainer.output_dir={tmp_path / 'run'}"])
    assert cfg.reward.names == ["ocr"] and cfg.model.family == "sd15"
    Trainer(cfg).fit()

    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [1, 2] and [r["step"] for r in evals] == [0, 2]
    train_calls = [c for c in calls if c[0][0] == 4]  # rollouts: 2 prompts × group 2; evaluations: 2 × 1
    assert len(train_calls) == 2 and len(calls) == 4
    for shape, dtype, call_prompts, values in calls:
        assert shape[1:] == (3, 32, 32) and dtype == torch.uint8
        assert all('"' in p for p in call_prompts)
        assert ((values >= 0) & (values <= 1)).all(), values
    for record, (_, _, _, values) in zip(train, train_calls):
        assert record["reward/ocr_mean"] == pytest.approx(values.mean().item(), abs=1e-6)
        assert 0.0 <= record["reward_mean"] <= 1.0
    assert all(0.0 <= r["eval/ocr"] <= 1.0 for r in evals)


def test_ocr_run_names_a_prompt_without_quoted_text(tmp_path, single_thread):
    from diffrl.recipes import compose
    from diffrl.trainer import Trainer

    prompts = tmp_path / "prompts.txt"
    prompts.write_text('a sign that says "HELLO"\na photo of a cat\n')
    cfg = compose([*OCR_RUN, f"trainer.prompts={prompts}", f"trainer.output_dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match="a photo of a cat"):
        Trainer(cfg).fit()
