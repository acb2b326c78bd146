"""Qwen-Image-Edit (instruction-based image editing) over diffusers, as ``diffusers.QwenImageEditPipeline``
(``pipelines/qwenimage/pipeline_qwenimage_edit.py``, diffusers 0.42) runs it: Qwen-Image's transformer, VAE,
schedule and true CFG (:class:`~pipelines.qwen_image.adapter.QwenImageAdapter`), with the source image entering
twice.

* Text side (``_get_qwen_prompt_embeds``): each instruction goes into the edit template
  :data:`EDIT_PROMPT_TEMPLATE` with a vision placeholder; a ``Qwen2VLProcessor`` expands the placeholder into the
  source's vision tokens (``image_grid_thw``, 2×2-merged 14-pixel patches) and makes its ``pixel_values``; the
  Qwen2.5-VL encoder runs on both; ``hidden_states[-1]`` keeps each sequence's valid tokens minus the first
  :data:`EDIT_PROMPT_TEMPLATE_START_IDX` ``= 64`` (the system prompt), zero-padded with ``prompt_embeds_mask``.
  The pipeline does not truncate; the conditioning is stored padded to the source's vision tokens plus
  ``max_sequence_length`` (a longer instruction is an error) and :meth:`QwenImageEditAdapter._forward` cuts the
  text to the batch's longest valid sequence, so the compute is the pipeline's.
* Latent side: the source's VAE latents (posterior mean, the pipeline's ``sample_mode="argmax"``, normalised
  ``(z − latents_mean)/latents_std``) in ``cond["image_latents"] [B, C, h_s, w_s]``; the transformer sees
  ``[packed noisy tokens; packed source tokens]`` with ``img_shapes = [(1, h/2, w/2), (1, h_s/2, w_s/2)]`` per
  sample (the source is RoPE frame 1 on its own grid) and its output is cut to the noisy tokens.
* True CFG: the negative prompt (``""`` by default) is encoded WITH the source, as the pipeline does, into
  ``negative_prompt_embeds``/``negative_prompt_embeds_mask``; ``negative_image_latents`` equals ``image_latents``.
  The norm-rescaled combination runs on the cut (noisy-token) outputs (:func:`~pipelines.qwen_image.adapter.true_cfg`).
* Sizes: the pipeline resizes the source to ~1024² pixels (``calculate_dimensions``) for both the VL encoder and the
  VAE; here the source enters at the size given (the trainer resizes sources to the output size), which is what
  the pipeline computes when that size is its ``calculate_dimensions``. The schedule's dynamic shift counts the
  noisy tokens only, as the pipeline's.

``model.path`` is a local diffusers folder (``transformer/``, ``vae/``, ``text_encoder/``, ``tokenizer/``,
``processor/``, ``scheduler/``); with no path the family builds a tiny random configuration offline (tokenizer,
image processor and a Qwen2.5-VL with a vision tower included).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from tensordict import TensorDict

from pipelines.base import check_source_images, register_family, resize_sources
from pipelines.flops import qwen_image_forward_flops
from pipelines.latent import check_folder, pack_latents, unpack_latents
from pipelines.qwen_image.adapter import TOKENIZER_MAX_LENGTH, QwenImageAdapter, _trim_text, build_tiny_qwen_tokenizer, qwen_text_config
from pipelines.shapes import SHAPES, Shape, building, parent_shape, register_shape, resolve_shape
from pipelines.tiny import tiny_edit_prompts

# the published shape: Qwen-Image-Edit runs Qwen-Image's transformer and VAE configs (built through its builder)
register_shape(dataclasses.replace(
    SHAPES["qwen_image"], name="qwen_image_edit", family="qwen_image_edit",
    source="Qwen/Qwen-Image-Edit transformer/config.json, vae/config.json (Qwen-Image's)",
), full=True, parent="qwen_image")

EDIT_PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, background), "
    "then explain how the user's text instruction should alter or modify the image. Generate a new image that meets the "
    "user's requirements while maintaining consistency with the original input where appropriate.<|im_end|>\n"
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n"
)
EDIT_PROMPT_TEMPLATE_START_IDX = 64  # tokens of the template's system part (through "<|im_start|>user\n"), dropped
QWEN_IMAGE_EDIT_COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "processor", "scheduler")
# Qwen2.5-VL's vision tokens; the tiny text config (qwen_text_config(v)) gives them the ids v … v + 3
VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
# the edit template's words missing from Qwen-Image's tiny vocabulary (kept whole) and two of Qwen2's BPE merges
# ("user's" → user + 's, "background)," → background + ),): the system part is then 64 tokens, as with Qwen2's tokenizer
_EDIT_WORDS = (
    "Generate", "alter", "appropriate", "consistency", "explain", "features", "how", "input", "instruction", "key",
    "maintaining", "meets", "modify", "new", "or", "original", "requirements", "should", "that", "then", "where", "while",
    "with",
)
_BPE_MERGES = ("'s", "),")


def build_tiny_qwen_edit_processor():
    """``(tokenizer, processor, vocab_size)`` of the tiny configuration, built offline: Qwen-Image's tiny tokenizer
    with :data:`_EDIT_WORDS` whole and :data:`_BPE_MERGES`, then the :data:`VISION_TOKENS` as its last four ids (where
    ``qwen_text_config(vocab_size)`` puts them); a ``Qwen2VLProcessor`` over it with Qwen2-VL's default image
    processor (14-pixel patches, 2×2 merge, temporal patch 2: the tiny vision tower's)."""
    from transformers import AddedToken, Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    tokenizer = build_tiny_qwen_tokenizer()
    tokenizer.add_tokens([AddedToken(w, single_word=True, normalized=False) for w in _EDIT_WORDS] + [AddedToken(m, normalized=False) for m in _BPE_MERGES])
    vocab_size = len(tokenizer)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS], special_tokens=True)
    assert tokenizer.convert_tokens_to_ids(list(VISION_TOKENS)) == list(range(vocab_size, vocab_size + 4))
    processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(), tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor())
    return tokenizer, processor, vocab_size


