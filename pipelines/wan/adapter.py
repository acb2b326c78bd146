"""The Wan2.1 text-to-video family over diffusers: ``WanTransformer3DModel`` (velocity prediction over
3-D patches), ``AutoencoderKLWan`` (causal 3-D VAE, 4× temporal and 8× spatial compression) and a UMT5
text encoder, as ``diffusers.WanPipeline`` (``pipelines/wan/pipeline_wan.py``) builds them.

* Prompt embeddings (``WanPipeline._get_t5_prompt_embeds``): the prompt is cleaned (``ftfy`` if installed,
  HTML unescaped twice, whitespace collapsed), tokenized to ``max_sequence_length`` with its attention mask,
  encoded by ``UMT5EncoderModel(ids, mask).last_hidden_state``, then every row past the prompt's real length
  ``L = Σ mask`` is set to zero (the pipeline's trim to ``u[:L]`` and zero padding back to the maximum).
  The negative prompt (default ``""``) is the same construction.
* Latents are 5-D, ``[C, F_lat, H/8, W/8]`` per video with ``F_lat = (num_frames − 1)/4 + 1`` (the VAE's
  ``scale_factor_temporal``); ``num_frames − 1`` must be divisible by 4 and ``H, W`` by ``8·patch_size``.
* Latent normalisation: the model's latents are ``(z − latents_mean)/latents_std`` per channel; decoding
  computes ``z = latents / (1/latents_std) + latents_mean`` in the pipeline's order of operations.
* Timestep: the transformer gets the diffusers timestep ``1000·σ``.
* CFG: :meth:`ModelAdapter.predict`'s (``cfg_mode``: ``split`` runs two forwards as WanPipeline does,
  ``batched`` one over ``[uncond; cond]``; same numbers up to rounding); guidance 1 runs the conditional
  branch only.

Schedule (a choice, see :meth:`WanAdapter.schedule`): WanPipeline's default scheduler is
``UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=s)``, a multistep solver whose step is not a
single-velocity Euler/SDE step. diffrl's flow SDE/ODE steps need a plain sigma grid, so Wan uses the
flow-matching grid of ``FlowMatchEulerDiscreteScheduler(shift=s)`` with the pipeline's ``flow_shift``
(``shift`` for a FlowMatchEuler scheduler config): with the ODE step this *is* WanPipeline run with that
scheduler (tested), and the shift (3.0 for 480p, 5.0 for 720p) is the one the model was tuned with.

``decode`` returns float videos ``[B, F, 3, H, W]`` in [0, 1] (rollouts store them as uint8, and rewards
receive the frames: see ``rewards/base.py``).

``model.path`` is a local diffusers folder (``transformer/``, ``vae/``, ``text_encoder/``, ``tokenizer/``,
``scheduler/``); with no path the family builds a tiny random configuration offline (tokenizer included).
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import torch
from tensordict import TensorDict

from pipelines.base import check_cfg_mode, register_family, torch_dtype
from pipelines.flops import wan_forward_flops
from pipelines.latent import LatentFlowFamily, check_folder, load_common, load_tokenizer, own_memory
from pipelines.schedules import flow_match_sigmas
from pipelines.shapes import Shape, building, family_components, plain, register_shape, resolve_shape, text_config
from pipelines.tiny import build_tiny_t5_tokenizer

# the family's published shapes (``model.options.shape``; pipelines.shapes): Wan2.1's 14B and 1.3B differ in width and depth
WAN21_VAE = dict(base_dim=96, z_dim=16, dim_mult=(1, 2, 4, 4), num_res_blocks=2, attn_scales=(), temperal_downsample=(False, True, True))


def _wan21(name: str, heads: int, ffn_dim: int, layers: int, params_billion: float, repo: str) -> Shape:
    transformer = dict(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
                       freq_dim=256, ffn_dim=ffn_dim, num_layers=layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                       rope_max_seq_len=1024)
    return Shape(name, "wan", transformer, WAN21_VAE, {"umt5": 4096}, 512, params_billion, f"{repo} transformer/config.json, vae/config.json")


register_shape(_wan21("wan21_14b", 40, 13824, 40, 14.29, "Wan-AI/Wan2.1-T2V-14B-Diffusers"), full=True)
register_shape(_wan21("wan21_1_3b", 12, 8960, 30, 1.42, "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"))

# Wan2.1-T2V's scheduler config (480p flow_shift); only flow_shift and num_train_timesteps are read
WAN_SCHEDULER_CONFIG = {
    "_class_name": "UniPCMultistepScheduler", "num_train_timesteps": 1000, "flow_shift": 3.0, "use_flow_sigmas": True,
    "prediction_type": "flow_prediction", "solver_order": 2, "solver_type": "bh2", "predict_x0": True,
    "lower_order_final": True, "final_sigmas_type": "zero", "timestep_spacing": "linspace",
}
TINY_WAN_TRANSFORMER = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16, out_channels=16, text_dim=32,
    freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
)
# z_dim 16 keeps diffusers' default latents_mean/latents_std (Wan2.1's values)
TINY_WAN_VAE = dict(base_dim=4, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])
TINY_UMT5 = dict(
    d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
    relative_attention_max_distance=16, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    feed_forward_proj="gated-gelu", dropout_rate=0.0,
)
TINY_MAX_SEQUENCE_LENGTH = 32
WAN_COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")


def prompt_clean(text: str) -> str:
    """WanPipeline's ``prompt_clean``: ``ftfy.fix_text`` (when ftfy is installed), HTML-unescape twice, strip,
    collapse whitespace runs to one space."""
    try:
        import ftfy

        text = ftfy.fix_text(text)
    except ImportError:
        pass
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


def build_tiny_wan_components(seed: int = 0) -> dict:
    """The tiny random Wan-shaped components (CPU, fp32): transformer, causal 3-D VAE, UMT5 and tokenizer."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = build_tiny_t5_tokenizer(max_length=TINY_MAX_SEQUENCE_LENGTH)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = WanTransformer3DModel(**TINY_WAN_TRANSFORMER)
        torch.manual_seed(seed + 1)
        vae = AutoencoderKLWan(**TINY_WAN_VAE)
        torch.manual_seed(seed + 2)
        text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), **TINY_UMT5))
    return {
        "transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer,
        "scheduler": dict(WAN_SCHEDULER_CONFIG),
    }


