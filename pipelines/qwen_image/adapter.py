"""The Qwen-Image family over diffusers: ``QwenImageTransformer2DModel`` (MMDiT, velocity prediction) on
2×2-packed latents, the video-style ``AutoencoderKLQwenImage`` (one frame) with per-channel
``latents_mean``/``latents_std``, and a Qwen2.5-VL text encoder, as ``diffusers.QwenImagePipeline``
(``pipelines/qwenimage/pipeline_qwenimage.py``, diffusers 0.42) builds them.

* Prompt embeddings (``_get_qwen_prompt_embeds``): each prompt is put into the chat template
  ``PROMPT_TEMPLATE``; the tokens (padded to the longest, truncated at ``1024 + 34``) go through the text
  encoder with their attention mask; ``hidden_states[-1]`` is taken, each sequence keeps its valid tokens
  minus the template's first ``PROMPT_TEMPLATE_START_IDX = 34`` tokens (the system prompt), and the
  sequences are zero-padded again with ``prompt_embeds_mask`` (1 valid, 0 padding); ``encode_prompt``
  truncates to ``max_sequence_length`` (512 in ``__call__``).
* Storage vs. forward: the pipeline pads to the batch's longest prompt; the conditioning TensorDict here is
  padded to exactly ``max_sequence_length`` (its first tokens equal the pipeline's), because rollouts encode
  one prompt per call and concatenate conditionings of different batches. :meth:`QwenImageAdapter._forward`
  cuts the text to the batch's longest valid prompt before the transformer, so the compute is the
  pipeline's. The transformer takes the mask as ``encoder_hidden_states_mask`` (padding keys are masked out
  of the joint attention; text RoPE positions start after the image's, so padding at the end changes the
  image tokens only by float rounding); as the pipeline does, an all-ones mask is passed as ``None``.
* Latents are kept unpacked, ``[C, h, w]`` with ``h = H / vae_factor`` (even), ``vae_factor =
  2^len(temperal_downsample)``; :meth:`QwenImageAdapter._forward` packs them into ``[(h/2)·(w/2), 4C]``
  tokens (``_pack_latents``, the same 2×2 packing as FLUX) with ``img_shapes = [(1, h/2, w/2)]`` per sample.
* Timestep: the pipeline passes ``t/1000 = σ``; the transformer's projection multiplies by 1000.
* True CFG (``true_cfg_scale``, a real negative prompt, the empty string by default):
  ``comb = neg + s·(cond − neg)``, then ``comb·‖cond‖/‖comb‖`` with the norms over the last dim of the packed
  output (the ``4C`` channels of each 2×2 token), in :meth:`QwenImageAdapter.combine_guidance`. The branches
  run as :meth:`ModelAdapter.predict` runs them (``cfg_mode``); batched, the shorter text is zero-padded and
  masked, which the joint-attention mask makes exact up to float rounding. The negative branch is detached.
* Schedule: ``linspace(1, 1/K, K)`` time-shifted with ``μ = calculate_shift((h/2)·(w/2))`` from the scheduler
  config (exponential: ``σ' = e^μ / (e^μ + 1/σ − 1)``), stretched so the last sigma is ``shift_terminal``
  when the config sets one (``1 − σ'' = (1 − σ')·(1 − shift_terminal)/(1 − σ'_K)``), then a final 0
  (``FlowMatchEulerDiscreteScheduler.set_timesteps``).
* VAE normalisation: ``latents = (z − latents_mean) / latents_std`` (the pipeline decodes
  ``z = latents / (1/latents_std) + latents_mean``, then ``vae.decode(z[:, :, None])[:, :, 0]``).

``model.path`` is a local diffusers folder (``transformer/``, ``vae/``, ``text_encoder/``, ``tokenizer/``,
``scheduler/``); with no path the family builds a tiny random configuration offline (tokenizer included).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tensordict import TensorDict

from pipelines.base import check_cfg_mode, register_family, torch_dtype
from pipelines.flops import qwen_image_forward_flops
from pipelines.latent import LatentFlowFamily, check_folder, load_common, own_memory, pack_latents, unpack_latents
from pipelines.schedules import calculate_shift, terminal_stretched_sigmas
from pipelines.shapes import QWEN2_5_VL_7B, Shape, building, family_components, plain, register_shape

# the family's published shapes (``model.options.shape``; pipelines.shapes)
register_shape(Shape(
    "qwen_image", "qwen_image",
    dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
         joint_attention_dim=3584, axes_dims_rope=(16, 56, 56)),
    dict(base_dim=96, z_dim=16, dim_mult=(1, 2, 4, 4), num_res_blocks=2, attn_scales=(), temperal_downsample=(False, True, True)),
    {"qwen2_5_vl": 3584}, 512, 20.43, "Qwen/Qwen-Image transformer/config.json, vae/config.json",
), full=True)

PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, spatial "
    "relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
PROMPT_TEMPLATE_START_IDX = 34  # tokens of the template's system part, dropped from the embeddings
TOKENIZER_MAX_LENGTH = 1024

# Qwen-Image's scheduler config (dynamic exponential shift, stretched to a terminal sigma of 0.02)
QWEN_IMAGE_SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.0,
    "use_dynamic_shifting": True, "base_image_seq_len": 256, "max_image_seq_len": 8192, "base_shift": 0.5,
    "max_shift": 0.9, "shift_terminal": 0.02, "time_shift_type": "exponential", "invert_sigmas": False,
    "stochastic_sampling": False, "use_karras_sigmas": False, "use_exponential_sigmas": False, "use_beta_sigmas": False,
}
QWEN_IMAGE_COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")

# tiny random configuration (tests): text width 32 = the transformer's joint_attention_dim; VAE factor 2
TINY_QWEN_TRANSFORMER = dict(
    patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
    joint_attention_dim=32, axes_dims_rope=(4, 6, 6),
)
TINY_QWEN_VAE = dict(
    base_dim=8, z_dim=4, dim_mult=(1, 2), num_res_blocks=1, attn_scales=(), temperal_downsample=(False,),
    latents_mean=(-0.7571, -0.7089, -0.9113, 0.1075), latents_std=(2.8184, 1.4541, 2.3275, 2.6558),
)
TINY_QWEN_TEXT = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
    max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
    bos_token_id=None, rms_norm_eps=1e-6,
)
TINY_QWEN_VISION = dict(
    depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=14, spatial_merge_size=2,
    temporal_patch_size=2, fullatt_block_indexes=[0], window_size=28,
)
# whole-word vocabulary entries of the tiny tokenizer: the template's words, so that its system part is
# exactly PROMPT_TEMPLATE_START_IDX tokens, as with the real Qwen tokenizer
_TEMPLATE_WORDS = (
    "system", "user", "assistant", "Describe", "the", "image", "by", "detailing", "color", "shape", "size", "texture",
    "quantity", "text", "spatial", "relationships", "of", "objects", "and", "background",
)


def build_tiny_qwen_tokenizer():
    """An offline chat tokenizer for the tiny configuration (``PreTrainedTokenizerFast`` over a WordPiece model
    built in code): special tokens ``<|endoftext|>`` (padding), ``<|im_start|>``, ``<|im_end|>``, ``<unk>``; the
    newline as a token; the template's words whole; any other word as characters (``x``, ``##x``). Spaces are
    dropped, punctuation is split off. The template's system part tokenises to 34 tokens, like Qwen2's BPE."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(string.ascii_letters + string.digits + string.punctuation)
    vocab: dict[str, int] = {}
    for token in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "\n", *_TEMPLATE_WORDS, *chars, *("##" + c for c in chars)]:
        vocab.setdefault(token, len(vocab))
    tok = Tokenizer(models.WordPiece(vocab, unk_token="<unk>", max_input_chars_per_word=100))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
        pre_tokenizers.Split(Regex(r"\n"), behavior="isolated"),
        pre_tokenizers.Punctuation("isolated"),
    ])
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>", unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"], model_max_length=TOKENIZER_MAX_LENGTH + PROMPT_TEMPLATE_START_IDX,
    )


