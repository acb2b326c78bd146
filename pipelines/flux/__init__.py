"""FLUX.1: FluxTransformer2DModel over packed 2×2 latents, guidance embedding, CLIP-L pooled + T5."""

from pipelines.flux.adapter import FluxAdapter

__all__ = ["FluxAdapter"]
