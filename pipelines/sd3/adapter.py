"""The SD3 / SD3.5 family over diffusers: ``SD3Transformer2DModel`` (MMDiT, velocity prediction), an
``AutoencoderKL`` with ``shift_factor``/``scaling_factor``, and three text encoders (CLIP-L, CLIP-G, T5).

Text conditioning is built exactly as ``diffusers.StableDiffusion3Pipeline.encode_prompt`` builds it:

* CLIP-L and CLIP-G (``CLIPTextModelWithProjection``): the penultimate hidden state
  ``hidden_states[-2]`` of each (CLIP skip 0) and the projected pooled output ``text_embeds``;
* ``clip = pad(concat(clip_l, clip_g, dim=-1), to the T5 width)`` (zero padding on the feature dim);
* ``prompt_embeds = concat(clip, t5, dim=-2)`` (sequence), ``pooled = concat(pooled_l, pooled_g, dim=-1)``;
* the negative (unconditional) embeddings are the same construction for the empty prompt ``""``.

Sigma convention (DESIGN.md): ``x_σ = (1 − σ)·x0 + σ·ε``, ``v = ε − x0``; the transformer gets the
diffusers timestep ``1000·σ``. The schedule is the uniform grid shifted with the scheduler config's
``shift`` (3.0 for SD3/SD3.5): ``σ' = s·σ / (1 + (s − 1)·σ)``.

Latents are ``(z − shift_factor)·scaling_factor`` with ``z`` the VAE posterior mean (what
``StableDiffusion3Pipeline`` decodes with ``z = latents / scaling_factor + shift_factor``).

``model.path`` is a local diffusers folder (``transformer/``, ``vae/``, ``text_encoder{,_2,_3}/``,
``tokenizer{,_2,_3}/``, ``scheduler/``); with no path the family builds a tiny random configuration offline
(tokenizers included) for tests. :meth:`SD3Adapter.save_pretrained` writes the same layout.
"""

from __future__ import annotations

import abc
import json
from pathlib import Path

import torch
from tensordict import TensorDict

from pipelines.base import ModelAdapter, register_family
from pipelines.sd15.adapter import TINY_PROMPTS, build_tiny_tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

SD3_SCHEDULER_CONFIG = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}

# tiny random configuration (tests): CLIP-L and CLIP-G of width 32 each (concat 64) padded to the T5 width 80
TINY_CLIP = dict(
    bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=32, intermediate_size=37, num_attention_heads=4,
    num_hidden_layers=2, vocab_size=600, max_position_embeddings=77, projection_dim=32, hidden_act="gelu",
)
TINY_T5 = dict(
    d_model=80, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
    relative_attention_max_distance=16, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    feed_forward_proj="relu", dropout_rate=0.0,
)
TINY_SD3_TRANSFORMER = dict(
    sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
    num_attention_heads=4, joint_attention_dim=80, caption_projection_dim=32, pooled_projection_dim=64,
    pos_embed_max_size=16,
)
TINY_VAE = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(8, 16), layers_per_block=1,
    latent_channels=4, norm_num_groups=4, sample_size=32, use_quant_conv=False, use_post_quant_conv=False,
)
# SD3's VAE normalisation (diffusers' SD3 VAE config); FLUX uses its own values
SD3_VAE_NORM = dict(shift_factor=0.0609, scaling_factor=1.5305)


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(_DTYPES)} (model.dtype)")
    return _DTYPES[name]