def build_wan_components(seed: int, shape: Shape, device: str, dtype: str) -> dict:
    """Wan components at a published shape (:mod:`pipelines.shapes`), random, built on ``device`` in ``dtype``: the
    transformer, the causal 3-D VAE and the UMT5-XXL encoder at their published configs (a 2-layer stand-in of its width,
    4096, with ``shape.stand_in_text``), padded to ``max_sequence_length`` tokens."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = build_tiny_t5_tokenizer(max_length=shape.max_sequence_length)
    with building(device, dtype, seed):
        transformer = WanTransformer3DModel(**shape.transformer)
        vae = AutoencoderKLWan(**plain(shape.vae))
        text_encoder = UMT5EncoderModel(UMT5Config(**text_config(shape, "umt5", TINY_UMT5, len(tokenizer))))
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer, "scheduler": dict(WAN_SCHEDULER_CONFIG)}


def load_wan_components(path: str | Path) -> dict:
    """Components of a local Wan2.1 diffusers folder (``local_files_only``: nothing is downloaded)."""
    from transformers import UMT5EncoderModel

    folder = Path(path)
    check_folder(folder, "Wan", WAN_COMPONENTS)
    parts = load_common(folder, "Wan", "WanTransformer3DModel", "AutoencoderKLWan")
    parts["text_encoder"] = own_memory(UMT5EncoderModel.from_pretrained(str(folder / "text_encoder"), local_files_only=True))
    parts["tokenizer"] = load_tokenizer(folder, "tokenizer", clip=False)
    return parts


@register_family("wan")
class WanAdapter(LatentFlowFamily):
    """Wan2.1 text-to-video (``WanTransformer3DModel``, rectified flow, CFG with a negative prompt).

    Args:
        path: local diffusers folder; ``None`` builds the tiny random configuration.
        dtype: dtype of the transformer, VAE and text encoder (``float32`` | ``bfloat16`` | ``float16``).
        device: torch device; seed: init seed of the random configuration.
        num_frames: frames per video (``num_frames − 1`` divisible by 4; WanPipeline's default is 81).
        decode_chunk: videos per VAE decode call.
        drop_text_encoders: delete the text encoder after :meth:`cache_prompts` (serve cached embeddings).
        max_sequence_length: UMT5 tokens (WanPipeline's default 512; capped by the tokenizer's maximum).
        negative_prompt: the unconditional prompt of CFG (WanPipeline's default ``""``).
        flow_shift: the sigma-schedule shift; ``None`` reads the scheduler config's ``flow_shift`` (UniPC)
            or ``shift`` (FlowMatchEuler), else 3.0.
        cfg_mode: how a guided ``predict`` runs its two branches (``split`` | ``batched``, see
            :meth:`ModelAdapter.predict`).
        shape: with no ``path``, ``tiny`` (the test configuration) or a published shape with random weights
            (``wan21_14b``, ``wan21_1_3b``; ``full`` = ``wan21_14b``; :mod:`pipelines.shapes`).
    """

    hub_components = WAN_COMPONENTS

    family = "Wan"
    shape_family = "wan"  # the family's name among the published shapes (pipelines.shapes)
    pipeline_class = "WanPipeline"
    lora_pipeline = pipeline_class
    text_encoder_names = ("text_encoder",)
    tokenizer_names = ("tokenizer",)
    # self- and cross-attention projections of every block (diffusers' Wan LoRA training targets)
    lora_target_modules = ["to_q", "to_k", "to_v", "to_out.0"]

    def __init__(
        self, path: str | None = None, dtype: str = "float32", device: str = "cpu", seed: int = 0, num_frames: int = 5,
        decode_chunk: int = 4, drop_text_encoders: bool = False, max_sequence_length: int = 512, negative_prompt: str = "",
        flow_shift: float | None = None, cfg_mode: str = "split", shape: str = "tiny",
    ):
        torch_dtype(dtype)
        self.cfg_mode = check_cfg_mode(cfg_mode)
        parts = self._components(path=path, shape=shape, seed=seed, device=device, dtype=dtype)
        self._setup(parts, dtype, device, decode_chunk, drop_text_encoders)
        self.num_frames = int(num_frames)
        if self.num_frames < 1 or (self.num_frames - 1) % self.vae_temporal_factor:
            raise ValueError(
                f"Wan: num_frames={num_frames} must be 1 + a multiple of the VAE's temporal factor {self.vae_temporal_factor} "
                "(5, 9, …, 81); set model.options.num_frames accordingly"
            )
        self.max_sequence_length = min(int(max_sequence_length), int(self.tokenizers["tokenizer"].model_max_length))
        self.negative_prompt = str(negative_prompt)
        sched = self.scheduler_config
        default_shift = sched.get("flow_shift", sched.get("shift", 3.0))
        self.shift = float(default_shift if flow_shift is None else flow_shift)
        self.patch_size = tuple(int(p) for p in self.denoiser.config.patch_size)

    def _components(self, *, path, shape: str, seed: int, device: str, dtype: str) -> dict:
        """The components to set up (:func:`family_components`): a local folder, the tiny configuration or a published
        shape. A family built on Wan's (``wan22``, two experts) overrides this and keeps the rest."""
        return family_components("wan", path=path, shape=shape, seed=seed, device=device, dtype=dtype,
                                 load=load_wan_components, tiny=build_tiny_wan_components, build=build_wan_components)

    def _setup_vae_normalisation(self) -> None:
        """``AutoencoderKLWan``'s per-channel ``latents_mean``/``latents_std`` (5-D latents) and its spatial and
        temporal factors, in place of an ``AutoencoderKL``'s ``scaling_factor``/``shift_factor``."""
        cfg = self.vae.config
        self.vae_factor = int(cfg.scale_factor_spatial)
        self.vae_temporal_factor = int(cfg.scale_factor_temporal)
        z = int(cfg.z_dim)
        self.latents_mean = torch.tensor(cfg.latents_mean, dtype=torch.float32).view(1, z, 1, 1, 1)
        self.latents_std = torch.tensor(cfg.latents_std, dtype=torch.float32).view(1, z, 1, 1, 1)

    # -- prompts --------------------------------------------------------------------------------
    def _encode_batch(self, prompts: list[str]) -> TensorDict:
        """WanPipeline's UMT5 embeddings ``[B, max_sequence_length, d]``, zero past each prompt's length."""
        tokens = self.tokenizers["tokenizer"](
            [prompt_clean(p) for p in prompts], padding="max_length", max_length=self.max_sequence_length,
            truncation=True, add_special_tokens=True, return_attention_mask=True, return_tensors="pt",
        )
        enc = self.text_encoders["text_encoder"]
        mask = tokens.attention_mask.to(enc.device)
        hidden = enc(tokens.input_ids.to(enc.device), mask).last_hidden_state
        lengths = mask.gt(0).sum(dim=1)
        keep = torch.arange(hidden.shape[1], device=hidden.device)[None, :] < lengths[:, None]
        hidden = hidden.masked_fill(~keep[..., None], 0.0)
        dtype = next(self.denoiser.parameters()).dtype
        return TensorDict({"prompt_embeds": hidden.to(dtype)}, batch_size=[len(prompts)])

    def cache_prompts(self, prompts: list[str]) -> None:
        """Cache ``prompts``, the empty prompt and the negative prompt (see LatentFlowFamily.cache_prompts)."""
        super().cache_prompts([*prompts, self.negative_prompt])

    def encode_prompts(self, prompts: list[str]) -> TensorDict:
        """``prompt_embeds`` and ``negative_prompt_embeds`` (``negative_prompt``)."""
        return self._with_negative(prompts, self.negative_prompt)

    # -- shapes, schedule, prediction -----------------------------------------------------------
    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """``(C, F_lat, H/8, W/8)`` with ``F_lat = (num_frames − 1)/4 + 1``."""
        _, p_h, p_w = self.patch_size
        if height % (self.vae_factor * p_h) or width % (self.vae_factor * p_w):
            raise ValueError(
                f"Wan: image size {height}×{width} must be divisible by {self.vae_factor * p_h} "
                f"(VAE factor {self.vae_factor} × patch size); set sampler.height/width accordingly"
            )
        frames = (self.num_frames - 1) // self.vae_temporal_factor + 1
        return (int(self.denoiser.config.in_channels), frames, height // self.vae_factor, width // self.vae_factor)

    def schedule(self, num_steps: int, shift: float | None = None, *, height: int | None = None, width: int | None = None) -> torch.Tensor:
        """FlowMatchEulerDiscreteScheduler's sigmas with the pipeline's ``flow_shift`` (:func:`flow_match_sigmas`);
        ``shift`` overrides it. The shift is static: ``height``/``width`` are ignored."""
        T = int(self.scheduler_config.get("num_train_timesteps", 1000))
        return flow_match_sigmas(num_steps, self.shift if shift is None else shift, T)

    def fsdp_blocks(self) -> list[torch.nn.Module]:
        return list(self.denoiser.blocks)

    # -- sequence parallelism (model.sequence_parallel; diffrl.engine.sequence_parallel) ---------------------------
    def sequence_parallel_transformers(self) -> list[torch.nn.Module]:
        """The ``WanTransformer3DModel`` modules whose video tokens ``model.sequence_parallel`` splits over ranks."""
        return [self.denoiser]

    @classmethod
    def sequence_layout(cls, height: int, width: int, *, path: str | None = None, shape: str = "tiny", num_frames: int = 5,
                        **_) -> tuple[int | None, int | None]:
        """``(attention heads, video tokens per sample)`` of the transformer at ``height × width`` and ``num_frames``, read
        without building the model: a local folder's ``transformer/config.json`` and ``vae/config.json``, the tiny or a
        published shape; ``(None, None)`` for a Hub id (checked when the model runs)."""
        vae = {}
        if path is not None:
            folder = Path(str(path))
            if not (folder / "transformer" / "config.json").is_file():
                return None, None
            transformer = json.loads((folder / "transformer" / "config.json").read_text())
            if (folder / "vae" / "config.json").is_file():
                vae = json.loads((folder / "vae" / "config.json").read_text())
        else:
            spec = resolve_shape(cls.shape_family, shape)
            transformer = TINY_WAN_TRANSFORMER if spec is None else spec.transformer
        spatial, temporal = int(vae.get("scale_factor_spatial", 8)), int(vae.get("scale_factor_temporal", 4))
        p_t, p_h, p_w = transformer.get("patch_size", (1, 2, 2))
        frames = (int(num_frames) - 1) // temporal + 1
        tokens = (frames // p_t) * (height // spatial // p_h) * (width // spatial // p_w)
        return int(transformer["num_attention_heads"]), tokens

    def _forward(self, latents: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        return self.denoiser(hidden_states=latents, timestep=1000.0 * sigma, encoder_hidden_states=cond["prompt_embeds"], return_dict=False)[0]

    def forward_flops(self, height: int, width: int, *, lora_rank: int = 0) -> float:
        """:func:`pipelines.flops.wan_forward_flops` over the ``F/p_t · h/p_h · w/p_w`` video tokens and every
        (padded) UMT5 token."""
        _, f, h, w = self.latent_shape(height, width)
        p_t, p_h, p_w = self.patch_size
        return wan_forward_flops(dict(self.denoiser.config), (f // p_t) * (h // p_h) * (w // p_w), self.prompt_tokens(), lora_rank)

    # -- VAE ------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents ``[B, C, F_lat, h, w]`` → float videos ``[B, F, 3, H, W]`` in [0, 1]: WanPipeline's
        ``z = latents / (1/latents_std) + latents_mean`` → ``AutoencoderKLWan.decode`` (clamped to [−1, 1]) →
        ``x/2 + 1/2``, in chunks of ``decode_chunk`` videos."""
        if latents.ndim != 5:
            raise ValueError(f"Wan decode expects latents [B, C, F, h, w], got shape {tuple(latents.shape)}")
        out = []
        dtype, device = self.vae.dtype, self.vae.device
        mean, inv_std = self.latents_mean.to(device, dtype), 1.0 / self.latents_std.to(device, dtype)
        for part in latents.split(self.decode_chunk):
            z = part.to(device, dtype) / inv_std + mean
            out.append(self.vae.decode(z, return_dict=False)[0].float())
        video = (torch.cat(out) / 2 + 0.5).clamp(0, 1)
        return video.permute(0, 2, 1, 3, 4).contiguous()

    @torch.no_grad()
    def encode_videos(self, videos: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`decode`: float videos ``[B, F, 3, H, W]`` in [0, 1] → ``(mean(VAE.encode(2x − 1)) −
        latents_mean) / latents_std``."""
        if videos.ndim != 5 or videos.shape[2] != 3:
            raise ValueError(f"encode_videos expects float videos [B, F, 3, H, W] in [0, 1], got shape {tuple(videos.shape)}")
        dtype, device = self.vae.dtype, self.vae.device
        out = []
        for part in videos.split(self.decode_chunk):
            x = part.permute(0, 2, 1, 3, 4).to(device, dtype) * 2 - 1
            z = self.vae.encode(x).latent_dist.mean.float()
            out.append((z - self.latents_mean.to(z.device)) / self.latents_std.to(z.device))
        return torch.cat(out)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        raise ValueError("Wan latents are videos [C, F, h, w]: encode_images (images → latents) does not apply; use encode_videos")


__all__ = ["WanAdapter", "build_tiny_wan_components", "load_wan_components", "prompt_clean"]
