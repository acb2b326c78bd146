"""FLUX.2 [klein]: Flux2Transformer2DModel, the FLUX.2 VAE (batch-norm latent statistics), Qwen3 text; distilled without CFG, Base with true CFG."""

from pipelines.flux2_klein.adapter import Flux2KleinAdapter

__all__ = ["Flux2KleinAdapter"]
