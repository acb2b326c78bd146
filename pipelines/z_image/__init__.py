"""Z-Image (base and Turbo): ZImageTransformer2DModel (single-stream DiT), the FLUX.1 AutoencoderKL, Qwen3 text, true CFG."""

from pipelines.z_image.adapter import ZImageAdapter

__all__ = ["ZImageAdapter"]
