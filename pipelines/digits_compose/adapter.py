"""The digits-compose family: the digits miniature's tiny ``SD3Transformer2DModel`` on 32×32 canvases.

A GenEval-style compositional miniature (``rewards.digits.compose``): prompts name 1–4 digits, their colours,
counts and relative positions; the canvas holds up to four 12×12 digits in a 2×2 layout of slots. The model
is the digits family's (pixel space, flow matching, ``DigitsAdapter``) at 32×32 with 4×4 patches (64 image
tokens, as the digits model's 16×16 with 2×2 patches) and the digits text encoder over the compose grammar's
words (6 tokens).

Folder layout (what ``scripts/pretrain_digits_compose.py`` writes and ``model.path`` points at)::

    <path>/transformer/    diffusers save_pretrained (config.json + diffusion_pytorch_model.safetensors)
    <path>/text_encoder/   config.json + model.safetensors (DigitsTextEncoder)

Latents are the canvases scaled to [-1, 1]: ``[B, 3, 32, 32]`` (set ``sampler.height/width=32``).
"""

from __future__ import annotations

from pipelines.base import register_family
from pipelines.digits.adapter import DigitsAdapter
from pipelines.digits.text_encoder import PAD
from rewards.digits.compose import CANVAS, MAX_WORDS, WORDS, default_prompts

# the shipped generator's architecture; also the tiny random config used when no path is given
TRANSFORMER_CONFIG = dict(
    sample_size=CANVAS,
    patch_size=4,
    in_channels=3,
    out_channels=3,
    num_layers=4,
    attention_head_dim=32,
    num_attention_heads=4,
    joint_attention_dim=32,
    caption_projection_dim=128,
    pooled_projection_dim=32,
    pos_embed_max_size=CANVAS // 4,
)
VOCAB = [PAD, *WORDS]


@register_family("digits_compose")
class DigitsComposeAdapter(DigitsAdapter):
    """Adapter of the digits-compose miniature.

    Args: those of :class:`~pipelines.digits.adapter.DigitsAdapter`; ``path`` is a folder written by
    ``scripts/pretrain_digits_compose.py`` (the shipped one is ``assets/digits_compose``).
    """

    folder_name = "digits_compose"
    tiny_size = CANVAS
    pretrain_script = "scripts/pretrain_digits_compose.py"

    transformer_config = TRANSFORMER_CONFIG
    text_encoder_args = dict(vocab=VOCAB, max_length=MAX_WORDS)

    def default_prompts(self) -> list[str]:
        """The 60 built-in prompts, 10 per GenEval task type (``rewards.digits.compose.default_prompts``), held out of pretraining."""
        return default_prompts()
