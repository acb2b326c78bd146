"""Model families for diffrl: one adapter per family over diffusers components (see ``base.py``)."""

from pipelines.base import ModelAdapter, build_adapter, register_family

__all__ = ["ModelAdapter", "build_adapter", "register_family"]
