"""The editing families (qwen_image_edit, flux_kontext) against diffusers' QwenImageEditPipeline and
FluxKontextPipeline on the tiny random components (fp32, CPU).

* Qwen-Image-Edit's text side: the edit template and its 64 dropped tokens (the tiny tokenizer's system part is
  exactly 64 tokens, as Qwen2's), the instruction + source embeddings and the negative prompt encoded with the
  source equal the pipeline's.
* Deterministic (Euler ODE) rollouts from the same noise equal the pipelines' final latents (sources of the output
  size and of another size: the source tokens have their own grid), and decode equals the pipelines' images.
* Rollout ↔ training log-probs are equal bit for bit in fp32 (LoRA on, CFG on for Qwen-Image-Edit, a source of
  another size), the conditioning carrying the source latents.
* The source conditions the prediction: another source changes it by far more than float rounding, through each
  of Qwen-Image-Edit's two paths (text encoder and latent tokens).
* ``diffrl export-lora`` writes a LoRA that the pipelines' ``load_lora_weights`` turns into the trained model.
* FLOPs count the source tokens; bad input is a one-line error.
The shared adapter suite (batch invariance, CFG modes, save → reload, LoRA targets) runs them from
tests/test_families.py, the tiny recipes' two training steps too.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_engine
from PIL import Image

from diffrl.config import SamplerConfig
from diffrl.sampling.rollout import sample_trajectories
from pipelines import build_adapter
from pipelines.base import split_prompts
from pipelines.latent import pack_latents, unpack_latents
from tests.conftest import randomise_lora

pytestmark = pytest.mark.usefixtures("single_thread")

FAMILIES = ["qwen_image_edit", "flux_kontext"]
GUIDANCE = {"qwen_image_edit": 4.0, "flux_kontext": 2.5}  # true CFG / the guidance embedding's input
_BASE: dict[str, object] = {}


def base(family: str):
    if family not in _BASE:
        _BASE[family] = build_adapter(family, path=None, seed=0)
    return _BASE[family]


def edits(adapter, n: int = 2, size: tuple[int, int] | None = None) -> tuple[list[str], torch.Tensor]:
    """The first ``n`` built-in instructions and their uint8 sources ``[n, 3, H, W]`` (resized to ``size``)."""
    texts, sources = split_prompts(adapter.default_prompts()[:n])
    if size is not None:
        sources = torch.nn.functional.interpolate(sources.float(), size=size, mode="bilinear", antialias=True).round().clamp(0, 255).to(torch.uint8)
    return texts, sources


def pil(sources: torch.Tensor) -> list:
    return [Image.fromarray(s.permute(1, 2, 0).numpy()) for s in sources]


def pipeline(family: str, adapter):
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, QwenImageEditPipeline

    parts = dict(adapter.components())
    parts["scheduler"] = FlowMatchEulerDiscreteScheduler.from_config(parts["scheduler"])
    pipe = (QwenImageEditPipeline if family == "qwen_image_edit" else FluxKontextPipeline)(**parts).to("cpu")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def run_pipeline(family: str, pipe, prompts: list[str], sources: torch.Tensor, x0: torch.Tensor, monkeypatch, output_type: str):
    """The pipeline's sample from our initial noise at 32×32, the source at its own size."""
    h, w = sources.shape[-2:]
    common = dict(image=pil(sources), prompt=prompts, num_inference_steps=4, height=32, width=32, latents=pack_latents(x0), output_type=output_type)
    if family == "qwen_image_edit":
        import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as module

        # the pipeline resizes the source to ~1024² pixels (calculate_dimensions); at the source's own size it
        # computes what the adapter does (the trainer gives sources at the output size)
        monkeypatch.setattr(module, "calculate_dimensions", lambda area, ratio: (w, h, None))
        return pipe(negative_prompt=[""] * len(prompts), true_cfg_scale=GUIDANCE[family], **common).images
    return pipe(guidance_scale=GUIDANCE[family], max_area=32 * 32, _auto_resize=False, max_sequence_length=base(family).max_sequence_length, **common).images