def build_edit_text_side(seed: int, shape: Shape | None, device: str, dtype: str) -> dict:
    """The random editing text side: the tiny editing tokenizer and processor (:func:`build_tiny_qwen_edit_processor`)
    and a Qwen2.5-VL over their vocabulary (vision tower included): the tiny one, or at a published ``shape``
    Qwen2.5-VL-7B (:func:`~pipelines.qwen_image.adapter.qwen_text_config`), built on ``device`` in ``dtype``."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    tokenizer, processor, vocab_size = build_tiny_qwen_edit_processor()
    with building(device, dtype, seed):
        text_encoder = Qwen2_5_VLForConditionalGeneration(qwen_text_config(vocab_size, shape)).eval().requires_grad_(False)
    return {"tokenizer": tokenizer, "processor": processor, "text_encoder": text_encoder}


def load_processor(path: str | Path):
    """The ``processor/`` (``Qwen2VLProcessor``) of a local Qwen-Image-Edit folder, checked with every component first."""
    from transformers import Qwen2VLProcessor

    folder = Path(path)
    check_folder(folder, "Qwen-Image-Edit", QWEN_IMAGE_EDIT_COMPONENTS)
    return Qwen2VLProcessor.from_pretrained(str(folder / "processor"), local_files_only=True)


@register_family("qwen_image_edit")
class QwenImageEditAdapter(QwenImageAdapter):
    """Qwen-Image-Edit: :class:`~pipelines.qwen_image.adapter.QwenImageAdapter` with the source image in the text
    encoder's input and as latent tokens.

    Args:
        path: local diffusers folder; ``None`` builds the tiny random configuration.
        dtype, device, seed, decode_chunk, negative_prompt, sample_size, cfg_mode: as
            :class:`~pipelines.qwen_image.adapter.QwenImageAdapter`.
        max_sequence_length: text tokens stored per conditioning besides the source's vision tokens (the
            instruction and the template's end; at most 1024). The pipeline does not truncate: a longer instruction
            is an error.
        shape: with no ``path``, ``tiny`` (the test configuration) or ``qwen_image_edit`` / ``full``: Qwen-Image-Edit's
            published shape (Qwen-Image's transformer) with random weights (:mod:`pipelines.shapes`).
    """

    hub_components = QWEN_IMAGE_EDIT_COMPONENTS

    family = "Qwen-Image-Edit"
    pipeline_class = "QwenImageEditPipeline"
    lora_pipeline = pipeline_class
    editing = True

    def __init__(
        self, path: str | None = None, dtype: str = "float32", device: str = "cpu", seed: int = 0, decode_chunk: int = 16,
        max_sequence_length: int = 512, negative_prompt: str = "", sample_size: int | None = None, cfg_mode: str = "split",
        shape: str = "tiny",
    ):
        processor = None if path is None else load_processor(path)  # the folder checked before anything loads
        # Qwen-Image's transformer, VAE and scheduler (and from a folder its Qwen2.5-VL and tokenizer), as QwenImageAdapter
        # loads or builds them; a random configuration then gets the editing text side
        super().__init__(
            path=path, dtype=dtype, device=device, seed=seed, decode_chunk=decode_chunk, max_sequence_length=max_sequence_length,
            negative_prompt=negative_prompt, sample_size=sample_size, cfg_mode=cfg_mode, shape=parent_shape("qwen_image_edit", shape),
        )
        if processor is None:
            text = build_edit_text_side(seed + 2, resolve_shape("qwen_image_edit", shape), device, dtype)
            processor, self.tokenizers["tokenizer"], self.text_encoders["text_encoder"] = text["processor"], text["tokenizer"], text["text_encoder"]
        self.processor = self.tokenizers["processor"] = processor

    def default_prompts(self):
        """The synthetic editing prompts of :func:`pipelines.tiny.tiny_edit_prompts` (coloured shapes, colour edits)."""
        return tiny_edit_prompts()

    def cache_prompts(self, prompts: list[str]) -> None:
        raise ValueError("Qwen-Image-Edit: the text encoder reads each instruction together with its source image, so there is no text-only prompt cache")

    # -- conditioning ---------------------------------------------------------------------------
    def _encode_batch(self, prompts: list[str], images: torch.Tensor) -> TensorDict:
        """QwenImageEditPipeline._get_qwen_prompt_embeds for ``prompts`` with one source image each: edit template →
        processor (vision tokens, ``pixel_values``) → Qwen2.5-VL ``hidden_states[-1]`` → valid tokens minus the first 64
        → zero-padded with ``prompt_embeds_mask`` to the source's vision tokens + ``max_sequence_length``."""
        enc = self.text_encoders["text_encoder"]
        pixels = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()  # the pipeline's uint8 RGB images
        inputs = self.processor(text=[EDIT_PROMPT_TEMPLATE.format(p) for p in prompts], images=list(pixels), padding=True, return_tensors="pt").to(enc.device)
        hidden = enc(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"], output_hidden_states=True,
        ).hidden_states[-1]
        valid = inputs["attention_mask"].bool()
        seqs = [hidden[i][valid[i]][EDIT_PROMPT_TEMPLATE_START_IDX:] for i in range(len(prompts))]
        vision = int(inputs["image_grid_thw"][0].prod()) // self.processor.image_processor.merge_size**2 + 2  # + vision_start/end
        longest = max(len(s) for s in seqs) - vision
        if longest > self.max_sequence_length:
            raise ValueError(f"Qwen-Image-Edit: an instruction takes {longest} tokens > max_sequence_length={self.max_sequence_length} (the pipeline does not truncate); raise model.options.max_sequence_length (≤ {TOKENIZER_MAX_LENGTH})")
        embeds = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True).to(next(self.denoiser.parameters()).dtype)
        mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(s), dtype=torch.long, device=s.device) for s in seqs], batch_first=True)
        embeds, mask = _trim_text(embeds, mask, vision + self.max_sequence_length)
        return TensorDict({"prompt_embeds": embeds, "prompt_embeds_mask": mask}, batch_size=[len(prompts)])

    def encode_prompts(self, prompts: list[str], images: torch.Tensor | None = None) -> TensorDict:
        """``prompt_embeds [B, L, D]``, ``prompt_embeds_mask [B, L]`` (instruction + source), ``image_latents
        [B, C, h_s, w_s]`` and their ``negative_*`` twins (the negative prompt encoded with the same sources).

        Args:
            prompts: ``B`` edit instructions.
            images: float ``[B, 3, H_s, W_s]`` in [0, 1], the source image of each instruction (any device).
        """
        check_source_images(self, prompts, images)
        with torch.no_grad():
            positive = self._encode_batch(list(prompts), images)
            negative = self._encode_batch([self.negative_prompt] * len(prompts), images)
        source = self.encode_images(images).to(positive["prompt_embeds"].dtype)
        out = {**positive, "image_latents": source}
        out.update({f"negative_{k}": v for k, v in {**negative, "image_latents": source.clone()}.items()})
        return TensorDict(out, batch_size=[len(prompts)])

    # -- denoiser -------------------------------------------------------------------------------
    def _forward(self, latents: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        """One transformer call on ``[noisy tokens; source tokens]`` with both shapes in ``img_shapes``, the text cut to
        the batch's longest valid sequence (an all-ones mask goes in as ``None``); the output cut to the noisy tokens."""
        b, _, h, w = latents.shape
        source = cond["image_latents"].to(latents.device, latents.dtype)
        seq, mask = _trim_text(cond["prompt_embeds"].to(latents.dtype), cond["prompt_embeds_mask"], int(cond["prompt_embeds_mask"].sum(1).max()))
        out = self.denoiser(
            hidden_states=torch.cat([pack_latents(latents), pack_latents(source)], dim=1), timestep=sigma.to(latents.dtype),
            encoder_hidden_states=seq, encoder_hidden_states_mask=None if bool(mask.all()) else mask,
            img_shapes=[[(1, h // 2, w // 2), (1, source.shape[-2] // 2, source.shape[-1] // 2)]] * b, return_dict=False,
        )[0]
        return unpack_latents(out[:, : (h // 2) * (w // 2)], h, w)

    def prompt_tokens(self, height: int | None = None, width: int | None = None) -> int:
        """Valid text-encoder tokens (instruction, template end and the source's vision tokens) of the first default
        prompt, its source resized to ``height × width`` when given."""
        first = self.default_prompts()[0]
        if height is not None and width is not None:
            first = resize_sources([first], height, width)[0]
        cond = self.encode_prompts([first.instruction], first.source[None].float() / 255.0)
        return int(cond["prompt_embeds_mask"].sum(-1).max())

    def forward_flops(self, height: int, width: int, *, lora_rank: int = 0) -> float:
        """:func:`pipelines.flops.qwen_image_forward_flops` over ``2·(h/2)·(w/2)`` image tokens (the noisy latent's and a
        source of the output size, as the trainer resizes sources) and the text tokens of such a source."""
        _, h, w = self.latent_shape(height, width)
        return qwen_image_forward_flops(dict(self.denoiser.config), 2 * (h // 2) * (w // 2), self.prompt_tokens(height, width), lora_rank)


__all__ = ["EDIT_PROMPT_TEMPLATE", "EDIT_PROMPT_TEMPLATE_START_IDX", "QwenImageEditAdapter", "build_tiny_qwen_edit_processor"]
