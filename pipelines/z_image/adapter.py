"""The Z-Image family (Z-Image base and Z-Image-Turbo) over diffusers: ``ZImageTransformer2DModel`` (a single-stream
DiT with noise and context refiners), the FLUX.1 ``AutoencoderKL`` (``shift_factor``/``scaling_factor``) and a Qwen3
text encoder, as ``diffusers.ZImagePipeline`` (``pipelines/z_image/pipeline_z_image.py``, diffusers 0.42) builds them.

* Prompt embeddings (``_encode_prompt``): each prompt becomes the chat message ``[{"role": "user", "content": p}]``
  rendered by the tokenizer's chat template (``add_generation_prompt=True, enable_thinking=True``: Qwen3's template
  then adds no empty think block); the text, template included, is tokenised padded and truncated to
  ``max_sequence_length`` (512); the encoder runs with the attention mask and ``hidden_states[-2]`` (the next-to-last
  layer's output) is taken; each prompt keeps its valid tokens only (a list of ``[L_i, D]``).
* Storage vs. forward: the conditioning here is the pipeline's tokens zero-padded to ``max_sequence_length`` with
  ``prompt_embeds_mask`` (1 valid), so that conditionings of different batches concatenate. The denoiser
  (:class:`ZImageTransformer2DModel`, the diffusers model with a batched-tensor ``forward``) hands the transformer
  each sample's valid tokens only, as the pipeline does: the transformer pads every caption to a multiple of 32 with
  its own pad token and places the image's RoPE positions after the padded caption, so extra padding would change
  the result.
* Latents ``[C, h, w]``, ``h = H / vae_factor`` (even); the transformer takes a list of ``[C, 1, h, w]`` and patchifies
  2×2 itself (``all_patch_size=(2,)``, ``all_f_patch_size=(1,)``).
* Timestep and sign: the pipeline gives the transformer ``(1000 − t)/1000 = 1 − σ`` (``t = 1000·σ``; the transformer
  multiplies by ``t_scale = 1000``), so the model's time runs from 0 (noise) to 1 (data), and it steps the scheduler
  with the negated output. The model thus predicts ``x0 − ε``; the velocity ``v = ε − x0`` of our convention is
  ``−output``, at ``timestep = 1 − σ``.
* CFG (base model): the pipeline's ``guidance_scale`` ``g`` gives ``pos + g·(pos − neg)``, which is our
  ``neg + s·(pos − neg)`` with ``s = g + 1``; so ``sampler.guidance_scale = s`` = the pipeline's ``guidance_scale + 1``
  and ``s = 1`` (the pipeline's 0) runs the conditional branch only. Z-Image-Turbo is few-step distilled and sampled
  without CFG (the pipeline's ``guidance_scale=0.0``, 8–9 steps): ``sampler.guidance_scale=1``. The negative prompt is
  the empty string by default. ``cfg_normalization`` (> 0) caps ``‖comb‖`` at ``cfg_normalization·‖pos‖`` per sample
  (norms over the whole latent); ``cfg_truncation`` (≤ 1) turns CFG off for steps with ``1 − σ > cfg_truncation``. The
  negative branch is detached when training.
* Schedule: ``sigmas = linspace(1, 1/K, K)`` (``get_default_z_image_sigmas``) through
  ``FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=…, mu=…)``: the static shift ``s·σ/(1 + (s − 1)·σ)`` of the
  scheduler config (Z-Image-Turbo: ``shift = 3``, no dynamic shifting), or, with ``use_dynamic_shifting``, the time
  shift with ``μ = calculate_shift((h/2)·(w/2))``; stretched to ``shift_terminal`` if the config sets one; then a final 0.
* VAE: ``latents = (z − shift_factor)·scaling_factor`` (0.1159 and 0.3611, FLUX.1's VAE); decode
  ``z = latents / scaling_factor + shift_factor``.

``model.path`` is a local diffusers folder (``transformer/``, ``vae/``, ``text_encoder/``, ``tokenizer/``,
``scheduler/``) or a Hub id (``Tongyi-MAI/Z-Image-Turbo``); with no path the family builds a tiny random configuration
offline (a Qwen3 of width 32 over a tokenizer built in code with a Qwen3-style chat template).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tensordict import TensorDict

from pipelines.base import check_cfg_mode, register_family, torch_dtype
from pipelines.latent import LatentFlowFamily, check_folder, own_memory, read_scheduler
from pipelines.qwen_image.adapter import build_tiny_qwen_tokenizer
from pipelines.schedules import calculate_shift, terminal_stretched_sigmas
from pipelines.shapes import SD3_FLUX_VAE, Shape, building, family_components, plain, register_shape
from pipelines.tiny import build_tiny_vae

# Z-Image-Turbo's transformer: Tongyi-MAI/Z-Image-Turbo transformer/config.json, whose values are the defaults of
# diffusers' ZImageTransformer2DModel.__init__ (models/transformers/transformer_z_image.py, diffusers 0.42): dim 3840,
# 30 layers, 2 noise- and 2 context-refiner layers, 30 heads (of 128), Qwen3-4B caption features of 2560, RoPE axes
# 32/48/48. ``num_layers`` stands for the model's ``n_layers`` (the key pipelines.shapes counts and resizes blocks by;
# :func:`transformer_config` renames it).
Z_IMAGE_TURBO_TRANSFORMER = dict(
    all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, num_layers=30, n_refiner_layers=2, n_heads=30,
    n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0, t_scale=1000.0,
    axes_dims=(32, 48, 48), axes_lens=(1024, 512, 512),
)
# Qwen3-4B (Tongyi-MAI/Z-Image-Turbo text_encoder/config.json = Qwen/Qwen3-4B's): 36 layers of 2560, GQA 32/8 heads of 128
QWEN3_4B = dict(
    hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1000000.0,
)

register_shape(Shape(
    "z_image_turbo", "z_image", Z_IMAGE_TURBO_TRANSFORMER, SD3_FLUX_VAE, {"qwen3_4b": 2560}, 512, 6.15,
    "Tongyi-MAI/Z-Image-Turbo transformer/config.json (the defaults of diffusers' ZImageTransformer2DModel), vae/config.json",
), full=True)

# Z-Image-Turbo's scheduler config (Tongyi-MAI/Z-Image-Turbo scheduler/scheduler_config.json): static shift 3
Z_IMAGE_SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False,
}
Z_IMAGE_VAE_NORM = dict(shift_factor=0.1159, scaling_factor=0.3611)  # the FLUX.1 VAE's (Z-Image's vae/config.json)
Z_IMAGE_COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
MAX_SEQUENCE_LENGTH = 512  # ZImagePipeline's default; the template's tokens count towards it

# tiny random configuration (tests): text width 32 = cap_feat_dim; head dim 16 = sum(axes_dims); VAE factor 2
TINY_Z_IMAGE_TRANSFORMER = dict(
    all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=32, num_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
    norm_eps=1e-5, qk_norm=True, cap_feat_dim=32, rope_theta=256.0, t_scale=1000.0, axes_dims=(4, 6, 6), axes_lens=(1024, 64, 64),
)
TINY_QWEN3 = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=1000000.0,
)
# Qwen3's chat template for what ZImagePipeline renders (user messages, a generation prompt; with enable_thinking=False
# an empty think block), for the tiny tokenizer: the real tokenizer brings its own
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages -%}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{ '<think>\n\n</think>\n\n' }}{%- endif -%}{%- endif -%}"
)


def z_image_transformer_class() -> type:
    """``ZImageTransformer2DModel``: diffusers' ``ZImageTransformer2DModel`` with a batched-tensor ``forward`` (the denoiser
    diffrl wraps with LoRA and FSDP). Same class name, so a saved folder is a diffusers folder; its parameters, config
    and blocks are diffusers'. Made on first use (importing diffusers at import time would slow every import of
    ``pipelines``) and kept as this module's ``ZImageTransformer2DModel``."""
    cls = globals().get("ZImageTransformer2DModel")
    if cls is not None:
        return cls
    import diffusers
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    base = diffusers.ZImageTransformer2DModel

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_attention_mask: torch.Tensor | None = None, return_dict: bool = True, joint_attention_kwargs: dict | None = None):
        """``hidden_states [B, C, h, w]``, the model's ``timestep [B]`` (``1 − σ``), caption features ``[B, L, D]`` with
        their mask ``[B, L]`` (None: all valid) → the model output ``[B, C, h, w]`` (``x0 − ε``), from the diffusers
        forward on the lists ``[C, 1, h, w]`` and each sample's valid caption tokens (as ZImagePipeline calls it). Lists
        (ZImagePipeline's own call) go to the diffusers forward unchanged."""
        if isinstance(hidden_states, (list, tuple)):  # ZImagePipeline's call: lists of [C, 1, h, w] and [L_i, D]
            return base.forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=return_dict,
                                joint_attention_kwargs=joint_attention_kwargs)
        if hidden_states.ndim != 4:
            raise ValueError(f"Z-Image denoiser expects latents [B, C, h, w], got shape {tuple(hidden_states.shape)}")
        if encoder_attention_mask is None:
            caps = list(encoder_hidden_states.unbind(0))
        else:
            keep = encoder_attention_mask.bool()
            caps = [encoder_hidden_states[i][keep[i]] for i in range(hidden_states.shape[0])]
        out = base.forward(self, list(hidden_states.unsqueeze(2).unbind(0)), timestep, caps, return_dict=False,
                           joint_attention_kwargs=joint_attention_kwargs)[0]
        sample = torch.stack(out).squeeze(2)
        return (sample,) if not return_dict else Transformer2DModelOutput(sample=sample)

    cls = type("ZImageTransformer2DModel", (base,), {"forward": forward, "__module__": __name__, "__doc__": z_image_transformer_class.__doc__})
    globals()["ZImageTransformer2DModel"] = cls
    return cls