def test_qwen_image_edit_template_and_embeddings_match_the_pipeline():
    from pipelines.qwen_image_edit.adapter import EDIT_PROMPT_TEMPLATE, EDIT_PROMPT_TEMPLATE_START_IDX

    adapter = base("qwen_image_edit")
    pipe = pipeline("qwen_image_edit", adapter)
    assert EDIT_PROMPT_TEMPLATE == pipe.prompt_template_encode and EDIT_PROMPT_TEMPLATE_START_IDX == pipe.prompt_template_encode_start_idx == 64
    tok = adapter.tokenizers["tokenizer"]
    system_part = EDIT_PROMPT_TEMPLATE.split("<|vision_start|>")[0]  # through "<|im_start|>user\n"
    assert len(tok(system_part).input_ids) == 64  # the dropped tokens are the system prompt, as with Qwen2's tokenizer
    prompts, sources = edits(adapter, 2)
    prompts[1] += " and keep the background"  # different lengths: the masks matter
    ours = adapter.encode_prompts(prompts, sources.float() / 255)
    pe, pm = pipe.encode_prompt(prompts, image=pil(sources), device="cpu")
    n = pe.shape[1]
    assert pm is not None and ours["prompt_embeds_mask"].sum(1).tolist() == pm.sum(1).tolist() and pm.sum(1)[0] < n
    torch.testing.assert_close(ours["prompt_embeds"][:, :n], pe, rtol=1e-5, atol=1e-6)
    # stored with zeros up to the source's vision tokens (4 + 2 markers) + max_sequence_length
    assert ours["prompt_embeds"].shape == (2, 6 + adapter.max_sequence_length, 32)
    assert not ours["prompt_embeds"][:, n:].any() and not ours["prompt_embeds_mask"][:, n:].any()
    # the negative prompt is encoded with the same sources
    npe, npm = pipe.encode_prompt(["", ""], image=pil(sources), device="cpu")
    k = npe.shape[1]
    assert npm is None and ours["negative_prompt_embeds_mask"].sum(1).tolist() == [k, k]
    torch.testing.assert_close(ours["negative_prompt_embeds"][:, :k], npe, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(ours["negative_prompt_embeds"][0, :k], ours["negative_prompt_embeds"][1, :k], atol=1e-4)  # it sees its source
    torch.testing.assert_close(ours["image_latents"], adapter.encode_images(sources.float() / 255), rtol=0, atol=0)
    assert torch.equal(ours["negative_image_latents"], ours["image_latents"])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("source_size", [(32, 32), (48, 64)])
def test_ode_rollout_matches_the_diffusers_pipeline(family, source_size, monkeypatch):
    """Euler ODE from the same initial noise (guidance on: Qwen-Image-Edit's true CFG with the negative "",
    Kontext's guidance embedding): our final latents equal the pipeline's; decode equals its images."""
    adapter = base(family)
    pipe = pipeline(family, adapter)
    prompts, sources = edits(adapter, 2, source_size)
    s = SamplerConfig(num_steps=4, kind="ode", noise_level=0.0, height=32, width=32, guidance_scale=GUIDANCE[family])
    td = sample_trajectories(adapter, prompts, settings=s, seeds=[3, 4], source_images=sources)
    assert td["cond"]["image_latents"].shape == (2, 4, source_size[0] // 2, source_size[1] // 2)
    x0 = td["latents"][:, 0]
    out = unpack_latents(run_pipeline(family, pipe, prompts, sources, x0, monkeypatch, "latent"), 16, 16)
    torch.testing.assert_close(td["latents"][:, -1], out.float(), rtol=1e-4, atol=1e-4)
    assert (td["latents"][:, -1] - x0).abs().mean() > 0.1  # the sample moved: the comparison can fail
    if source_size == (32, 32):
        images = run_pipeline(family, pipe, prompts, sources, x0, monkeypatch, "pt")
        torch.testing.assert_close(adapter.decode(td["latents"][:, -1]), images.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_rollout_and_training_log_probs_are_equal_with_the_source_in_cond(family):
    adapter = build_adapter(family, path=None, seed=0)  # own copy: LoRA is attached
    s = SamplerConfig(num_steps=3, kind="flow_sde", noise_level=0.7, height=32, width=32, guidance_scale=GUIDANCE[family])
    engine = make_engine(adapter, s, lora_rank=4)
    engine.initialize()
    randomise_lora(engine.module, scale=0.02)
    prompts, sources = edits(adapter, 2, (48, 64))  # a source of another size than the output
    idx = torch.tensor([0, 0, 1, 1])
    td = sample_trajectories(adapter, [prompts[i] for i in idx], settings=s, seeds=[5, 6, 7, 8], source_images=sources[idx])
    assert td["sde_mask"].all() and torch.isfinite(td["log_probs"]).all()
    assert td["cond"]["image_latents"].shape == (4, 4, 24, 32) and torch.equal(td["source_images"], sources[idx])
    if family == "qwen_image_edit":
        assert torch.equal(td["cond"]["negative_image_latents"], td["cond"]["image_latents"])
    assert torch.equal(engine.infer_batch(td)["log_probs"], td["log_probs"])
    assert not torch.equal(td["cond"]["image_latents"][0], td["cond"]["image_latents"][2])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_source_conditions_the_prediction(family):
    """Same noise and instruction, another source: the prediction moves by > 1e-3 relative (float rounding is
    ~1e-7); Qwen-Image-Edit reads the source twice, and each path alone moves it."""
    adapter = base(family)
    (instruction, *_), sources = edits(adapter, 2)
    x = torch.randn(1, *adapter.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    sigma = torch.full((1,), 0.7)
    a, b = (adapter.encode_prompts([instruction], sources[i : i + 1].float() / 255) for i in (0, 1))

    def predict(cond):
        with torch.no_grad():
            return adapter.predict(x, sigma, cond, 1.0)

    def moved(cond) -> float:
        return float((predict(cond) - reference).norm() / reference.norm())

    reference = predict(a)
    assert torch.equal(predict(adapter.encode_prompts([instruction], sources[:1].float() / 255)), reference)
    assert moved(b) > 1e-3
    latents_only = a.clone()
    latents_only["image_latents"] = b["image_latents"]
    assert moved(latents_only) > 1e-3
    if family == "qwen_image_edit":
        text_only = b.clone()
        text_only["image_latents"] = a["image_latents"]
        assert moved(text_only) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_export_lora_loads_into_the_editing_pipeline(family, tmp_path):
    """``diffrl export-lora`` → ``load_lora_weights`` of QwenImageEditPipeline / FluxKontextPipeline: the pipeline's
    transformer then predicts what the trained one does on the same source-conditioned inputs."""
    from omegaconf import OmegaConf

    from diffrl.checkpoint import save_engine
    from diffrl.recipes import compose
    from diffrl.tools.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(OmegaConf.to_yaml(compose([f"model={family}_tiny", "model.lora.rank=4"])))
    adapter = build_adapter(family, path=None, seed=0)
    engine = make_engine(adapter, SamplerConfig(num_steps=2, height=32, width=32), lora_rank=4, lora_alpha=8.0)
    engine.initialize()
    randomise_lora(engine.module, scale=0.05, seed=1)
    ckpt = save_engine(engine, run / "checkpoints", global_step=3)
    out = tmp_path / "lora"
    assert main(["export-lora", "--checkpoint", str(ckpt), "--out", str(out)]) == 0
    assert json.loads((out / "diffrl_lora.json").read_text())["pipeline"] == adapter.pipeline_class

    fresh = build_adapter(family, path=None, seed=0)
    pipeline(family, fresh).load_lora_weights(str(out))  # loads into fresh.denoiser, the pipeline's transformer
    prompts, sources = edits(adapter, 2)
    cond = adapter.encode_prompts(prompts, sources.float() / 255)
    x = torch.randn(2, *adapter.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.8, 0.3])
    with torch.no_grad():
        ours = adapter.predict(x, sigma, cond, GUIDANCE[family])
        theirs = fresh.predict(x, sigma, cond, GUIDANCE[family])
        with engine.reference() as ref:
            base_out = ref.predict(x, sigma, cond, GUIDANCE[family])
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
    assert (ours - base_out).abs().max() > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_flops_count_the_source_tokens(family):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from diffrl.engine.flops import counter_for_adapter
    from pipelines.flops import flux_forward_flops, qwen_image_forward_flops

    adapter = base(family)
    prompts, sources = edits(adapter, 1)
    cond = adapter.encode_prompts(prompts * 2, sources.repeat(2, 1, 1, 1).float() / 255)
    if family == "qwen_image_edit":  # the valid text tokens: the instruction's and the source's vision tokens
        n_text, formula = int(cond["prompt_embeds_mask"][0].sum()), qwen_image_forward_flops
    else:
        n_text, formula = cond["prompt_embeds"].shape[1], flux_forward_flops
    # 64 packed noisy tokens (16×16 latent) + 64 packed source tokens
    assert adapter.forward_flops(32, 32) == formula(dict(adapter.denoiser.config), 128, n_text) > formula(dict(adapter.denoiser.config), 64, n_text)
    counter = counter_for_adapter(adapter, 32, 32)
    mode = FlopCounterMode(display=False)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), mode:
        adapter.predict(torch.zeros(2, *adapter.latent_shape(32, 32)), torch.full((2,), 0.5), cond, 1.0)
    assert counter.forward_flops(2) == pytest.approx(mode.get_total_flops(), rel=0.05)


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("family", FAMILIES)
def test_bad_sources_missing_components_and_shapes_are_one_line_errors(family, tmp_path):
    import shutil

    from pipelines.shapes import resolve_shape

    adapter = base(family)
    prompts, sources = edits(adapter, 2)
    images = sources.float() / 255
    for bad in (None, images[:1], sources, images[:, :, :30, :30]):
        with pytest.raises(ValueError, match="edits images|divisible") as err:
            adapter.encode_prompts(prompts, bad)
        one_line(err)
    with pytest.raises(ValueError, match="editing model") as err:  # the protocol's entry point says so too
        adapter.encode(prompts)
    one_line(err)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_adapter(family, path=str(tmp_path / "nowhere"))
    folder = tmp_path / family
    adapter.save_pretrained(folder)
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == adapter.pipeline_class
    missing = "processor" if family == "qwen_image_edit" else "tokenizer_2"
    shutil.rmtree(folder / missing)
    with pytest.raises(FileNotFoundError, match=f"lacks the component {missing}/") as err:
        build_adapter(family, path=str(folder))
    one_line(err)
    assert resolve_shape(family, "full").name == family
    with pytest.raises(ValueError, match=f"model family '{family}' has no shape 'sd35_large'") as err:
        build_adapter(family, shape="sd35_large", device="meta")
    one_line(err)
    if family == "qwen_image_edit":
        with pytest.raises(ValueError, match="no text-only prompt cache"):
            adapter.cache_prompts(prompts)
        short = build_adapter(family, path=None, seed=0, max_sequence_length=4)
        with pytest.raises(ValueError, match=r"takes \d+ tokens > max_sequence_length=4") as err:
            short.encode_prompts(prompts, images)
        one_line(err)


def test_kontext_serves_instructions_from_the_prompt_cache_and_encodes_sources():
    adapter = build_adapter("flux_kontext", path=None, seed=0, drop_text_encoders=True)
    prompts, sources = edits(adapter, 2)
    before = adapter.encode_prompts(prompts, sources.float() / 255)
    adapter.cache_prompts(prompts)
    assert not adapter.text_encoders_loaded
    after = adapter.encode_prompts(prompts[::-1], sources.flip(0).float() / 255)
    for key in before.keys():
        torch.testing.assert_close(after[key], before[key].flip(0), rtol=1e-5, atol=1e-6)
