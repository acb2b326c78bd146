"""What a recipe's reward models hold on the GPU, for ``diffrl plan``: parameters from the published weights each reward
declares (``Reward.weight_refs``: the Hub references its options load), times the bytes of the dtype it runs in.

The trainer builds the rewards of ``reward.names`` in its own process (``diffrl.run_rewards.build_rewards``), on the
device of their ``device`` option: one on ``cuda`` sits beside rank 0's policy. :data:`REWARD_PARAMS` holds the
parameters of every published reward checkpoint, counted on ``meta`` from the published architectures in
:func:`published_reward_model` (``tests/test_plan.py`` rebuilds them); a reference not listed (a local checkpoint, an
unknown Hub file) is reported as not counted, with the fix.
"""

from __future__ import annotations

import inspect

from rewards.base import resolve_reward

# laion/CLIP-ViT-H-14-laion2B-s32B-b79K config.json: PickScore_v1 (its fine-tune) and HPSv2's OpenCLIP ViT-H-14 share it
CLIP_VIT_H_14 = dict(
    text_config=dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_hidden_layers=24, vocab_size=49408,
                     max_position_embeddings=77, hidden_act="gelu"),
    vision_config=dict(hidden_size=1280, intermediate_size=5120, num_attention_heads=16, num_hidden_layers=32, patch_size=14, image_size=224,
                       hidden_act="gelu"),
    projection_dim=1024,
)
# openai/clip-vit-large-patch14 config.json (OpenCLIP's ViT-L-14 'openai' weights: clip_score, aesthetic)
CLIP_VIT_L_14 = dict(
    text_config=dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12, vocab_size=49408, max_position_embeddings=77),
    vision_config=dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_hidden_layers=24, patch_size=14, image_size=224),
    projection_dim=768,
)
# THUDM/ImageReward med_config.json and BLIP ViT-L/16 (ImageReward.pt): vision, text with cross-attention, the MLP head
BLIP_L_VISION = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, image_size=224, patch_size=16)
BLIP_BERT_TEXT = dict(vocab_size=30524, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                      max_position_embeddings=512, encoder_hidden_size=1024)
# google/owlv2-base-patch16-ensemble config.json (geneval)
OWLV2_BASE_16 = dict(
    text_config=dict(hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_hidden_layers=12, vocab_size=49408, max_position_embeddings=16),
    vision_config=dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12, patch_size=16, image_size=960),
    projection_dim=512,
)
# Qwen/Qwen2-VL-7B-Instruct config.json (HPSv3's backbone; its rm_head d → 1024 → 16 → 2 beside it)
QWEN2_VL_7B = dict(
    text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                     max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}),
    vision_config=dict(depth=32, embed_dim=1280, hidden_size=3584, mlp_ratio=4, num_heads=16, in_channels=3, patch_size=14, spatial_merge_size=2,
                       temporal_patch_size=2),
    tie_word_embeddings=False,
)

# Hub reference (rewards' hub_weights) → (parameters, what they are); counted by published_reward_model on meta
REWARD_PARAMS = {
    "yuvalkirstain/PickScore_v1": (986_109_441, "CLIP ViT-H/14"),
    "xswu/HPSv2/HPS_v2.1_compressed.pt": (986_109_441, "OpenCLIP ViT-H/14"),
    "timm/vit_large_patch14_clip_224.openai/open_clip_pytorch_model.bin": (427_616_513, "CLIP ViT-L/14"),
    "camenduru/improved-aesthetic-predictor/sac+logos+ava1-l14-linearMSE.pth": (927_969, "the aesthetic MLP head"),
    "THUDM/ImageReward/ImageReward.pt": (446_206_689, "BLIP ViT-L/16 + BERT-base with cross-attention + MLP head"),
    "google/owlv2-base-patch16-ensemble": (154_966_792, "OWLv2 base/16"),
    "MizzenAI/HPSv3/HPSv3.safetensors": (8_295_063_090, "Qwen2-VL-7B-Instruct + rm_head"),
}
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def published_reward_model(ref: str):
    """The published architecture of reward checkpoint ``ref`` built with random weights on the current device (call it
    under ``torch.device("meta")``), for counting :data:`REWARD_PARAMS`."""
    import torch
    from transformers import (BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel, CLIPConfig, CLIPModel, Owlv2Config,
                              Owlv2ForObjectDetection, Qwen2VLConfig, Qwen2VLForConditionalGeneration)

    def mlp(*widths):
        return torch.nn.Sequential(*(torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])))

    if ref in ("yuvalkirstain/PickScore_v1", "xswu/HPSv2/HPS_v2.1_compressed.pt"):
        return CLIPModel(CLIPConfig(**CLIP_VIT_H_14))
    if ref.startswith("timm/vit_large_patch14_clip_224.openai"):
        return CLIPModel(CLIPConfig(**CLIP_VIT_L_14))
    if ref.startswith("camenduru/improved-aesthetic-predictor"):
        return mlp(768, 1024, 128, 64, 16, 1)
    if ref == "THUDM/ImageReward/ImageReward.pt":
        return torch.nn.ModuleList([BlipVisionModel(BlipVisionConfig(**BLIP_L_VISION)), BlipTextModel(BlipTextConfig(**BLIP_BERT_TEXT), add_pooling_layer=False),
                                    mlp(768, 1024, 128, 64, 16, 1)])
    if ref == "google/owlv2-base-patch16-ensemble":
        return Owlv2ForObjectDetection(Owlv2Config(**OWLV2_BASE_16))
    if ref == "MizzenAI/HPSv3/HPSv3.safetensors":
        return torch.nn.ModuleList([Qwen2VLForConditionalGeneration(Qwen2VLConfig(**QWEN2_VL_7B)), mlp(3584, 1024, 16, 2)])
    raise KeyError(ref)


def _default(cls, option: str, fallback):
    try:
        parameter = inspect.signature(cls.__init__).parameters.get(option)
    except (TypeError, ValueError):
        return fallback
    return fallback if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default


def reward_bytes(cfg) -> tuple[dict[str, int], list[str]]:
    """``({reward: bytes on the GPU}, [what is not counted])`` of the recipe's ``reward.names``: the published weights
    their options load (processors hold none) at the dtype of their ``dtype`` option, for each reward whose ``device``
    option is a GPU; a reward on the CPU holds nothing there."""
    counted, missing = {}, []
    options = cfg.reward.options or {}
    for name in cfg.reward.names:
        cls = resolve_reward(name)
        opts = dict(options.get(name, {}) or {})
        device = str(opts.get("device", _default(cls, "device", getattr(cls, "device", "cpu"))))
        if not device.startswith("cuda"):
            continue
        refs = getattr(cls, "weight_refs", None)
        refs = refs(opts) if refs is not None else {}
        dtype = str(opts.get("dtype", _default(cls, "dtype", "float32")))
        total = 0
        for option, weights in refs.items():
            if weights.kind == "processor":
                continue
            params = REWARD_PARAMS.get(weights.ref, (0, ""))[0]
            if not params:
                missing.append(f"reward {name!r} weights {weights.ref} (+reward.options.{name}.{option}; not in diffrl.tools.plan_rewards.REWARD_PARAMS)")
                continue
            total += params * BYTES.get(dtype, 4)
        if not refs:
            missing.append(f"reward {name!r} on {device} (it declares no published weights)")
        counted[name] = total
    return counted, missing


__all__ = ["REWARD_PARAMS", "published_reward_model", "reward_bytes"]
