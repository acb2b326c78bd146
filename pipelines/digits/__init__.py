"""The digits miniature: real data, a real pretrained generator, a learned reward and a gold judge."""

from pathlib import Path

from pipelines.digits.adapter import DigitsAdapter

ASSET_DIR = Path(__file__).resolve().parents[2] / "assets" / "digits"

__all__ = ["ASSET_DIR", "DigitsAdapter"]