def build_tiny_t5_tokenizer(max_length: int = 16):
    """An offline T5 tokenizer (``T5TokenizerFast`` over a character-level Unigram model built in code):
    ids 0 ``<pad>``, 1 ``</s>``, 2 ``<unk>``, then ``▁`` and printable ASCII (bare and word-initial), with
    T5's post-processing (``</s>`` appended)."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    chars = list(string.ascii_letters + string.digits + string.punctuation)
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [(c, -3.0) for c in chars] + [("▁" + c, -2.5) for c in chars]
    tok = Tokenizer(models.Unigram(vocab, unk_id=2))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)])
    return T5TokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", extra_ids=0, model_max_length=max_length,
    )


def build_tiny_vae(seed: int, **norm):
    from diffusers import AutoencoderKL

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoencoderKL(**TINY_VAE, **norm)


def build_tiny_t5(seed: int, vocab_size: int):
    from transformers import T5Config, T5EncoderModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return T5EncoderModel(T5Config(vocab_size=vocab_size, **TINY_T5))


def _check_folder(folder: Path, family: str, components: tuple[str, ...]) -> None:
    if not folder.is_dir():
        raise FileNotFoundError(f"{family} model folder {folder} does not exist (model.path); give a local diffusers folder")
    for name in components:
        if not (folder / name).is_dir():
            raise FileNotFoundError(f"{family} model folder {folder} lacks the component {name}/ (needs {', '.join(components)})")


def _read_scheduler(folder: Path, family: str) -> dict:
    path = folder / "scheduler" / "scheduler_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{family} model folder {folder} lacks scheduler/scheduler_config.json")
    return json.loads(path.read_text())


class LatentFlowFamily(ModelAdapter):
    """Shared machinery of the latent flow-matching families (SD3, FLUX): VAE decode/encode with
    ``shift_factor``/``scaling_factor``, chunked decoding, a prompt-embedding cache that lets the text
    encoders be dropped, CLIP/T5 embedding helpers and ``save_pretrained``.

    Subclasses set ``family``, ``text_encoder_names`` and implement ``_encode_batch`` and ``predict``.
    """

    prediction_type = "flow"
    family = "latent"
    text_encoder_names: tuple[str, ...] = ()
    tokenizer_names: tuple[str, ...] = ()

    def _setup(self, parts: dict, dtype: str, device: str, decode_chunk: int, drop_text_encoders: bool) -> None:
        torch_dtype = _dtype(dtype)
        self.denoiser = parts["transformer"].to(device)
        if torch_dtype != torch.float32:
            self.denoiser = self.denoiser.to(dtype=torch_dtype)
        self.vae = parts["vae"].to(device).eval().requires_grad_(False)
        if torch_dtype != torch.float32:
            self.vae = self.vae.to(dtype=torch_dtype)
        self.text_encoders = {}
        for name in self.text_encoder_names:
            enc = parts[name].to(device).eval().requires_grad_(False)
            self.text_encoders[name] = enc if torch_dtype == torch.float32 else enc.to(dtype=torch_dtype)
        self.tokenizers = {name: parts[name] for name in self.tokenizer_names}
        self.scheduler_config = dict(parts["scheduler"])
        self.decode_chunk = int(decode_chunk)
        if self.decode_chunk < 1:
            raise ValueError(f"decode_chunk must be ≥ 1, got {decode_chunk}")
        self.drop_text_encoders = bool(drop_text_encoders)
        self._cache: dict[str, TensorDict] = {}
        self._setup_vae_normalisation()

    def _setup_vae_normalisation(self) -> None:
        """The latent normalisation and downsampling factor of the VAE: an ``AutoencoderKL``'s
        ``scaling_factor``/``shift_factor`` (families with another VAE class override this)."""
        self.vae_scale = float(self.vae.config.scaling_factor)
        self.vae_shift = float(self.vae.config.shift_factor or 0.0)
        self.vae_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)

    # -- prompt embeddings and the cache --------------------------------------------------------
    @property
    def text_encoders_loaded(self) -> bool:
        return bool(self.text_encoders)

    def _with_negative(self, prompts: list[str], negative_prompt: str) -> TensorDict:
        """The embeddings of ``prompts`` plus, for every key ``k``, ``negative_k``: the embedding of
        ``negative_prompt`` repeated over the batch (what the CFG branch of ``predict`` reads)."""
        pos = self._encode(list(prompts))
        neg = self._encode([negative_prompt])
        n = len(prompts)
        out = {key: pos[key] for key in pos.keys()}
        out.update({f"negative_{key}": neg[key].expand(n, *neg[key].shape[1:]).clone() for key in neg.keys()})
        return TensorDict(out, batch_size=[n])

    @abc.abstractmethod
    def _encode_batch(self, prompts: list[str]) -> TensorDict:
        """Positive embeddings of ``prompts`` (TensorDict ``[len(prompts)]``), from the text encoders."""

    def _encode(self, prompts: list[str]) -> TensorDict:
        """Embeddings of ``prompts``: from the cache when every prompt is cached, else from the encoders."""
        if prompts and all(p in self._cache for p in prompts):
            return torch.stack([self._cache[p] for p in prompts])
        if not self.text_encoders_loaded:
            missing = sorted({p for p in prompts if p not in self._cache})
            raise ValueError(
                f"prompts {missing[:5]}{' …' if len(missing) > 5 else ''} are not in the prompt-embedding cache and the "
                f"{self.family} text encoders were dropped after cache_prompts(); call cache_prompts() with every prompt "
                "(the empty negative prompt included) before dropping the encoders, or build the adapter with drop_text_encoders=False"
            )
        with torch.no_grad():
            return self._encode_batch(list(prompts))

    def cache_prompts(self, prompts: list[str]) -> None:
        """Encode ``prompts`` (and the empty prompt used as the negative) once and keep the embeddings.

        With ``drop_text_encoders=True`` the text encoders are deleted afterwards: later
        :meth:`encode_prompts` calls are served from the cache, and an uncached prompt is an error.
        """
        todo = [p for p in dict.fromkeys([*prompts, ""]) if p not in self._cache]
        if todo:
            encoded = self._encode(todo)
            for i, p in enumerate(todo):
                self._cache[p] = encoded[i].clone()
        if self.drop_text_encoders:
            self.text_encoders = {}

    # -- protocol -------------------------------------------------------------------------------
    def default_prompts(self) -> list[str]:
        return list(TINY_PROMPTS)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """``z = latents / scaling_factor + shift_factor`` → VAE decoder → ``x/2 + 1/2`` in [0, 1], in chunks of
        ``decode_chunk`` images."""
        chunks = []
        for part in latents.split(self.decode_chunk):
            z = part.to(self.vae.device, self.vae.dtype) / self.vae_scale + self.vae_shift
            chunks.append(self.vae.decode(z, return_dict=False)[0].float())
        return (torch.cat(chunks) / 2 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`decode`: ``(mean(VAE.encode(2x − 1)) − shift_factor)·scaling_factor``."""
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"encode_images expects float images [B, 3, H, W] in [0, 1], got shape {tuple(images.shape)}")
        out = []
        for part in images.split(self.decode_chunk):
            dist = self.vae.encode(part.to(self.vae.device, self.vae.dtype) * 2 - 1).latent_dist
            out.append((dist.mean.float() - self.vae_shift) * self.vae_scale)
        return torch.cat(out)

    def _check_size(self, height: int, width: int, multiple: int) -> tuple[int, int]:
        if height % multiple or width % multiple:
            raise ValueError(
                f"{self.family}: image size {height}×{width} must be divisible by {multiple} "
                f"(VAE factor {self.vae_factor} × patch size); set sampler.height/width accordingly"
            )
        return height // self.vae_factor, width // self.vae_factor

    # -- CLIP / T5 helpers ----------------------------------------------------------------------
    def _tokens(self, name: str, prompts: list[str], max_length: int) -> torch.Tensor:
        return self.tokenizers[name](
            list(prompts), padding="max_length", max_length=max_length, truncation=True, return_tensors="pt",
        ).input_ids

    def _t5(self, encoder: str, tokenizer: str, prompts: list[str]) -> torch.Tensor:
        ids = self._tokens(tokenizer, prompts, self.max_sequence_length)
        enc = self.text_encoders[encoder]
        return enc(ids.to(enc.device), output_hidden_states=False)[0]

    # -- saving ---------------------------------------------------------------------------------
    def components(self) -> dict:
        if not self.text_encoders_loaded:
            raise ValueError(f"{self.family}: the text encoders were dropped (drop_text_encoders=True); build a fresh adapter to save it")
        return {"transformer": self.denoiser, "vae": self.vae, **self.text_encoders, **self.tokenizers, "scheduler": self.scheduler_config}

    def save_pretrained(self, folder: str | Path) -> Path:
        """Write a diffusers-layout folder (each component's ``save_pretrained``, ``scheduler/scheduler_config.json``
        and ``model_index.json``) that ``model.path`` reloads."""
        folder = Path(folder)
        parts = self.components()
        index = {"_class_name": self.pipeline_class, "_diffusers_version": _diffusers_version()}
        for name, part in parts.items():
            if name == "scheduler":
                (folder / "scheduler").mkdir(parents=True, exist_ok=True)
                (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(part, indent=2))
                index[name] = ["diffusers", part.get("_class_name", "FlowMatchEulerDiscreteScheduler")]
                continue
            part.save_pretrained(str(folder / name))
            library = "diffusers" if name in ("transformer", "vae") else "transformers"
            index[name] = [library, type(part).__name__]
        (folder / "model_index.json").write_text(json.dumps(index, indent=2))
        return folder


