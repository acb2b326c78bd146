"""The FLUX.2 [klein] family (FLUX.2-klein-4B/9B, step-distilled, and their undistilled Base models) over diffusers:
``Flux2Transformer2DModel`` (double- and single-stream blocks with shared modulation, no guidance embedding), the FLUX.2
VAE ``AutoencoderKLFlux2`` (32 channels, batch-norm latent statistics) and a Qwen3 text encoder, as
``diffusers.Flux2KleinPipeline`` (``pipelines/flux2/pipeline_flux2_klein.py``, diffusers 0.42) builds them.

* Prompt embeddings (``_get_qwen3_prompt_embeds``): each prompt becomes the chat message ``[{"role": "user",
  "content": p}]`` rendered by the tokenizer's chat template (``add_generation_prompt=True, enable_thinking=False``:
  Qwen3's template then appends an empty think block), tokenised padded and truncated to ``max_sequence_length``
  (512); the encoder runs with the attention mask and the outputs of the hidden layers ``text_encoder_out_layers``
  (9, 18, 27 of Qwen3's 36) are concatenated per token: ``[B, L, 3·D]`` (7680 for Qwen3-4B). Every one of the ``L``
  tokens, padding included, goes to the transformer (no attention mask), so they are stored as they are.
* Position ids (4 axes ``t, h, w, l`` of the RoPE): text token ``l`` at ``(0, 0, 0, l)``, latent token of row ``i``,
  column ``j`` at ``(0, i, j, 0)``.
* Latents: the pipeline's noise lives in the *patchified, normalised* space ``[4·C, H/(2f), W/(2f)]`` (``C = 32``
  VAE channels, ``f = 8``): the transformer's ``in_channels = 128`` per token, one token per latent pixel (flattened
  row-major, no further packing). The adapter keeps latents in that space, ``[in_channels, h/2, w/2]``; decoding undoes
  the batch-norm statistics of the VAE (``z = x·√(running_var + batch_norm_eps) + running_mean``), un-patchifies 2×2
  (channel ``4c + 2·di + dj`` → pixel ``(2i + di, 2j + dj)`` of channel ``c``) and runs the decoder; encoding is the
  inverse on the posterior mean (the pipeline's ``_encode_vae_image``).
* Timestep: the pipeline passes ``t/1000 = σ`` and the transformer multiplies by 1000, so ``σ`` goes in; the output is
  the velocity ``ε − x0`` (FlowMatchEulerDiscreteScheduler steps ``x + (σ_next − σ)·v``).
* Guidance: FLUX.2 [klein] has no guidance embedding (``guidance=None``). The step-distilled models
  (``model_index.json`` ``is_distilled: true``; FLUX.2-klein-4B, sampled at 4 steps) run no CFG: the pipeline ignores
  ``guidance_scale``, here any ``guidance_scale ≠ 1`` is an error. The Base models run true CFG for ``guidance_scale > 1``
  with the empty negative prompt: ``neg + g·(pos − neg)``, ``sampler.guidance_scale = g`` = the pipeline's (default 4).
* Schedule: ``sigmas = linspace(1, 1/K, K)`` through ``FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=…, mu=…)``
  with the pipeline's *empirical* ``μ`` (:func:`empirical_mu`, a fit in the token count ``(h/2)·(w/2)`` and in ``K``):
  with ``use_dynamic_shifting`` the time shift ``σ' = s·σ/(1 + (s − 1)·σ)`` with ``s = e^μ`` (``μ`` for
  ``time_shift_type="linear"``), else the config's static ``shift``; stretched to ``shift_terminal`` if set; a final 0.

``model.path`` is a local diffusers folder (``transformer/``, ``vae/``, ``text_encoder/``, ``tokenizer/``,
``scheduler/``, ``model_index.json``) or a Hub id (``black-forest-labs/FLUX.2-klein-4B``); with no path the family builds
a tiny random configuration offline (a 28-layer Qwen3 of width 32 over the Qwen-style tokenizer of the tiny Z-Image
configuration, an ``AutoencoderKLFlux2`` of VAE factor 2 with random batch-norm statistics).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tensordict import TensorDict

from pipelines.base import check_cfg_mode, register_family, torch_dtype
from pipelines.latent import LatentFlowFamily, check_folder, load_common, own_memory
from pipelines.schedules import terminal_stretched_sigmas
from pipelines.shapes import Shape, building, family_components, plain, register_shape
from pipelines.tiny import TINY_VAE
from pipelines.z_image.adapter import TINY_QWEN3, build_tiny_z_image_tokenizer, qwen3_config

# FLUX.2-klein-4B's transformer (black-forest-labs/FLUX.2-klein-4B transformer/config.json, as diffusers'
# scripts/convert_flux2_to_diffusers.py writes it for model_type "klein-4b"): 5 double- and 20 single-stream blocks of
# 24 heads of 128 (3072 wide), Qwen3-4B features of 3·2560 = 7680, 128 latent channels per token, no guidance embedding.
FLUX2_KLEIN_4B_TRANSFORMER = dict(
    patch_size=1, in_channels=128, out_channels=None, num_layers=5, num_single_layers=20, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=7680, timestep_guidance_channels=256, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6,
    guidance_embeds=False,
)
# the FLUX.2 VAE: AutoencoderKLFlux2's defaults (diffusers 0.42), which the same conversion script instantiates; 32
# channels, factor 8, batch-norm statistics over the 2×2-patchified 128 channels
FLUX2_VAE = dict(
    in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=32, norm_num_groups=32, sample_size=1024,
    use_quant_conv=True, use_post_quant_conv=True, batch_norm_eps=1e-4, patch_size=(2, 2),
)

register_shape(Shape(
    "flux2_klein_4b", "flux2_klein", FLUX2_KLEIN_4B_TRANSFORMER, FLUX2_VAE, {"qwen3_4b": 2560}, 512, 3.88,
    "black-forest-labs/FLUX.2-klein-4B transformer/config.json (diffusers' convert_flux2_to_diffusers.py, klein-4b), the "
    "AutoencoderKLFlux2 defaults; text encoder Qwen/Qwen3-4B (text_encoder/config.json)",
), full=True)

# the FLUX.2 scheduler config (FlowMatchEulerDiscreteScheduler with dynamic shifting, exponential time shift: what
# diffusers' conversion script saves, FLUX.1-dev's). base/max_shift play no part: the pipeline passes its own μ.
FLUX2_SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True,
    "base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15, "time_shift_type": "exponential",
}
FLUX2_KLEIN_COMPONENTS = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")
MAX_SEQUENCE_LENGTH = 512  # Flux2KleinPipeline's default (tokenizer_max_length); the template's tokens count towards it
TEXT_ENCODER_OUT_LAYERS = (9, 18, 27)  # Flux2KleinPipeline's default text_encoder_out_layers

# LoRA targets: the double-stream blocks' joint attention (image and text projections) and the single-stream blocks'
# fused q/k/v + MLP input projection. The single blocks' fused output projection (attn.to_out) is left out: its name is
# also the suffix of the double blocks' to_out ModuleList, which peft cannot wrap (list those Linear layers one by one,
# single_transformer_blocks.<i>.attn.to_out, in model.lora.target_modules to train them too).
FLUX2_LORA_TARGETS = (
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "attn.to_qkv_mlp_proj",
)

# tiny random configuration (tests): a 28-layer Qwen3 of width 32 (hidden state 27 is a layer's output, not the final
# norm's, as in Qwen3-4B's 36), so the transformer reads 3·32 = 96 features; head dim 16 = sum(axes_dims_rope); the
# VAE (factor 2, 4 channels) patchifies into 16 channels
TINY_KLEIN_QWEN3_LAYERS = 28
TINY_FLUX2_KLEIN_TRANSFORMER = dict(
    patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=96,
    timestep_guidance_channels=32, mlp_ratio=3.0, axes_dims_rope=(4, 4, 4, 4), rope_theta=2000, eps=1e-6, guidance_embeds=False,
)


def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """Flux2KleinPipeline's ``μ`` (``compute_empirical_mu``): two lines in the token count ``L``, fitted at 10 steps
    (``8.73809524e-5·L + 1.89833333``) and at 200 steps (``1.6927e-4·L + 0.45666666``); above 4300 tokens the 200-step
    line, otherwise the value at ``num_steps`` on the straight line through the two (extrapolated below 10 steps)."""
    at_200 = 0.00016927 * image_seq_len + 0.45666666
    if image_seq_len > 4300:
        return float(at_200)
    at_10 = 8.73809524e-05 * image_seq_len + 1.89833333
    return float(at_200 + (num_steps - 200) * (at_200 - at_10) / 190.0)


def image_position_ids(h: int, w: int, device=None) -> torch.Tensor:
    """``[h·w, 4]`` RoPE positions ``(0, row, column, 0)`` of the latent tokens, row-major (the pipeline's)."""
    rows = torch.arange(h, device=device).repeat_interleave(w)
    cols = torch.arange(w, device=device).repeat(h)
    zero = torch.zeros_like(rows)
    return torch.stack([zero, rows, cols, zero], dim=1)


def text_position_ids(n: int, device=None) -> torch.Tensor:
    """``[n, 4]`` RoPE positions ``(0, 0, 0, l)`` of the text tokens (the pipeline's)."""
    ids = torch.zeros(n, 4, dtype=torch.long, device=device)
    ids[:, 3] = torch.arange(n, device=device)
    return ids


def patchify(z: torch.Tensor) -> torch.Tensor:
    """``[B, C, h, w]`` → ``[B, 4C, h/2, w/2]``: channel ``4c + 2·di + dj`` holds pixel ``(2i + di, 2j + dj)`` of ``c``."""
    b, c, h, w = z.shape
    return z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, 4 * c, h // 2, w // 2)


def unpatchify(x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`patchify`."""
    b, c4, h, w = x.shape
    return x.view(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c4 // 4, 2 * h, 2 * w)


def klein_qwen3_config(vocab_size: int, shape: Shape | None = None):
    """The ``Qwen3Config``: Qwen3-4B's at a published ``shape`` (:func:`pipelines.z_image.adapter.qwen3_config`); else
    :data:`TINY_KLEIN_QWEN3_LAYERS` layers (the default ``text_encoder_out_layers`` read hidden state 27) of width 32,
    or with ``shape.stand_in_text`` of the published width 2560 with 2 heads of 128 and a narrow MLP (a CPU-sized
    stand-in that still gives 3·2560 features)."""
    from transformers import Qwen3Config

    if shape is not None and not shape.stand_in_text:
        return qwen3_config(vocab_size, shape)
    config = dict(TINY_QWEN3, vocab_size=max(vocab_size, 64), num_hidden_layers=TINY_KLEIN_QWEN3_LAYERS)
    if shape is not None:
        config.update(hidden_size=shape.text_widths["qwen3_4b"], num_attention_heads=2, num_key_value_heads=1, head_dim=128, intermediate_size=64)
    return Qwen3Config(pad_token_id=0, bos_token_id=None, eos_token_id=2, **config)


def build_tiny_flux2_klein_components(seed: int = 0) -> dict:
    """The tiny random FLUX.2 [klein]-shaped components (CPU, fp32): transformer, VAE (factor 2, random batch-norm
    statistics), a 28-layer Qwen3 (``Qwen3ForCausalLM``, as the pipeline's), tokenizer; the Base model (CFG)."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Qwen3ForCausalLM

    tokenizer = build_tiny_z_image_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = Flux2Transformer2DModel(**TINY_FLUX2_KLEIN_TRANSFORMER)
        torch.manual_seed(seed + 1)
        vae = AutoencoderKLFlux2(**plain(TINY_VAE))
        channels = vae.bn.running_mean.numel()
        vae.bn.running_mean.copy_(0.2 * torch.randn(channels))
        vae.bn.running_var.copy_(0.5 + torch.rand(channels))
        torch.manual_seed(seed + 2)
        text_encoder = Qwen3ForCausalLM(klein_qwen3_config(len(tokenizer))).eval()
    return {
        "transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer,
        "scheduler": dict(FLUX2_SCHEDULER_CONFIG), "is_distilled": False,
    }


def build_flux2_klein_components(seed: int, shape: Shape, device: str, dtype: str) -> dict:
    """FLUX.2 [klein] components at a published shape (:mod:`pipelines.shapes`), random, built on ``device`` in ``dtype``:
    the transformer, the FLUX.2 VAE and Qwen3-4B at their published configs (:func:`klein_qwen3_config`)."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Qwen3ForCausalLM

    tokenizer = build_tiny_z_image_tokenizer()
    with building(device, dtype, seed):
        transformer = Flux2Transformer2DModel(**plain(shape.transformer))
        vae = AutoencoderKLFlux2(**plain(shape.vae))
        text_encoder = Qwen3ForCausalLM(klein_qwen3_config(len(tokenizer), shape)).eval()
    return {"transformer": transformer, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer,
            "scheduler": dict(FLUX2_SCHEDULER_CONFIG), "is_distilled": False}


def load_flux2_klein_components(path: str | Path) -> dict:
    """The components of a local FLUX.2 [klein] diffusers folder (the text encoder as ``Qwen3ForCausalLM``, the
    pipeline's class) and ``is_distilled`` from its ``model_index.json`` (absent: the pipeline's default, False)."""
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    folder = Path(path)
    check_folder(folder, "FLUX.2 [klein]", FLUX2_KLEIN_COMPONENTS)
    parts = load_common(folder, "FLUX.2 [klein]", "Flux2Transformer2DModel", "AutoencoderKLFlux2")
    parts["text_encoder"] = own_memory(Qwen3ForCausalLM.from_pretrained(str(folder / "text_encoder"), local_files_only=True))
    parts["tokenizer"] = AutoTokenizer.from_pretrained(str(folder / "tokenizer"), local_files_only=True)
    index = folder / "model_index.json"
    parts["is_distilled"] = bool(json.loads(index.read_text()).get("is_distilled", False)) if index.is_file() else False
    return parts


def text_options(max_sequence_length, text_encoder_out_layers) -> tuple[int, tuple[int, ...]]:
    """``max_sequence_length`` (≥ 1) and ``text_encoder_out_layers`` (a non-empty list of hidden-state indices) checked,
    as ``(int, tuple)``; a one-line ``ValueError`` names the option otherwise."""
    if int(max_sequence_length) < 1:
        raise ValueError(f"FLUX.2 [klein]: max_sequence_length must be ≥ 1, got {max_sequence_length}")
    layers = tuple(text_encoder_out_layers) if isinstance(text_encoder_out_layers, (list, tuple)) else ()
    if not layers or not all(isinstance(k, int) and not isinstance(k, bool) for k in layers):
        raise ValueError(f"FLUX.2 [klein]: text_encoder_out_layers must be a non-empty list of hidden-state indices, got {text_encoder_out_layers!r}")
    return int(max_sequence_length), layers


def flux2_forward_flops(config: dict, n_image: int, n_text: int, lora_rank: int = 0) -> float:
    """One sample through ``Flux2Transformer2DModel`` without guidance embedding (the convention of
    :mod:`pipelines.flops`: matmuls and attention at 2 FLOPs per multiply-add). ``n_image`` latent tokens, ``n_text``
    text tokens, ``m = n_image + n_text``; ``D = heads·head_dim``, MLP width ``M = int(D·mlp_ratio)`` (SwiGLU: the
    input projection is ``2M`` wide). Timestep embedding ``E → D → D``; the shared modulations ``D → 6D`` (image and text
    streams) and ``D → 3D`` (single stream); input projections ``in_channels → D`` on the latent tokens and
    ``joint_attention_dim → D`` on the text. Each double block: q/k/v/out of both streams ``4·2·m·D²``, joint attention
    ``4·m²·D``, the two SwiGLU MLPs ``2·m·D·2M + 2·m·M·D``. Each single block: the fused q/k/v + MLP input ``2·m·D·(3D +
    2M)``, attention ``4·m²·D``, the fused output ``2·m·(D + M)·D``. Output: ``D → 2D`` norm modulation, ``D → out`` on
    the latent tokens. LoRA (``lora_rank``) on the double blocks' eight attention projections and the single blocks'
    ``to_qkv_mlp_proj``."""
    D = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    M = int(D * float(config.get("mlp_ratio", 3.0)))
    c_in = int(config["in_channels"])
    c_out = int(config.get("out_channels") or c_in) * int(config.get("patch_size", 1)) ** 2
    n, t = float(n_image), float(n_text)
    m = n + t

    def lin(tokens, a, b):
        return 2.0 * tokens * a * b

    def lora(tokens, a, b):
        return lin(tokens, a, lora_rank) + lin(tokens, lora_rank, b) if lora_rank else 0.0

    E = int(config.get("timestep_guidance_channels", 256))
    flops = lin(1, E, D) + lin(1, D, D) + 2 * lin(1, D, 6 * D) + lin(1, D, 3 * D) + lin(n, c_in, D) + lin(t, int(config["joint_attention_dim"]), D)
    double = 4 * lin(m, D, D) + 4.0 * m * m * D + lin(m, D, 2 * M) + lin(m, M, D) + 4 * lora(m, D, D)
    single = lin(m, D, 3 * D + 2 * M) + 4.0 * m * m * D + lin(m, D + M, D) + lora(m, D, 3 * D + 2 * M)
    flops += int(config["num_layers"]) * double + int(config["num_single_layers"]) * single
    return flops + lin(1, D, 2 * D) + lin(n, D, c_out)


@register_family("flux2_klein")
class Flux2KleinAdapter(LatentFlowFamily):
    """FLUX.2 [klein] (step-distilled 4B/9B without CFG; the undistilled Base models with true CFG).

    Args:
        path: a local diffusers folder or a Hub id (``org/name``); ``None``: the tiny random configuration (or ``shape``).
        dtype, device: where the transformer, the VAE and the Qwen3 encoder live (``float32`` | ``bfloat16`` | ``float16``).
        seed: the init seed of a random configuration. decode_chunk: how many images one VAE decode call takes.
        drop_text_encoders: free the Qwen3 encoder once :meth:`cache_prompts` has encoded the prompts.
        max_sequence_length: the templated prompt's token count (the pipeline's 512), every token seen by the transformer.
        text_encoder_out_layers: which Qwen3 hidden states make the prompt embeddings, concatenated (the pipeline's
            argument of that name, default ``(9, 18, 27)``).
        is_distilled: True for a step-distilled model (no CFG: ``sampler.guidance_scale`` must be 1), False for a Base model
            (true CFG when ``guidance_scale > 1``); None reads ``is_distilled`` from the folder's ``model_index.json``
            (FLUX.2-klein-4B: true; the Base models: false) and means False for a random configuration.
        sample_size: the image side (pixels) whose token count sets ``μ`` of a :meth:`schedule` called without a size
            (None: 1024 pixels, the pipeline's ``128·vae_factor``).
        cfg_mode: ``split`` or ``batched``, how a guided ``predict`` runs its two branches (:meth:`ModelAdapter.predict`).
        shape: without ``path``, ``tiny`` (tests) or ``flux2_klein_4b`` (``full``): FLUX.2-klein-4B's published shape,
            3.88 B, with random weights (:mod:`pipelines.shapes`).
    """

    family = "FLUX.2 [klein]"
    pipeline_class = lora_pipeline = "Flux2KleinPipeline"
    hub_components = FLUX2_KLEIN_COMPONENTS
    text_encoder_names, tokenizer_names = ("text_encoder",), ("tokenizer",)
    lora_target_modules = list(FLUX2_LORA_TARGETS)

    def __init__(
        self, path: str | None = None, dtype: str = "float32", device: str = "cpu", seed: int = 0,
        decode_chunk: int = 16, drop_text_encoders: bool = False, max_sequence_length: int = MAX_SEQUENCE_LENGTH,
        text_encoder_out_layers: tuple[int, ...] | list[int] = TEXT_ENCODER_OUT_LAYERS, is_distilled: bool | None = None,
        sample_size: int | None = None, cfg_mode: str = "split", shape: str = "tiny",
    ):
        self.max_sequence_length, self.text_encoder_out_layers = text_options(max_sequence_length, text_encoder_out_layers)
        self.cfg_mode = check_cfg_mode(cfg_mode)
        torch_dtype(dtype)
        parts = family_components("flux2_klein", path=path, shape=shape, seed=seed, device=device, dtype=dtype,
                                  load=load_flux2_klein_components, tiny=build_tiny_flux2_klein_components, build=build_flux2_klein_components)
        self._setup(parts, dtype, device, decode_chunk, drop_text_encoders)
        self._check_scheduler()
        layers = self.text_encoder_out_layers
        self.is_distilled = bool(parts.get("is_distilled", False) if is_distilled is None else is_distilled)
        config = self.denoiser.config
        if int(config.patch_size) != 1:
            raise ValueError(f"FLUX.2 [klein]: only transformers with patch_size 1 are supported (the pipeline's), got {config.patch_size}")
        width = len(layers) * int(self.text_encoders["text_encoder"].config.hidden_size)
        if width != int(config.joint_attention_dim):
            raise ValueError(f"FLUX.2 [klein]: {len(layers)} text-encoder layers {list(layers)} give {width} features, but the transformer "
                             f"reads joint_attention_dim={config.joint_attention_dim} (model.options.text_encoder_out_layers)")
        self.latent_channels = int(config.in_channels)
        self.sample_size = int(sample_size if sample_size is not None else 128 * self.vae_factor)

    def _setup_vae_normalisation(self) -> None:
        """``AutoencoderKLFlux2``: no scaling/shift factors, its batch-norm statistics over the 2×2-patchified channels."""
        config = self.vae.config
        if tuple(config.get("patch_size", (2, 2))) != (2, 2):
            raise ValueError(f"FLUX.2 [klein]: the VAE's patch_size must be (2, 2) (the pipeline patchifies 2×2), got {config.patch_size}")
        self.vae_factor = 2 ** (len(config.block_out_channels) - 1)

    def _bn_stats(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's batch-norm mean and standard deviation ``√(running_var + batch_norm_eps)``, ``[1, 4C, 1, 1]``."""
        bn = self.vae.bn
        std = torch.sqrt(bn.running_var + float(self.vae.config.batch_norm_eps))
        return bn.running_mean.view(1, -1, 1, 1), std.view(1, -1, 1, 1)

    def _check_scheduler(self) -> None:
        unsupported = [k for k in ("use_flow_sigmas", "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas",
                                   "stochastic_sampling") if self.scheduler_config.get(k)]
        if unsupported:
            raise ValueError(f"FLUX.2 [klein]: scheduler options {unsupported} are not supported (scheduler/scheduler_config.json)")

    # -- schedule -------------------------------------------------------------------------------
    def dynamic_shift(self, height: int, width: int, num_steps: int) -> float:
        """The scheduler's static ``shift``; with ``use_dynamic_shifting``, ``e^μ`` (``μ`` for a linear time shift),
        ``μ = empirical_mu((h/2)·(w/2), num_steps)`` for the latent size ``h × w`` of ``height × width`` pixels."""
        if not self.scheduler_config.get("use_dynamic_shifting", False):
            return float(self.scheduler_config.get("shift", 1.0))
        h, w = height // self.vae_factor, width // self.vae_factor
        mu = empirical_mu((h // 2) * (w // 2), num_steps)
        return math.exp(mu) if self.scheduler_config.get("time_shift_type", "exponential") == "exponential" else mu

    def schedule(self, num_steps: int, shift: float | None = None, *, height: int | None = None, width: int | None = None) -> torch.Tensor:
        """Flux2KleinPipeline's sigmas ``[num_steps + 1]`` for an image of ``height × width`` (default ``sample_size``²):
        the grid ``linspace(1, 1/K, K)``, shifted ``σ' = s·σ / (1 + (s − 1)·σ)`` (:meth:`dynamic_shift`, which depends on
        the size and on ``K``), stretched to end at ``shift_terminal`` when the scheduler config sets it, then a final 0.
        An explicit ``shift`` replaces ``s``."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be ≥ 1, got {num_steps}")
        s = float(shift) if shift is not None else self.dynamic_shift(height or self.sample_size, width or self.sample_size, num_steps)
        if s <= 0:
            raise ValueError(f"sigma shift must be > 0, got {s}")
        return terminal_stretched_sigmas(num_steps, s, self.scheduler_config.get("shift_terminal"))

    # -- prompt embeddings ----------------------------------------------------------------------
    def _encode_batch(self, prompts: list[str]) -> TensorDict:
        """Flux2KleinPipeline._get_qwen3_prompt_embeds: chat template (no thinking) → tokens padded to
        ``max_sequence_length`` → the hidden states ``text_encoder_out_layers`` concatenated per token (``[B, L, k·D]``)."""
        tokenizer, enc = self.tokenizers["tokenizer"], self.text_encoders["text_encoder"]
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("FLUX.2 [klein]: the tokenizer has no chat template (tokenizer/tokenizer_config.json or chat_template.jinja); "
                             "Flux2KleinPipeline renders prompts with it")
        texts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True, enable_thinking=False)
            for p in prompts
        ]
        tokens = tokenizer(texts, padding="max_length", max_length=self.max_sequence_length, truncation=True, return_tensors="pt").to(enc.device)
        # the base model's hidden states are the causal LM's (its logits over the vocabulary are never needed)
        model = getattr(enc, "base_model", enc)
        hidden = model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True, use_cache=False).hidden_states
        if max(self.text_encoder_out_layers) >= len(hidden) or min(self.text_encoder_out_layers) < -len(hidden):
            raise ValueError(f"FLUX.2 [klein]: text_encoder_out_layers {list(self.text_encoder_out_layers)} do not exist in a text encoder "
                             f"of {len(hidden)} hidden states (model.options.text_encoder_out_layers)")
        embeds = torch.cat([hidden[k] for k in self.text_encoder_out_layers], dim=-1)
        return TensorDict({"prompt_embeds": embeds.to(next(self.denoiser.parameters()).dtype)}, batch_size=[len(prompts)])

    def encode_prompts(self, prompts: list[str]) -> TensorDict:
        """``prompt_embeds [B, L, k·D]`` (``L = max_sequence_length``); for the Base model also the empty negative
        prompt's ``negative_prompt_embeds`` (the distilled model runs no unconditional branch)."""
        if self.is_distilled:
            return self._encode(list(prompts))
        return self._with_negative(prompts, "")

    # -- denoiser -------------------------------------------------------------------------------
    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        h, w = self._check_size(height, width, self.vae_factor * 2)
        return (self.latent_channels, h // 2, w // 2)

    def _forward(self, latents: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        """One transformer call on the latent tokens (one per latent pixel, row-major) with the text, at ``σ``."""
        b, c, h, w = latents.shape
        text = cond["prompt_embeds"].to(latents.dtype)
        out = self.denoiser(
            hidden_states=latents.flatten(2).transpose(1, 2), encoder_hidden_states=text, timestep=sigma.to(latents.dtype),
            img_ids=image_position_ids(h, w, latents.device), txt_ids=text_position_ids(text.shape[1], latents.device), guidance=None,
            return_dict=False,
        )[0]
        return out.transpose(1, 2).reshape(b, c, h, w)

    def predict(self, latents: torch.Tensor, sigma: torch.Tensor, cond: TensorDict, guidance_scale: float) -> torch.Tensor:
        """Velocity for ``latents [B, C, h, w]``: :meth:`ModelAdapter.predict`, with CFG (``neg + g·(pos − neg)``, the
        empty negative prompt) for ``guidance_scale > 1`` on the Base model; the distilled model takes 1 only."""
        if self.is_distilled and guidance_scale != 1.0:
            raise ValueError(f"FLUX.2 [klein]: the step-distilled model runs no CFG (Flux2KleinPipeline ignores guidance_scale for it); "
                             f"set sampler.guidance_scale=1.0 (got {guidance_scale})")
        if guidance_scale < 1.0:
            raise ValueError(f"FLUX.2 [klein]: guidance_scale must be ≥ 1 (1 = no CFG), got {guidance_scale} (sampler.guidance_scale)")
        return super().predict(latents, sigma, cond, guidance_scale)

    # -- VAE ------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """``z = unpatchify(latents·√(running_var + eps) + running_mean)`` → VAE decoder → ``x/2 + 1/2`` in [0, 1], in
        chunks of ``decode_chunk`` images."""
        mean, std = self._bn_stats()
        chunks = []
        for part in latents.split(self.decode_chunk):
            z = unpatchify(part.to(self.vae.device, self.vae.dtype) * std + mean)
            chunks.append(self.vae.decode(z, return_dict=False)[0].float())
        return (torch.cat(chunks) / 2 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`decode`: ``(patchify(mean(VAE.encode(2x − 1))) − running_mean) / √(running_var + eps)``."""
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"encode_images expects float images [B, 3, H, W] in [0, 1], got shape {tuple(images.shape)}")
        self._check_size(images.shape[-2], images.shape[-1], self.vae_factor * 2)
        mean, std = self._bn_stats()
        out = []
        for part in images.split(self.decode_chunk):
            z = self.vae.encode(part.to(self.vae.device, self.vae.dtype) * 2 - 1).latent_dist.mean
            out.append(((patchify(z) - mean) / std).float())
        return torch.cat(out)

    def compile_decoder(self, backend: str = "inductor") -> bool:
        """Compile the decoder of the ``AutoencoderKLFlux2`` in place (static shapes: one graph per decode-chunk size)."""
        self.vae.decoder.compile(backend=backend, dynamic=False)
        return True

    def save_pretrained(self, folder: str | Path) -> Path:
        """The diffusers folder of :meth:`LatentFlowFamily.save_pretrained`, with ``is_distilled`` in ``model_index.json``
        (what Flux2KleinPipeline and a ``model.path`` reload read)."""
        folder = super().save_pretrained(folder)
        index = json.loads((folder / "model_index.json").read_text())
        index["is_distilled"] = self.is_distilled
        (folder / "model_index.json").write_text(json.dumps(index, indent=2))
        return folder

    def prompt_tokens(self) -> int:
        """Text tokens the transformer attends to: all ``max_sequence_length`` of them (the padding included)."""
        return self.max_sequence_length

    def forward_flops(self, height: int, width: int, *, lora_rank: int = 0) -> float:
        """:func:`flux2_forward_flops` over the ``(h/2)·(w/2)`` latent tokens and the ``max_sequence_length`` text tokens."""
        _, h, w = self.latent_shape(height, width)
        return flux2_forward_flops(dict(self.denoiser.config), h * w, self.prompt_tokens(), lora_rank)


__all__ = [
    "Flux2KleinAdapter", "build_tiny_flux2_klein_components", "load_flux2_klein_components", "flux2_forward_flops", "empirical_mu",
    "image_position_ids", "text_position_ids", "patchify", "unpatchify",
]