def qwen_text_config(vocab_size: int, shape: Shape | None = None):
    """The ``Qwen2_5_VLConfig`` over a tokenizer of ``vocab_size`` ids, whose next four ids are the vision tokens: the
    tiny one (2 text layers of width 32, a 1-layer vision tower) with no ``shape``; at a published ``shape``
    Qwen2.5-VL-7B's (:data:`pipelines.shapes.QWEN2_5_VL_7B`: 28 layers of 3584, the 32-block vision tower, an untied
    lm_head), or with ``shape.stand_in_text`` 2 text layers of the real width (heads of 128, 4 key/value heads, M-RoPE
    sections 16/24/24 as Qwen2.5-VL-7B's) over the tiny vision tower."""
    from transformers import Qwen2_5_VLConfig

    v = max(vocab_size, 64)
    text, vision, vocab, tied = dict(TINY_QWEN_TEXT), dict(TINY_QWEN_VISION), v + 4, {}
    if shape is not None and shape.stand_in_text:
        width = shape.text_widths["qwen2_5_vl"]
        text.update(hidden_size=width, num_attention_heads=width // 128, num_key_value_heads=4, intermediate_size=1024,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]})
        vision.update(out_hidden_size=width)
    elif shape is not None:
        text, vision = dict(QWEN2_5_VL_7B["text"]), dict(QWEN2_5_VL_7B["vision"])
        vocab = text.pop("vocab_size")
        tied = {"tie_word_embeddings": text["tie_word_embeddings"]}
        if v + 4 > vocab:
            raise ValueError(f"a tokenizer of {v + 4} ids does not fit Qwen2.5-VL-7B's vocabulary of {vocab}")
    return Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, pad_token_id=0, eos_token_id=2, **text), vision_config=vision,
        image_token_id=v, video_token_id=v + 1, vision_start_token_id=v + 2, vision_end_token_id=v + 3, **tied,
    )