def _diffusers_version() -> str:
    import diffusers

    return diffusers.__version__


def own_memory(module: torch.nn.Module) -> torch.nn.Module:
    """Copy every parameter and buffer into freshly allocated memory. Tensors loaded from safetensors can sit
    at unaligned addresses, where CPU matmuls take another SIMD path and differ from the saved model's in the
    last bit; fresh copies make a saved-then-loaded model compute bit-identically."""
    with torch.no_grad():
        for p in module.parameters():
            p.data = p.data.clone()
        for b in module.buffers():
            b.data = b.data.clone()
    return module


def _load_common(folder: Path, family: str, transformer_cls: str, vae_cls: str = "AutoencoderKL") -> dict:
    """The transformer, VAE (diffusers class names) and scheduler config of a checked diffusers folder."""
    import diffusers

    parts = {
        "transformer": own_memory(getattr(diffusers, transformer_cls).from_pretrained(str(folder / "transformer"), local_files_only=True)),
        "vae": own_memory(getattr(diffusers, vae_cls).from_pretrained(str(folder / "vae"), local_files_only=True)),
        "scheduler": _read_scheduler(folder, family),
    }
    return parts


def _load_tokenizer(folder: Path, name: str, clip: bool):
    from transformers import AutoTokenizer, CLIPTokenizer

    if clip:
        return CLIPTokenizer.from_pretrained(str(folder / name), local_files_only=True)
    return AutoTokenizer.from_pretrained(str(folder / name), local_files_only=True)


