"""``imagereward``: ImageReward (Xu et al. 2023, "ImageReward: Learning and Evaluating Human Preferences for
Text-to-Image Generation") on transformers' BLIP modules, without the ``image-reward`` package.

The ``image-reward`` package pins ``timm==0.6.13`` and ``fairscale==0.4.13`` (and an old transformers through
its BLIP code), which cannot live beside this project's transformers 5. The model is small and standard, so it
is rebuilt here from transformers' classes and loads the published ``ImageReward.pt`` state dict as it is:

* image: CLIP's eval transform (bicubic resize of the shorter side to 224, centre crop, CLIP mean/std;
  :func:`rewards.clip_models.clip_preprocess`) → BLIP's ViT-L/16 (``BlipVisionModel``: 24 layers, width 1024,
  LayerNorm ε 1e-6, the final LayerNorm applied) → ``image_embeds [B, 197, 1024]``;
* text: the bert-base-uncased WordPiece tokenizer, padded to 35 tokens (``[CLS] … [SEP] [PAD]…``) → BLIP's
  BERT-base text encoder with cross-attention to every image token (``BlipTextModel``, no pooler, bidirectional);
* score: the ``[CLS]`` output → ``MLP`` 768 → 1024 → 128 → 64 → 16 → 1 (linear layers, no activations; dropout
  between the first four) → ``(r − 0.16717362830052426) / 1.0333394966054072``.

:func:`convert_state_dict` maps ``ImageReward.pt``'s keys (``blip.visual_encoder.*``, ``blip.text_encoder.*``,
``mlp.layers.*``; BLIP's own ViT and BERT naming) onto these modules; the momentum encoders, projections and
decoder it also holds are not used by the score and are skipped. ``tests/test_image_reward.py`` checks the
whole forward against a plain-torch transcription of BLIP's ViT and BERT run on the original key names.
Weights (local paths or Hub ids; left out, the published ones through the Hugging Face cache): ``checkpoint=`` the
``ImageReward.pt`` file (default ``THUDM/ImageReward/ImageReward.pt``), ``tokenizer=`` a bert-base-uncased folder
(default ``google-bert/bert-base-uncased``, tokenizer files only).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from rewards.base import Reward, RewardError, Weights, register_reward
from rewards.clip_models import _dtype, clip_preprocess

MEAN, STD = 0.16717362830052426, 1.0333394966054072
MAX_LENGTH = 35
# ImageReward-v1.0's architecture (BLIP ViT-L/16 at 224 px + BLIP's BERT-base with cross-attention)
VISION = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 224, "patch_size": 16, "layer_norm_eps": 1e-6}
TEXT = {"vocab_size": 30524, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
        "max_position_embeddings": 512, "encoder_hidden_size": 1024, "layer_norm_eps": 1e-12}


class ImageRewardHead(nn.Module):
    """ImageReward's MLP: linear layers 768 → 1024 → 128 → 64 → 16 → 1 with dropout after the first three."""

    def __init__(self, width: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(width, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2), nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


_VISION_RULES = [
    (r"^cls_token$", "embeddings.class_embedding"),
    (r"^pos_embed$", "embeddings.position_embedding"),
    (r"^patch_embed\.proj\.", "embeddings.patch_embedding."),
    (r"^blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
    (r"^blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
    (r"^blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
    (r"^blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
    (r"^blocks\.(\d+)\.mlp\.", r"encoder.layers.\1.mlp."),
    (r"^norm\.", "post_layernorm."),
]


def convert_state_dict(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """``ImageReward.pt``'s state dict → ``{"vision": …, "text": …, "head": …}`` state dicts of
    ``BlipVisionModel``, ``BlipTextModel(add_pooling_layer=False)`` and :class:`ImageRewardHead`.

    A vision key that no rule maps is a ``RewardError`` (a checkpoint of another architecture); the text
    encoder's keys are BERT's in both namings; ``position_ids`` buffers and the keys the score does not use are skipped.
    """
    out: dict[str, dict[str, torch.Tensor]] = {"vision": {}, "text": {}, "head": {}}
    for key, value in state.items():
        if key.startswith("blip.visual_encoder."):
            name = key[len("blip.visual_encoder."):]
            for pattern, repl in _VISION_RULES:
                if re.search(pattern, name):
                    out["vision"][re.sub(pattern, repl, name)] = value
                    break
            else:
                raise RewardError(f"reward 'imagereward': checkpoint key {key!r} is not part of BLIP's ViT; is this ImageReward.pt?")
        elif key.startswith("blip.text_encoder.") and not key.endswith("position_ids"):
            out["text"][key[len("blip.text_encoder."):]] = value
        elif key.startswith("mlp."):
            out["head"][key[len("mlp."):]] = value
    for part in ("vision", "text", "head"):
        if not out[part]:
            raise RewardError(f"reward 'imagereward': the checkpoint has no {part} weights (keys blip.visual_encoder.*, blip.text_encoder.*, mlp.*); is this ImageReward.pt?")
    return out


@register_reward("imagereward")
class ImageReward(Reward):
    """ImageReward-v1.0's score (module docstring): higher is preferred; about N(0, 1) over its training set.

    Args:
        checkpoint: the local ``ImageReward.pt`` (a state dict with BLIP's key names).
        tokenizer: local folder of the bert-base-uncased tokenizer (``vocab.txt``).
        random_init: random weights (tests; ``tokenizer`` is still a local folder); ``vision_config`` / ``text_config`` override the architecture
            (``BlipVisionConfig`` / ``BlipTextConfig`` keyword arguments, e.g. tiny in tests).
        device, dtype, batch_size, seed: where and how the model runs; the random init's seed.
    """

    hub_weights = {"checkpoint": Weights("THUDM/ImageReward/ImageReward.pt", "file"), "tokenizer": Weights("google-bert/bert-base-uncased", "processor")}

    unit = "ImageReward (standardised: (r − 0.167) / 1.033)"
    input = "uint8"
    batch_size = 16

    def __init__(self, checkpoint: str | None = None, tokenizer: str | None = None, random_init: bool = False,
                 vision_config: dict | None = None, text_config: dict | None = None,
                 device: str = "cpu", dtype: str = "float32", batch_size: int = 16, seed: int = 0):
        from transformers import BertTokenizer, BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

        if batch_size < 1:
            raise ValueError(f"reward 'imagereward': batch_size must be ≥ 1, got {batch_size}")
        self.device, self.dtype, self.batch_size = device, _dtype(dtype), int(batch_size)
        load = checkpoint is not None or not random_init
        path = self.weights_path("checkpoint", checkpoint, "the ImageReward.pt file (THUDM/ImageReward)") if load else None
        folder = self.weights_path("tokenizer", tokenizer, "a folder with the bert-base-uncased tokenizer (vocab.txt)")
        vcfg = {**VISION, **(vision_config or {})}
        tcfg = {**TEXT, "encoder_hidden_size": vcfg["hidden_size"], **(text_config or {})}  # cross-attention reads the image tokens
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.vision = BlipVisionModel(BlipVisionConfig(**vcfg))
            self.text = BlipTextModel(BlipTextConfig(**tcfg), add_pooling_layer=False)
            self.head = ImageRewardHead(tcfg["hidden_size"])
        if load:
            parts = convert_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            for module, part in ((self.vision, "vision"), (self.text, "text"), (self.head, "head")):
                try:
                    missing, unexpected = module.load_state_dict(parts[part], strict=False)
                except RuntimeError as exc:  # a shape mismatch
                    raise RewardError(f"reward 'imagereward': {path} does not fit the {part} model ({str(exc).splitlines()[1].strip()})") from None
                missing = [k for k in missing if not k.endswith("position_ids")]
                if missing or unexpected:
                    raise RewardError(f"reward 'imagereward': {path} does not fit the {part} model (missing {missing[:3]}, unexpected {unexpected[:3]})")
        self.tokenizer = BertTokenizer.from_pretrained(str(folder), local_files_only=True)
        for module in (self.vision, self.text, self.head):
            module.to(device=device, dtype=self.dtype).eval().requires_grad_(False)
        self.image_size = int(vcfg["image_size"])

    def embed(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """The text encoder's ``[CLS]`` output ``[B, 768]`` with cross-attention to the image tokens."""
        pixels = clip_preprocess(images, self.image_size).to(self.device, self.dtype)
        tokens = self.tokenizer(list(prompts), padding="max_length", truncation=True, max_length=MAX_LENGTH, return_tensors="pt").to(self.device)
        image_embeds = self.vision(pixel_values=pixels).last_hidden_state
        image_mask = torch.ones(image_embeds.shape[:-1], dtype=torch.long, device=self.device)
        out = self.text(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"], encoder_hidden_states=image_embeds, encoder_attention_mask=image_mask)
        return out.last_hidden_state[:, 0, :]

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: Any = None) -> dict[str, torch.Tensor]:
        if images.ndim != 4 or images.shape[1] != 3 or images.dtype != torch.uint8 or len(prompts) != images.shape[0]:
            raise RewardError(f"reward 'imagereward': expected uint8 images [B, 3, H, W] and B prompts, got {images.dtype} {tuple(images.shape)} and {len(prompts)}")
        with torch.no_grad():
            r = self.head(self.embed(images, prompts)).squeeze(-1).float()
        return {self.name: ((r - MEAN) / STD).cpu()}


__all__ = ["ImageReward", "ImageRewardHead", "MEAN", "STD", "convert_state_dict"]
