"""FLUX.1 Kontext: FLUX.1-dev's transformer editing images, the source's packed latent tokens after the noisy ones."""

from pipelines.flux_kontext.adapter import FluxKontextAdapter

__all__ = ["FluxKontextAdapter"]