SD3_COMPONENTS = ("transformer", "vae", "text_encoder", "text_encoder_2", "text_encoder_3", "tokenizer", "tokenizer_2", "tokenizer_3", "scheduler")


def build_tiny_sd3_components(seed: int = 0) -> dict:
    """The tiny random SD3-shaped components (CPU, fp32): MMDiT, VAE, CLIP-L, CLIP-G, T5 and tokenizers."""
    from diffusers import SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    t5_tok = build_tiny_t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = SD3Transformer2DModel(**TINY_SD3_TRANSFORMER)
        clip_l = CLIPTextModelWithProjection(CLIPTextConfig(**TINY_CLIP))
        clip_g = CLIPTextModelWithProjection(CLIPTextConfig(**TINY_CLIP))
    return {
        "transformer": transformer, "vae": build_tiny_vae(seed + 1, **SD3_VAE_NORM),
        "text_encoder": clip_l, "text_encoder_2": clip_g, "text_encoder_3": build_tiny_t5(seed + 2, len(t5_tok)),
        "tokenizer": build_tiny_tokenizer(), "tokenizer_2": build_tiny_tokenizer(), "tokenizer_3": t5_tok,
        "scheduler": dict(SD3_SCHEDULER_CONFIG),
    }


def load_sd3_components(path: str | Path) -> dict:
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    folder = Path(path)
    _check_folder(folder, "SD3", SD3_COMPONENTS)
    parts = _load_common(folder, "SD3", "SD3Transformer2DModel")
    for name in ("text_encoder", "text_encoder_2"):
        parts[name] = own_memory(CLIPTextModelWithProjection.from_pretrained(str(folder / name), local_files_only=True))
    parts["text_encoder_3"] = own_memory(T5EncoderModel.from_pretrained(str(folder / "text_encoder_3"), local_files_only=True))
    parts["tokenizer"] = _load_tokenizer(folder, "tokenizer", clip=True)
    parts["tokenizer_2"] = _load_tokenizer(folder, "tokenizer_2", clip=True)
    parts["tokenizer_3"] = _load_tokenizer(folder, "tokenizer_3", clip=False)
    return parts