def transformer_config(config: dict) -> dict:
    """A shape's transformer dict as ``ZImageTransformer2DModel`` keyword arguments (``num_layers`` → ``n_layers``, lists)."""
    out = plain(dict(config))
    out["n_layers"] = out.pop("num_layers")
    return out


def build_tiny_z_image_tokenizer():
    """The offline Qwen-style tokenizer of the tiny Qwen-Image configuration with Qwen3's chat template."""
    tokenizer = build_tiny_qwen_tokenizer()
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def qwen3_config(vocab_size: int, shape: Shape | None = None):
    """The ``Qwen3Config``: the tiny one (2 layers of width 32) with no ``shape``; Qwen3-4B's (:data:`QWEN3_4B`) at a
    published ``shape``, or with ``shape.stand_in_text`` 2 layers of its width 2560 (heads of 128, 8 key/value heads)."""
    from transformers import Qwen3Config

    config = dict(TINY_QWEN3, vocab_size=max(vocab_size, 64))
    if shape is not None and shape.stand_in_text:
        width = shape.text_widths["qwen3_4b"]
        config.update(hidden_size=width, num_attention_heads=width // 128, num_key_value_heads=8, head_dim=128, intermediate_size=1024)
    elif shape is not None:
        config = dict(QWEN3_4B)
        if vocab_size > config["vocab_size"]:
            raise ValueError(f"a tokenizer of {vocab_size} ids does not fit Qwen3-4B's vocabulary of {config['vocab_size']}")
    return Qwen3Config(pad_token_id=0, bos_token_id=None, eos_token_id=2, **config)


def build_tiny_z_image_components(seed: int = 0) -> dict:
    """The tiny random Z-Image-shaped components (CPU, fp32): transformer, VAE (factor 2), Qwen3, tokenizer."""
    from transformers import Qwen3Model

    tokenizer = build_tiny_z_image_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = z_image_transformer_class()(**transformer_config(TINY_Z_IMAGE_TRANSFORMER))
        torch.manual_seed(seed + 2)
        text_encoder = Qwen3Model(qwen3_config(len(tokenizer))).eval()
    return {
        "transformer": transformer, "vae": build_tiny_vae(seed + 1, **Z_IMAGE_VAE_NORM), "text_encoder": text_encoder,
        "tokenizer": tokenizer, "scheduler": dict(Z_IMAGE_SCHEDULER_CONFIG),
    }


def build_z_image_components(seed: int, shape: Shape, device: str, dtype: str) -> dict:
    """Z-Image components at a published shape (:mod:`pipelines.shapes`), random, built on ``device`` in ``dtype``: the
    transformer, the FLUX.1 VAE and Qwen3-4B at their published configs (:func:`qwen3_config`)."""
    from diffusers import AutoencoderKL
    from transformers import Qwen3Model

    tokenizer = build_tiny_z_image_tokenizer()
    with building(device, dtype, seed):
        transformer = z_image_transformer_class()(**transformer_config(shape.transformer))
        vae = AutoencoderKL(**plain(shape.vae), **Z_IMAGE_VAE_NORM)
        text_encoder = Qwen3Model(qwen3_config(len(tokenizer), shape)).eval()
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer, "scheduler": dict(Z_IMAGE_SCHEDULER_CONFIG)}


