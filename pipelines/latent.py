"""The shared base of the latent flow-matching families (SD3, FLUX, Qwen-Image, Wan) and their helpers.

:class:`LatentFlowFamily` holds what those families share over their diffusers components: the VAE decode /
encode with ``shift_factor``/``scaling_factor`` (families with another VAE override
``_setup_vae_normalisation``), chunked decoding, a prompt-embedding cache that lets the text encoders be
dropped, CLIP/T5 embedding helpers and ``save_pretrained`` into a diffusers folder. Loading helpers read a
checked local diffusers folder (nothing is ever downloaded); :func:`pack_latents` is the 2×2 latent packing
of FLUX and Qwen-Image.
"""

from __future__ import annotations

import abc
import json
from pathlib import Path

import torch
from tensordict import TensorDict

from pipelines.base import ModelAdapter, torch_dtype
from pipelines.tiny import TINY_PROMPTS


def check_folder(folder: Path, family: str, components: tuple[str, ...]) -> None:
    """Raise ``FileNotFoundError`` naming the folder or the first missing component sub-folder."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{family} model folder {folder} does not exist (model.path); give a local diffusers folder or a Hub id (org/name)")
    for name in components:
        if not (folder / name).is_dir():
            raise FileNotFoundError(f"{family} model folder {folder} lacks the component {name}/ (needs {', '.join(components)})")


def read_scheduler(folder: Path, family: str) -> dict:
    """The ``scheduler/scheduler_config.json`` of a diffusers folder as a dict."""
    path = folder / "scheduler" / "scheduler_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{family} model folder {folder} lacks scheduler/scheduler_config.json")
    return json.loads(path.read_text())


class LatentFlowFamily(ModelAdapter):
    """Shared machinery of the latent flow-matching families (SD3, FLUX, Qwen-Image, Wan): VAE decode/encode
    with ``shift_factor``/``scaling_factor``, chunked decoding, a prompt-embedding cache that lets the text
    encoders be dropped, CLIP/T5 embedding helpers and ``save_pretrained``.

    Subclasses set ``family``, ``text_encoder_names`` and implement ``_encode_batch``, ``encode_prompts``,
    ``latent_shape`` and ``_forward`` (the CFG of ``predict`` is :class:`ModelAdapter`'s).
    """

    prediction_type = "flow"
    family = "latent"
    text_encoder_names: tuple[str, ...] = ()
    tokenizer_names: tuple[str, ...] = ()

    def _setup(self, parts: dict, dtype: str, device: str, decode_chunk: int, drop_text_encoders: bool) -> None:
        dtype_ = torch_dtype(dtype)
        self.denoiser = parts["transformer"].to(device)
        if dtype_ != torch.float32:
            self.denoiser = self.denoiser.to(dtype=dtype_)
        self.vae = parts["vae"].to(device).eval().requires_grad_(False)
        if dtype_ != torch.float32:
            self.vae = self.vae.to(dtype=dtype_)
        self.text_encoders = {}
        for name in self.text_encoder_names:
            enc = parts[name].to(device).eval().requires_grad_(False)
            self.text_encoders[name] = enc if dtype_ == torch.float32 else enc.to(dtype=dtype_)
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
        ``negative_prompt`` repeated over the batch (what the unconditional branch of ``predict`` reads)."""
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

    def compile_decoder(self, backend: str = "inductor") -> bool:
        """Compile the decoder of an ``AutoencoderKL`` (SD3, FLUX) in place, static shapes: one graph per decode-chunk
        size. Other VAE classes (Wan's and Qwen-Image's causal video VAEs, with per-frame caches) stay eager."""
        if type(self.vae).__name__ != "AutoencoderKL":  # by name: importing diffusers here would slow every import of pipelines
            return False
        self.vae.decoder.compile(backend=backend, dynamic=False)
        return True

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


def load_common(folder: Path, family: str, transformer_cls: str, vae_cls: str = "AutoencoderKL") -> dict:
    """The transformer, VAE (diffusers class names) and scheduler config of a checked diffusers folder."""
    import diffusers

    parts = {
        "transformer": own_memory(getattr(diffusers, transformer_cls).from_pretrained(str(folder / "transformer"), local_files_only=True)),
        "vae": own_memory(getattr(diffusers, vae_cls).from_pretrained(str(folder / "vae"), local_files_only=True)),
        "scheduler": read_scheduler(folder, family),
    }
    return parts


def load_tokenizer(folder: Path, name: str, clip: bool):
    """The tokenizer in ``folder/name`` (``CLIPTokenizer`` when ``clip``, else ``AutoTokenizer``), offline."""
    from transformers import AutoTokenizer, CLIPTokenizer

    if clip:
        return CLIPTokenizer.from_pretrained(str(folder / name), local_files_only=True)
    return AutoTokenizer.from_pretrained(str(folder / name), local_files_only=True)


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, h, w]`` → ``[B, (h/2)·(w/2), 4C]`` (FluxPipeline's ``_pack_latents``)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of :func:`pack_latents` for latents of height ``h`` and width ``w``."""
    b, _, d = tokens.shape
    x = tokens.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, h, w)

