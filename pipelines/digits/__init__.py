"""The digits miniature: real data, a real pretrained generator, a learned reward and a gold judge.

This package is the generator family (``digits``, and ``digits_eps`` in ``eps.py``; pretrained by
``scripts/pretrain_digits.py`` and ``scripts/pretrain_digits_eps.py``); the data, the reward classifier and the gold judge are in ``rewards.digits``. ``ASSET_DIR`` is the
shipped miniature's folder.
"""

from pipelines.digits.adapter import DigitsAdapter
from rewards.digits.data import ASSET_DIR

__all__ = ["ASSET_DIR", "DigitsAdapter"]