def build_tiny_qwen_text_encoder(seed: int, vocab_size: int):
    """A tiny random ``Qwen2_5_VLForConditionalGeneration`` (:func:`qwen_text_config`)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    config = qwen_text_config(vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2_5_VLForConditionalGeneration(config).eval()


def build_tiny_qwen_image_components(seed: int = 0) -> dict:
    """The tiny random Qwen-Image-shaped components (CPU, fp32): transformer, VAE, Qwen2.5-VL, tokenizer."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    tokenizer = build_tiny_qwen_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = QwenImageTransformer2DModel(**TINY_QWEN_TRANSFORMER)
        torch.manual_seed(seed + 1)
        vae = AutoencoderKLQwenImage(**{k: list(v) if isinstance(v, tuple) else v for k, v in TINY_QWEN_VAE.items()})
    return {
        "transformer": transformer, "vae": vae, "text_encoder": build_tiny_qwen_text_encoder(seed + 2, len(tokenizer)),
        "tokenizer": tokenizer, "scheduler": dict(QWEN_IMAGE_SCHEDULER_CONFIG),
    }


def build_qwen_image_components(seed: int, shape: Shape, device: str, dtype: str) -> dict:
    """Qwen-Image components at a published shape (:mod:`pipelines.shapes`), random, built on ``device`` in ``dtype``:
    the transformer, the VAE and Qwen2.5-VL-7B at their published configs (:func:`qwen_text_config`)."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    tokenizer = build_tiny_qwen_tokenizer()
    with building(device, dtype, seed):
        transformer = QwenImageTransformer2DModel(**shape.transformer)
        vae = AutoencoderKLQwenImage(**plain(shape.vae))
        text_encoder = Qwen2_5_VLForConditionalGeneration(qwen_text_config(len(tokenizer), shape)).eval()
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer, "scheduler": dict(QWEN_IMAGE_SCHEDULER_CONFIG)}


def load_qwen_image_components(path: str | Path) -> dict:
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    folder = Path(path)
    check_folder(folder, "Qwen-Image", QWEN_IMAGE_COMPONENTS)
    parts = load_common(folder, "Qwen-Image", "QwenImageTransformer2DModel", "AutoencoderKLQwenImage")
    parts["text_encoder"] = own_memory(Qwen2_5_VLForConditionalGeneration.from_pretrained(str(folder / "text_encoder"), local_files_only=True))
    parts["tokenizer"] = AutoTokenizer.from_pretrained(str(folder / "tokenizer"), local_files_only=True)
    return parts


def true_cfg(cond: torch.Tensor, neg: torch.Tensor, scale: float) -> torch.Tensor:
    """QwenImagePipeline's true CFG on packed outputs ``[B, N, 4C]``: ``comb = neg + s·(cond − neg)``, rescaled to
    the conditional prediction's norm per token, ``comb·‖cond‖/‖comb‖`` (norms over the last dim)."""
    comb = neg + scale * (cond - neg)
    return comb * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))


