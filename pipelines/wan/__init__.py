"""Wan2.1 text-to-video: WanTransformer3DModel over 5-D video latents, AutoencoderKLWan, UMT5 prompt embeddings."""

from pipelines.wan.adapter import WanAdapter

__all__ = ["WanAdapter"]
