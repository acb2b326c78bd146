"""Wan2.2 text-to-video (A14B): Wan2.1's pipeline with a high- and a low-noise expert switched at a timestep boundary."""

from pipelines.wan22.adapter import Wan22Adapter

__all__ = ["Wan22Adapter"]
