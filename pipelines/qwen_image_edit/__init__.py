"""Qwen-Image-Edit: Qwen-Image's transformer editing images; the source enters the Qwen2.5-VL text encoder and follows the noisy latent tokens."""

from pipelines.qwen_image_edit.adapter import QwenImageEditAdapter

__all__ = ["QwenImageEditAdapter"]
