"""Qwen-Image: QwenImageTransformer2DModel over packed 2×2 latents, AutoencoderKLQwenImage, Qwen2.5-VL text, true CFG."""

from pipelines.qwen_image.adapter import QwenImageAdapter

__all__ = ["QwenImageAdapter"]