def _trim_text(embeds: torch.Tensor, mask: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``embeds [B, L, D]`` and ``mask [B, L]`` cut (or zero-padded) on the sequence dim to ``length``: the
    conditioning is stored padded to ``max_sequence_length``; the transformer only sees the batch's longest text."""
    extra = length - embeds.shape[1]
    if extra <= 0:
        return embeds[:, :length], mask[:, :length]
    return torch.nn.functional.pad(embeds, (0, 0, 0, extra)), torch.nn.functional.pad(mask, (0, extra))


@register_family("qwen_image")
class QwenImageAdapter(LatentFlowFamily):
    """Qwen-Image (text-to-image MMDiT, rectified flow, true CFG with norm rescale).

    Args:
        path: local diffusers folder; ``None`` builds the tiny random configuration.
        dtype: dtype of the transformer, VAE and text encoder (``float32`` | ``bfloat16`` | ``float16``).
        device: torch device; seed: init seed of the random configuration.
        decode_chunk: images per VAE decode call.
        drop_text_encoders: delete the text encoder after :meth:`cache_prompts` (serve cached embeddings).
        max_sequence_length: prompt tokens kept after the template (QwenImagePipeline's default 512, at most 1024).
        negative_prompt: the true-CFG negative prompt (the empty string by default).
        sample_size: image side (pixels) whose packed sequence length sets the default dynamic shift when
            :meth:`schedule` gets no ``height``/``width`` (None: the pipeline's default ``128·vae_factor``).
        cfg_mode: how a guided ``predict`` runs its two branches (``split`` | ``batched``, see
            :meth:`ModelAdapter.predict`).
        shape: with no ``path``, ``tiny`` (the test configuration) or ``qwen_image`` / ``full``: Qwen-Image's published
            shape (20.4 B) with random weights (:mod:`pipelines.shapes`).
    """

    hub_components = QWEN_IMAGE_COMPONENTS

    family = "Qwen-Image"
    pipeline_class = "QwenImagePipeline"
    lora_pipeline = pipeline_class
    text_encoder_names = ("text_encoder",)
    tokenizer_names = ("tokenizer",)
    # the joint attention of every block: image-stream and text-stream (context) projections
    lora_target_modules = [
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
        "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    ]

    def __init__(
        self, path: str | None = None, dtype: str = "float32", device: str = "cpu", seed: int = 0,
        decode_chunk: int = 16, drop_text_encoders: bool = False, max_sequence_length: int = 512,
        negative_prompt: str = "", sample_size: int | None = None, cfg_mode: str = "split", shape: str = "tiny",
    ):
        torch_dtype(dtype)
        self.cfg_mode = check_cfg_mode(cfg_mode)
        if not 1 <= int(max_sequence_length) <= TOKENIZER_MAX_LENGTH:
            raise ValueError(f"Qwen-Image: max_sequence_length must be in [1, {TOKENIZER_MAX_LENGTH}], got {max_sequence_length}")
        parts = family_components("qwen_image", path=path, shape=shape, seed=seed, device=device, dtype=dtype,
                                  load=load_qwen_image_components, tiny=build_tiny_qwen_image_components, build=build_qwen_image_components)
        self._setup(parts, dtype, device, decode_chunk, drop_text_encoders)
        self.max_sequence_length = int(max_sequence_length)
        self.negative_prompt = str(negative_prompt)
        config = self.denoiser.config
        if config.guidance_embeds or config.get("use_additional_t_cond", False):
            raise ValueError("Qwen-Image: transformers with guidance_embeds or use_additional_t_cond are not text-to-image Qwen-Image; not supported")
        self.latent_channels = int(config.in_channels) // 4
        self.sample_size = int(sample_size if sample_size is not None else 128 * self.vae_factor)

    def _setup_vae_normalisation(self) -> None:
        """AutoencoderKLQwenImage's per-channel ``latents_mean``/``latents_std`` in place of the
        ``shift_factor``/``scaling_factor`` of an ``AutoencoderKL``."""
        cfg = self.vae.config
        self.vae_factor = 2 ** len(cfg.temperal_downsample)
        self.latents_mean = torch.tensor(cfg.latents_mean, dtype=torch.float32).view(1, cfg.z_dim, 1, 1)
        self.latents_std = torch.tensor(cfg.latents_std, dtype=torch.float32).view(1, cfg.z_dim, 1, 1)

    # -- schedule -------------------------------------------------------------------------------
    @property
    def shift(self) -> float:  # type: ignore[override]
        """The multiplicative shift ``e^μ`` at the default ``sample_size`` (what :meth:`schedule` uses without a size)."""
        return self.dynamic_shift(self.sample_size, self.sample_size)

    def dynamic_shift(self, height: int, width: int) -> float:
        """``e^μ``, ``μ = calculate_shift((h/2)·(w/2))`` for the latent size ``h × w`` of ``height × width`` pixels
        (the scheduler config's static ``shift`` when it does not use dynamic shifting)."""
        if not self.scheduler_config.get("use_dynamic_shifting", False):
            return float(self.scheduler_config.get("shift", 1.0))
        h, w = height // self.vae_factor, width // self.vae_factor
        mu = calculate_shift((h // 2) * (w // 2), self.scheduler_config)
        return math.exp(mu) if self.scheduler_config.get("time_shift_type", "exponential") == "exponential" else mu

    def schedule(self, num_steps: int, shift: float | None = None, *, height: int | None = None, width: int | None = None) -> torch.Tensor:
        """QwenImagePipeline's sigmas ``[num_steps + 1]`` for an image of ``height × width`` (default ``sample_size``²):
        the grid ``linspace(1, 1/K, K)``, shifted ``σ' = s·σ / (1 + (s − 1)·σ)`` with ``s = e^μ`` (exponential time
        shift; ``s = μ`` for the linear type), stretched to end at ``shift_terminal`` when the scheduler config sets it,
        then a final 0. An explicit ``shift`` replaces ``s`` (the terminal stretch still applies)."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be ≥ 1, got {num_steps}")
        s = float(shift) if shift is not None else self.dynamic_shift(height or self.sample_size, width or self.sample_size)
        return terminal_stretched_sigmas(num_steps, s, self.scheduler_config.get("shift_terminal"))

    # -- prompt embeddings ----------------------------------------------------------------------
    def _encode_batch(self, prompts: list[str]) -> TensorDict:
        """QwenImagePipeline.encode_prompt: template → tokens → ``hidden_states[-1]`` → drop the first 34 valid
        tokens of each → re-pad to the longest with ``prompt_embeds_mask`` → truncate to ``max_sequence_length``."""
        tokenizer, enc = self.tokenizers["tokenizer"], self.text_encoders["text_encoder"]
        tokens = tokenizer(
            [PROMPT_TEMPLATE.format(p) for p in prompts], max_length=TOKENIZER_MAX_LENGTH + PROMPT_TEMPLATE_START_IDX,
            padding=True, truncation=True, return_tensors="pt",
        ).to(enc.device)
        hidden = enc(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True).hidden_states[-1]
        valid = tokens.attention_mask.bool()
        seqs = [hidden[i][valid[i]][PROMPT_TEMPLATE_START_IDX:] for i in range(len(prompts))]
        dtype = next(self.denoiser.parameters()).dtype
        return self._pad_stack([s.to(dtype) for s in seqs], [torch.ones(len(s), dtype=torch.long, device=s.device) for s in seqs])

    def _pad_stack(self, seqs: list[torch.Tensor], masks: list[torch.Tensor]) -> TensorDict:
        """Per-prompt embeddings ``[L_i, D]`` truncated to ``max_sequence_length`` and zero-padded to exactly
        ``max_sequence_length`` (mask 0 on the padding), so that conditionings of any two batches concatenate."""
        n = self.max_sequence_length
        embeds = torch.stack([torch.nn.functional.pad(s[:n], (0, 0, 0, n - min(len(s), n))) for s in seqs])
        mask = torch.stack([torch.nn.functional.pad(m[:n], (0, n - min(len(m), n))) for m in masks])
        return TensorDict({"prompt_embeds": embeds, "prompt_embeds_mask": mask}, batch_size=[len(seqs)])

    def cache_prompts(self, prompts: list[str]) -> None:
        """Encode ``prompts`` and the negative prompt once (see :meth:`LatentFlowFamily.cache_prompts`)."""
        super().cache_prompts([*prompts, self.negative_prompt])

    def encode_prompts(self, prompts: list[str]) -> TensorDict:
        """``prompt_embeds [B, L, D]``, ``prompt_embeds_mask [B, L]`` and the negative prompt's
        ``negative_prompt_embeds [B, L_neg, D]``, ``negative_prompt_embeds_mask [B, L_neg]``."""
        return self._with_negative(prompts, self.negative_prompt)

    # -- denoiser -------------------------------------------------------------------------------
    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        h, w = self._check_size(height, width, self.vae_factor * 2)
        return (self.latent_channels, h, w)

    def _forward(self, latents: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        """One transformer call on the packed latents, the text cut to the batch's longest valid prompt; an
        all-ones mask goes in as ``None`` (as in the pipeline)."""
        b, _, h, w = latents.shape
        seq, mask = cond["prompt_embeds"].to(latents.dtype), cond["prompt_embeds_mask"]
        seq, mask = _trim_text(seq, mask, int(mask.sum(1).max()))
        out = self.denoiser(
            hidden_states=pack_latents(latents), timestep=sigma.to(latents.dtype), encoder_hidden_states=seq,
            encoder_hidden_states_mask=None if bool(mask.all()) else mask, img_shapes=[[(1, h // 2, w // 2)]] * b,
            return_dict=False,
        )[0]
        return unpack_latents(out, h, w)

    def predict(self, latents: torch.Tensor, sigma: torch.Tensor, cond: TensorDict, guidance_scale: float) -> torch.Tensor:
        """Velocity for ``latents [B, C, h, w]``: :meth:`ModelAdapter.predict` with true CFG (:meth:`combine_guidance`)
        for ``guidance_scale > 1``; in ``batched`` mode both texts are cut to their common longest valid length."""
        if guidance_scale < 1.0:
            raise ValueError(f"Qwen-Image: true CFG needs guidance_scale ≥ 1 (1 = no CFG), got {guidance_scale} (sampler.guidance_scale)")
        return super().predict(latents, sigma, cond, guidance_scale)

    def combine_guidance(self, cond: torch.Tensor, uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """:func:`true_cfg` on the packed outputs (the norm rescale runs over each 2×2 token's ``4C`` channels)."""
        h, w = cond.shape[-2:]
        return unpack_latents(true_cfg(pack_latents(cond), pack_latents(uncond), guidance_scale), h, w)

    def prompt_tokens(self) -> int:
        """Valid text tokens of the first default prompt: the conditioning is stored padded to
        ``max_sequence_length``, and :meth:`_forward` runs only the valid ones."""
        cond = self.encode_prompts([self.default_prompts()[0]])
        return int(cond["prompt_embeds_mask"].sum(-1).max())

    def forward_flops(self, height: int, width: int, *, lora_rank: int = 0) -> float:
        """:func:`pipelines.flops.qwen_image_forward_flops` over the ``(h/2)·(w/2)`` packed latent tokens."""
        _, h, w = self.latent_shape(height, width)
        return qwen_image_forward_flops(dict(self.denoiser.config), h * w // 4, self.prompt_tokens(), lora_rank)

    # -- VAE ------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """``z = latents / (1/latents_std) + latents_mean`` → ``vae.decode(z[:, :, None])[:, :, 0]`` → ``x/2 + 1/2``
        in [0, 1], in chunks of ``decode_chunk`` images."""
        chunks = []
        for part in latents.split(self.decode_chunk):
            part = part.to(self.vae.device, self.vae.dtype)
            mean = self.latents_mean.to(part.device, part.dtype)
            inv_std = 1.0 / self.latents_std.to(part.device, part.dtype)
            z = (part / inv_std + mean).unsqueeze(2)
            chunks.append(self.vae.decode(z, return_dict=False)[0][:, :, 0].float())
        return (torch.cat(chunks) / 2 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`decode`: ``(mean(VAE.encode((2x − 1)[:, :, None]))[:, :, 0] − latents_mean)·(1/latents_std)``."""
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"encode_images expects float images [B, 3, H, W] in [0, 1], got shape {tuple(images.shape)}")
        out = []
        for part in images.split(self.decode_chunk):
            x = (part.to(self.vae.device, self.vae.dtype) * 2 - 1).unsqueeze(2)
            z = self.vae.encode(x).latent_dist.mean[:, :, 0].float()
            out.append((z - self.latents_mean.to(z.device)) * (1.0 / self.latents_std.to(z.device)))
        return torch.cat(out)


__all__ = ["QwenImageAdapter", "build_tiny_qwen_image_components", "load_qwen_image_components", "true_cfg"]
