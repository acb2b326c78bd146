"""The digits family: a tiny diffusers ``SD3Transformer2DModel`` in pixel space + a tiny text encoder.

Folder layout (what ``scripts/pretrain_digits.py`` writes and ``model.path`` points at)::

    <path>/transformer/    diffusers save_pretrained (config.json + diffusion_pytorch_model.safetensors)
    <path>/text_encoder/   config.json + model.safetensors (DigitsTextEncoder)

Latents are the images themselves scaled to [-1, 1]: ``[B, 3, 16, 16]``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tensordict import TensorDict

from pipelines.base import ModelAdapter, check_cfg_mode, register_family, torch_dtype
from pipelines.digits.text_encoder import DigitsTextEncoder
from pipelines.flops import mmdit_forward_flops
from rewards.digits.data import all_prompts

# the shipped miniature's architecture; also the tiny random config used when no path is given
TRANSFORMER_CONFIG = dict(
    sample_size=16,
    patch_size=2,
    in_channels=3,
    out_channels=3,
    num_layers=4,
    attention_head_dim=32,
    num_attention_heads=2,
    joint_attention_dim=32,
    caption_projection_dim=64,
    pooled_projection_dim=32,
    pos_embed_max_size=16,
)


@register_family("digits")
class DigitsAdapter(ModelAdapter):
    """Adapter of the digits miniature.

    Args:
        path: local folder with ``transformer/`` and ``text_encoder/``; ``None`` builds random weights.
        dtype: denoiser dtype (``float32`` | ``bfloat16`` | ``float16``).
        device: torch device string.
        seed: init seed of the random configuration (only with ``path=None``).
        cfg_mode: how a guided ``predict`` runs its two branches (``split`` | ``batched``, see
            :meth:`ModelAdapter.predict`).
    """

    lora_pipeline = "StableDiffusion3Pipeline"  # an SD3Transformer2DModel: diffusers' SD3 LoRA loader reads its export

    prediction_type = "flow"
    shift = 1.0
    tiny_size = 16
    lora_target_modules = [
        "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
        "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    ]

    # what the error messages name (a subclass over another shipped folder overrides them)
    folder_name = "digits"
    pretrain_script = "scripts/pretrain_digits.py"
    # the architecture of the random configuration (path=None): transformer config and DigitsTextEncoder arguments
    transformer_config: dict = TRANSFORMER_CONFIG
    text_encoder_args: dict = {}
    transformer_class = "SD3Transformer2DModel"  # the diffusers class of the denoiser (the video miniature's: WanTransformer3DModel)

    def __init__(self, path: str | None = None, dtype: str = "float32", device: str = "cpu", seed: int = 0, cfg_mode: str = "split"):
        dtype_ = torch_dtype(dtype)
        self.cfg_mode = check_cfg_mode(cfg_mode)
        if path is None:
            transformer, text_encoder = self.random_transformer(seed), self.random_text_encoder(seed + 1)
        else:
            import diffusers

            folder = Path(path)
            name, script = self.folder_name, self.pretrain_script
            if not folder.is_dir():
                raise FileNotFoundError(
                    f"{name} model folder {folder} does not exist; set model.path to a folder made by `python {script}` (the shipped one is assets/{name})"
                )
            for part in ("transformer/config.json", "transformer/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors"):
                if not (folder / part).is_file():
                    raise FileNotFoundError(f"{name} model file {folder / part} is missing; rerun `python {script} --out {folder}`")
            transformer = getattr(diffusers, self.transformer_class).from_pretrained(str(folder / "transformer"), local_files_only=True)
            text_encoder = DigitsTextEncoder.from_pretrained(folder / "text_encoder")
        transformer = transformer.to(device)
        if dtype_ != torch.float32:
            transformer = transformer.to(dtype=dtype_)
        self.denoiser = transformer
        self.text_encoder = text_encoder.to(device).eval().requires_grad_(False)

    @classmethod
    def random_transformer(cls, seed: int):
        import diffusers

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return getattr(diffusers, cls.transformer_class)(**cls.transformer_config)

    @classmethod
    def random_text_encoder(cls, seed: int) -> DigitsTextEncoder:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return DigitsTextEncoder(**cls.text_encoder_args)

    # -- protocol -----------------------------------------------------------------------------
    def encode_prompts(self, prompts: list[str]) -> TensorDict:
        with torch.no_grad():
            seq, pooled = self.text_encoder.encode(list(prompts))
            neg_seq, neg_pooled = self.text_encoder.encode([""])
        n = len(prompts)
        dtype = next(self.denoiser.parameters()).dtype
        return TensorDict(
            {
                "prompt_embeds": seq.to(dtype),
                "pooled_prompt_embeds": pooled.to(dtype),
                "negative_prompt_embeds": neg_seq.expand(n, -1, -1).to(dtype).clone(),
                "negative_pooled_prompt_embeds": neg_pooled.expand(n, -1).to(dtype).clone(),
            },
            batch_size=[n],
        )

    def default_prompts(self) -> list[str]:
        return all_prompts()

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        return (3, height, width)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return ((latents.float() + 1.0) / 2.0).clamp(0.0, 1.0)

    def encode_images(self, images: torch.Tensor) -> torch.Tensor:
        """Pixel space: the inverse of :meth:`decode` on [0, 1] images."""
        return images.float() * 2.0 - 1.0

    def _forward(self, latents: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        return self.denoiser(
            hidden_states=latents, encoder_hidden_states=cond["prompt_embeds"], pooled_projections=cond["pooled_prompt_embeds"],
            timestep=1000.0 * sigma, return_dict=False,
        )[0]

    def forward_flops(self, height: int, width: int, *, lora_rank: int = 0) -> float:
        """:func:`pipelines.flops.mmdit_forward_flops` over the ``(H/p)·(W/p)`` pixel patches and the prompt's tokens."""
        _, h, w = self.latent_shape(height, width)
        p = int(self.denoiser.config.patch_size)
        return mmdit_forward_flops(dict(self.denoiser.config), (h // p) * (w // p), self.prompt_tokens(), lora_rank)

    # -- helpers --------------------------------------------------------------------------------
    @staticmethod
    def images_to_latents(images: torch.Tensor) -> torch.Tensor:
        """Float images in [0, 1] → latents in [-1, 1] (pixel space)."""
        return images * 2.0 - 1.0

    def save_pretrained(self, folder: str | Path) -> None:
        folder = Path(folder)
        self.denoiser.save_pretrained(str(folder / "transformer"), safe_serialization=True)
        self.text_encoder.save_pretrained(folder / "text_encoder")