def load_z_image_components(path: str | Path) -> dict:
    """The components of a local Z-Image diffusers folder (the transformer as :class:`ZImageTransformer2DModel`; the
    text encoder as ``AutoModel``: Qwen3's base model, whose ``hidden_states`` the pipeline reads)."""
    from transformers import AutoModel, AutoTokenizer
    from diffusers import AutoencoderKL

    folder = Path(path)
    check_folder(folder, "Z-Image", Z_IMAGE_COMPONENTS)
    parts = {
        "transformer": own_memory(z_image_transformer_class().from_pretrained(str(folder / "transformer"), local_files_only=True)),
        "vae": own_memory(AutoencoderKL.from_pretrained(str(folder / "vae"), local_files_only=True)),
        "scheduler": read_scheduler(folder, "Z-Image"),
    }
    parts["text_encoder"] = own_memory(AutoModel.from_pretrained(str(folder / "text_encoder"), local_files_only=True))
    parts["tokenizer"] = AutoTokenizer.from_pretrained(str(folder / "tokenizer"), local_files_only=True)
    return parts


def z_image_forward_flops(config: dict, n_image: int, n_text: int, lora_rank: int = 0) -> float:
    """One sample through ``ZImageTransformer2DModel`` (the convention of :mod:`pipelines.flops`: matmuls and attention
    at 2 FLOPs per multiply-add). ``n_image`` = 2×2 patches, ``n_text`` = valid caption tokens; both are padded to a
    multiple of 32 inside the model, and the padding is computed too. With ``D = dim``, ``E = min(D, 256)``, FFN width
    ``F = int(D/3·8)``, per block over ``m`` tokens: q/k/v/out ``2·m·D·(D + 2·kv + D)``, attention ``4·m²·D``, the
    SwiGLU FFN ``3·2·m·D·F`` (+ ``2·E·4D`` modulation in the noise refiner and main layers). Refiners run on the image
    (noise) and caption (context) tokens alone, the main layers on both; the final layer projects every token. LoRA
    (``lora_rank``) on to_q/to_k/to_v/to_out.0."""
    D, heads = int(config["dim"]), int(config["n_heads"])
    kv = int(config.get("n_kv_heads") or heads) * (D // heads)
    p, fp = int(config["all_patch_size"][0]), int(config["all_f_patch_size"][0])
    patch = p * p * fp * int(config["in_channels"])
    E, F = min(D, 256), int(D / 3 * 8)
    n, t = n_image + (-n_image) % 32, n_text + (-n_text) % 32

    def lin(m, a, b):
        return 2.0 * m * a * b

    def block(m, modulation):
        f = lin(m, D, D) + 2 * lin(m, D, kv) + lin(m, D, D) + 4.0 * m * m * D + 3 * lin(m, D, F)
        if lora_rank:
            f += 2 * (lin(m, D, lora_rank) + lin(m, lora_rank, D)) + 2 * (lin(m, D, lora_rank) + lin(m, lora_rank, kv))
        return f + (lin(1, E, 4 * D) if modulation else 0.0)

    refiners = int(config["n_refiner_layers"])
    flops = lin(1, 256, 1024) + lin(1, 1024, E) + lin(n, patch, D) + lin(t, int(config["cap_feat_dim"]), D)
    flops += refiners * (block(n, True) + block(t, False)) + int(config["n_layers"]) * block(n + t, True)
    return flops + lin(1, E, D) + lin(n + t, D, patch)


@register_family("z_image")
class ZImageAdapter(LatentFlowFamily):
    """Z-Image and Z-Image-Turbo (single-stream DiT, rectified flow; the base model with true CFG, Turbo without).

    Args:
        path: local diffusers folder or Hub id; ``None`` builds the tiny random configuration.
        dtype: dtype of the transformer, VAE and text encoder (``float32`` | ``bfloat16`` | ``float16``).
        device: torch device; seed: init seed of the random configuration.
        decode_chunk: images per VAE decode call.
        drop_text_encoders: delete the text encoder after :meth:`cache_prompts` (serve cached embeddings).
        max_sequence_length: tokens of the templated prompt (ZImagePipeline's default 512).
        negative_prompt: the CFG negative prompt (the empty string by default, as the pipeline's).
        cfg_normalization: ZImagePipeline's ``cfg_normalization``: > 0 caps the guided norm at this multiple of the
            conditional prediction's norm per sample (0: off, the pipeline's default).
        cfg_truncation: ZImagePipeline's ``cfg_truncation``: steps with ``1 − σ`` above it run without CFG (1.0: never).
        sample_size: image side (pixels) whose sequence length sets the shift of a dynamic-shift scheduler config
            when :meth:`schedule` gets no size (None: the pipeline's default 1024 pixels, ``128·vae_factor``).
        cfg_mode: how a guided ``predict`` runs its two branches (``split`` | ``batched``, see :meth:`ModelAdapter.predict`).
        shape: with no ``path``, ``tiny`` (the test configuration) or ``z_image_turbo`` / ``full``: Z-Image-Turbo's
            published shape (6.15 B) with random weights (:mod:`pipelines.shapes`).
    """

    hub_components = Z_IMAGE_COMPONENTS

    family = "Z-Image"
    pipeline_class = "ZImagePipeline"
    lora_pipeline = pipeline_class
    text_encoder_names = ("text_encoder",)
    tokenizer_names = ("tokenizer",)
    # the attention of every block (noise refiner, context refiner, main layers)
    lora_target_modules = ["attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0"]

    def __init__(
        self, path: str | None = None, dtype: str = "float32", device: str = "cpu", seed: int = 0,
        decode_chunk: int = 16, drop_text_encoders: bool = False, max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        negative_prompt: str = "", cfg_normalization: float = 0.0, cfg_truncation: float = 1.0,
        sample_size: int | None = None, cfg_mode: str = "split", shape: str = "tiny",
    ):
        torch_dtype(dtype)
        self.cfg_mode = check_cfg_mode(cfg_mode)
        if int(max_sequence_length) < 1:
            raise ValueError(f"Z-Image: max_sequence_length must be ≥ 1, got {max_sequence_length}")
        if float(cfg_normalization) < 0:
            raise ValueError(f"Z-Image: cfg_normalization must be ≥ 0 (0 = off), got {cfg_normalization}")
        parts = family_components("z_image", path=path, shape=shape, seed=seed, device=device, dtype=dtype,
                                  load=load_z_image_components, tiny=build_tiny_z_image_components, build=build_z_image_components)
        self._setup(parts, dtype, device, decode_chunk, drop_text_encoders)
        self._check_scheduler()
        self.max_sequence_length = int(max_sequence_length)
        self.negative_prompt = str(negative_prompt)
        self.cfg_normalization = float(cfg_normalization)
        self.cfg_truncation = float(cfg_truncation)
        config = self.denoiser.config
        if tuple(config.all_patch_size) != (2,) or tuple(config.all_f_patch_size) != (1,) or config.get("siglip_feat_dim"):
            raise ValueError("Z-Image: only text-to-image transformers with patch size 2 (all_patch_size=(2,), all_f_patch_size=(1,), no SigLIP) are supported")
        self.latent_channels = int(config.in_channels)
        self.sample_size = int(sample_size if sample_size is not None else 128 * self.vae_factor)

    def _check_scheduler(self) -> None:
        unsupported = [k for k in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas", "stochastic_sampling")
                       if self.scheduler_config.get(k)]
        if unsupported:
            raise ValueError(f"Z-Image: scheduler options {unsupported} are not supported (scheduler/scheduler_config.json)")

    # -- schedule -------------------------------------------------------------------------------
    @property
    def shift(self) -> float:  # type: ignore[override]
        """The multiplicative shift at the default ``sample_size`` (the config's static ``shift`` for Z-Image-Turbo)."""
        return self.dynamic_shift(self.sample_size, self.sample_size)

    def dynamic_shift(self, height: int, width: int) -> float:
        """The scheduler's static ``shift``; with ``use_dynamic_shifting``, ``e^μ`` (exponential time shift; ``μ`` for the
        linear one), ``μ = calculate_shift((h/2)·(w/2))`` for the latent size ``h × w`` of ``height × width`` pixels."""
        if not self.scheduler_config.get("use_dynamic_shifting", False):
            return float(self.scheduler_config.get("shift", 1.0))
        h, w = height // self.vae_factor, width // self.vae_factor
        mu = calculate_shift((h // 2) * (w // 2), self.scheduler_config)
        return math.exp(mu) if self.scheduler_config.get("time_shift_type", "exponential") == "exponential" else mu

    def schedule(self, num_steps: int, shift: float | None = None, *, height: int | None = None, width: int | None = None) -> torch.Tensor:
        """ZImagePipeline's sigmas ``[num_steps + 1]`` for an image of ``height × width`` (default ``sample_size``²): the
        grid ``linspace(1, 1/K, K)``, shifted ``σ' = s·σ / (1 + (s − 1)·σ)`` (:meth:`dynamic_shift`), stretched to end at
        ``shift_terminal`` when the scheduler config sets it, then a final 0. An explicit ``shift`` replaces ``s``."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be ≥ 1, got {num_steps}")
        s = float(shift) if shift is not None else self.dynamic_shift(height or self.sample_size, width or self.sample_size)
        if s <= 0:
            raise ValueError(f"sigma shift must be > 0, got {s}")
        return terminal_stretched_sigmas(num_steps, s, self.scheduler_config.get("shift_terminal"))

    # -- prompt embeddings ----------------------------------------------------------------------
    def _encode_batch(self, prompts: list[str]) -> TensorDict:
        """ZImagePipeline._encode_prompt: chat template → tokens padded to ``max_sequence_length`` → ``hidden_states[-2]``
        with the attention mask; stored padded (zeros) with ``prompt_embeds_mask`` (1 on the valid tokens)."""
        tokenizer, enc = self.tokenizers["tokenizer"], self.text_encoders["text_encoder"]
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("Z-Image: the tokenizer has no chat template (tokenizer/tokenizer_config.json or chat_template.jinja); ZImagePipeline renders prompts with it")
        texts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True, enable_thinking=True)
            for p in prompts
        ]
        tokens = tokenizer(texts, padding="max_length", max_length=self.max_sequence_length, truncation=True, return_tensors="pt").to(enc.device)
        mask = tokens.attention_mask
        hidden = enc(input_ids=tokens.input_ids, attention_mask=mask.bool(), output_hidden_states=True).hidden_states[-2]
        dtype = next(self.denoiser.parameters()).dtype
        embeds = (hidden * mask[..., None].to(hidden.dtype)).to(dtype)
        return TensorDict({"prompt_embeds": embeds, "prompt_embeds_mask": mask.long()}, batch_size=[len(prompts)])

    def cache_prompts(self, prompts: list[str]) -> None:
        """Encode ``prompts`` and the negative prompt once (see :meth:`LatentFlowFamily.cache_prompts`)."""
        super().cache_prompts([*prompts, self.negative_prompt])

    def encode_prompts(self, prompts: list[str]) -> TensorDict:
        """``prompt_embeds [B, L, D]``, ``prompt_embeds_mask [B, L]`` (``L = max_sequence_length``) and the negative
        prompt's ``negative_prompt_embeds``, ``negative_prompt_embeds_mask``."""
        return self._with_negative(prompts, self.negative_prompt)

    def prompt_tokens(self) -> int:
        """Valid text tokens of the first default prompt (what the transformer attends to; stored padded)."""
        cond = self.encode_prompts([self.default_prompts()[0]])
        return int(cond["prompt_embeds_mask"].sum(-1).max())

    # -- denoiser -------------------------------------------------------------------------------
    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        h, w = self._check_size(height, width, self.vae_factor * 2)
        return (self.latent_channels, h, w)

    def _forward(self, latents: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        """One transformer call at the model's time ``1 − σ``; the velocity ``ε − x0`` is the negated output."""
        out = self.denoiser(
            hidden_states=latents, timestep=(1 - sigma).to(latents.dtype), encoder_hidden_states=cond["prompt_embeds"].to(latents.dtype),
            encoder_attention_mask=cond["prompt_embeds_mask"], return_dict=False,
        )[0]
        return -out

    def predict(self, latents: torch.Tensor, sigma: torch.Tensor, cond: TensorDict, guidance_scale: float) -> torch.Tensor:
        """Velocity for ``latents [B, C, h, w]``: :meth:`ModelAdapter.predict` with CFG (:meth:`combine_guidance`) for
        ``guidance_scale > 1`` (the pipeline's ``guidance_scale + 1``); samples whose ``1 − σ`` exceeds ``cfg_truncation``
        get the conditional prediction (all of them: only the conditional forward runs)."""
        if guidance_scale < 1.0:
            raise ValueError(f"Z-Image: guidance_scale must be ≥ 1 (1 = no CFG, ZImagePipeline's guidance_scale=0; s = its guidance_scale + 1), "
                             f"got {guidance_scale} (sampler.guidance_scale)")
        if guidance_scale == 1.0 or self.cfg_truncation > 1:
            return super().predict(latents, sigma, cond, guidance_scale)
        s = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).expand(latents.shape[0])
        off = (1000 - s * 1000) / 1000 > self.cfg_truncation  # the pipeline's t_norm = (1000 − t)/1000
        if bool(off.all()):
            return super().predict(latents, sigma, cond, 1.0)
        guided = super().predict(latents, sigma, cond, guidance_scale)
        if not bool(off.any()):
            return guided
        plain_ = super().predict(latents[off], s[off], cond[off], 1.0)
        return guided.index_put((off.nonzero().squeeze(1),), plain_)

    def combine_guidance(self, cond: torch.Tensor, uncond: torch.Tensor, guidance_scale: float) -> torch.Tensor:
        """``neg + s·(pos − neg)`` (the pipeline's ``pos + g·(pos − neg)``, ``g = s − 1``) in fp32; with
        ``cfg_normalization = r > 0`` each sample's result is scaled down to ``r·‖pos‖`` when its norm exceeds that."""
        pos, neg = cond.float(), uncond.float()
        comb = neg + guidance_scale * (pos - neg)
        if self.cfg_normalization > 0:
            limit = pos.flatten(1).norm(dim=1) * self.cfg_normalization
            norm = comb.flatten(1).norm(dim=1)
            scale = torch.where(norm > limit, limit / norm, torch.ones_like(norm))
            comb = comb * scale.view(-1, *([1] * (comb.ndim - 1)))
        return comb.to(cond.dtype)

    def fsdp_blocks(self) -> list[torch.nn.Module]:
        """The refiner blocks and the main layers (``ZImageTransformerBlock``)."""
        d = self.denoiser
        return [*d.noise_refiner, *d.context_refiner, *d.layers]

    def forward_flops(self, height: int, width: int, *, lora_rank: int = 0) -> float:
        """:func:`z_image_forward_flops` over the ``(h/2)·(w/2)`` latent patches and the valid prompt tokens."""
        _, h, w = self.latent_shape(height, width)
        return z_image_forward_flops(dict(self.denoiser.config), h * w // 4, self.prompt_tokens(), lora_rank)


__all__ = ["ZImageAdapter", "z_image_transformer_class", "build_tiny_z_image_components", "load_z_image_components", "z_image_forward_flops"]
