"""Stable Diffusion 3 / 3.5: MMDiT transformer, AutoencoderKL (shift/scale), CLIP-L + CLIP-G + T5."""

from pipelines.sd3.adapter import SD3Adapter

__all__ = ["SD3Adapter"]