CFG_MODES = ("batched", "split")


@register_family("sd3")
class SD3Adapter(LatentFlowFamily):
    """Stable Diffusion 3 / 3.5 (MMDiT, rectified flow, CFG with a gradient-free unconditional branch).

    Args:
        path: local diffusers folder; ``None`` builds the tiny random configuration.
        dtype: dtype of the transformer, VAE and text encoders (``float32`` | ``bfloat16`` | ``float16``).
        device: torch device; seed: init seed of the random configuration.
        decode_chunk: images per VAE decode call.
        drop_text_encoders: delete the text encoders after :meth:`cache_prompts` (serve cached embeddings).
        max_sequence_length: T5 tokens (diffusers' default 256; capped by the tokenizer's maximum).
        cfg_mode: how a guided ``predict`` runs its two branches (``model.options.cfg_mode``):
            ``split`` (default): the unconditional branch as its own forward under ``no_grad``, then the
            conditional one; ``batched``: one forward over ``[uncond; cond]``, as diffusers' pipeline does.
            Same outputs up to rounding. In training the batched forward back-propagates through all 2B rows
            although the unconditional half only gets zero gradients; split's backward covers B rows. On one
            H200 at SD3.5-M scale (``benchmarks/gpu_speed.py``, compiled, LoRA r32): training step 4.10 s →
            3.09 s and end-to-end Flow-GRPO 2.65 → 3.15 trajectories/s, rollout 8.75 → 8.54 images/s.
            Rollout and training use the same mode, so their log-probs stay in parity.
    """

    family = "SD3"
    pipeline_class = "StableDiffusion3Pipeline"
    text_encoder_names = ("text_encoder", "text_encoder_2", "text_encoder_3")
    tokenizer_names = ("tokenizer", "tokenizer_2", "tokenizer_3")
    lora_target_modules = [
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
        "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    ]

    def __init__(
        self, path: str | None = None, dtype: str = "float32", device: str = "cpu", seed: int = 0,
        decode_chunk: int = 16, drop_text_encoders: bool = False, max_sequence_length: int = 256, cfg_mode: str = "split",
    ):
        _dtype(dtype)
        if cfg_mode not in CFG_MODES:
            raise ValueError(f"SD3: cfg_mode must be one of {CFG_MODES} (model.options.cfg_mode), got {cfg_mode!r}")
        self.cfg_mode = cfg_mode
        parts = build_tiny_sd3_components(seed) if path is None else load_sd3_components(path)
        self._setup(parts, dtype, device, decode_chunk, drop_text_encoders)
        self.shift = float(self.scheduler_config.get("shift", 3.0))
        self.max_sequence_length = min(int(max_sequence_length), int(self.tokenizers["tokenizer_3"].model_max_length))
        self.clip_max_length = int(self.tokenizers["tokenizer"].model_max_length)
        self.patch_size = int(self.denoiser.config.patch_size)

    def _clip(self, index: int, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(penultimate hidden state, projected pooled output) of CLIP-L (index 0) or CLIP-G (index 1)."""
        enc = self.text_encoders[("text_encoder", "text_encoder_2")[index]]
        ids = self._tokens(("tokenizer", "tokenizer_2")[index], prompts, self.clip_max_length)
        out = enc(ids.to(enc.device), output_hidden_states=True)
        return out.hidden_states[-2], out.text_embeds

    def _encode_batch(self, prompts: list[str]) -> TensorDict:
        seq_l, pooled_l = self._clip(0, prompts)
        seq_g, pooled_g = self._clip(1, prompts)
        t5 = self._t5("text_encoder_3", "tokenizer_3", prompts)
        clip = torch.cat([seq_l, seq_g], dim=-1)
        if clip.shape[-1] > t5.shape[-1]:
            raise ValueError(f"SD3: CLIP-L ⊕ CLIP-G width {clip.shape[-1]} exceeds the T5 width {t5.shape[-1]}; the text encoders do not fit together")
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        dtype = next(self.denoiser.parameters()).dtype
        return TensorDict(
            {"prompt_embeds": torch.cat([clip, t5], dim=-2).to(dtype), "pooled_prompt_embeds": torch.cat([pooled_l, pooled_g], dim=-1).to(dtype)},
            batch_size=[len(prompts)],
        )

    def encode_prompts(self, prompts: list[str]) -> TensorDict:
        """``prompt_embeds``, ``pooled_prompt_embeds`` and their ``negative_*`` (the empty prompt)."""
        return self._with_negative(prompts, "")

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        h, w = self._check_size(height, width, self.vae_factor * self.patch_size)
        limit = self.denoiser.config.pos_embed_max_size
        if limit is not None and max(h, w) // self.patch_size > limit:
            raise ValueError(f"SD3: image size {height}×{width} gives {h // self.patch_size}×{w // self.patch_size} patches, above the model's pos_embed_max_size {limit}")
        return (self.denoiser.config.in_channels, h, w)

    def schedule(self, num_steps: int, shift: float | None = None, *, height: int | None = None, width: int | None = None) -> torch.Tensor:
        """StableDiffusion3Pipeline's sigmas (FlowMatchEulerDiscreteScheduler.set_timesteps(K), static shift ``s``):
        with ``f(σ) = s·σ / (1 + (s − 1)·σ)`` and ``T`` training timesteps, ``σ_min = f(1/T)``; the sigmas are
        ``f(linspace(1, σ_min, K))`` followed by a final 0. ``shift`` overrides ``s`` (default: the scheduler
        config's, 3.0 for SD3/SD3.5). SD3's shift is static: ``height``/``width`` are accepted and ignored."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be ≥ 1, got {num_steps}")
        s = float(self.shift if shift is None else shift)
        T = int(self.scheduler_config.get("num_train_timesteps", 1000))
        f = lambda x: s * x / (1 + (s - 1) * x)  # noqa: E731
        grid = torch.linspace(1.0, f(1.0 / T), num_steps, dtype=torch.float64)
        return torch.cat([f(grid), torch.zeros(1, dtype=torch.float64)]).float()

    def _forward(self, x, sigma, seq, pooled) -> torch.Tensor:
        return self.denoiser(
            hidden_states=x, timestep=1000.0 * sigma, encoder_hidden_states=seq, pooled_projections=pooled, return_dict=False,
        )[0]

    def predict(self, latents: torch.Tensor, sigma: torch.Tensor, cond: TensorDict, guidance_scale: float) -> torch.Tensor:
        dtype = next(self.denoiser.parameters()).dtype
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device).expand(latents.shape[0])
        if guidance_scale == 1.0:
            return self._forward(latents.to(dtype), sigma, cond["prompt_embeds"], cond["pooled_prompt_embeds"])
        if self.cfg_mode == "split":
            x = latents.to(dtype)
            with torch.no_grad():
                uncond = self._forward(x, sigma, cond["negative_prompt_embeds"], cond["negative_pooled_prompt_embeds"])
            positive = self._forward(x, sigma, cond["prompt_embeds"], cond["pooled_prompt_embeds"])
            return uncond + guidance_scale * (positive - uncond)
        out = self._forward(
            torch.cat([latents, latents]).to(dtype), torch.cat([sigma, sigma]),
            torch.cat([cond["negative_prompt_embeds"], cond["prompt_embeds"]]),
            torch.cat([cond["negative_pooled_prompt_embeds"], cond["pooled_prompt_embeds"]]),
        )
        return self.combine_guidance(out, guidance_scale)


__all__ = ["SD3Adapter", "LatentFlowFamily", "build_tiny_sd3_components", "load_sd3_components", "build_tiny_t5_tokenizer"]
