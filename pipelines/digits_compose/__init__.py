"""The digits-compose miniature (family ``digits_compose``): a GenEval-style compositional text-to-image model
on 32×32 canvases of 1–4 coloured digits.

Pretrained by ``scripts/pretrain_digits_compose.py`` and shipped in ``assets/digits_compose``; its world (the
grammar, the canvases, the training reward) is ``rewards.digits.compose`` and its gold judge
``rewards.digits.compose_judge``.
"""

from pipelines.digits_compose.adapter import DigitsComposeAdapter
from rewards.digits.compose import COMPOSE_ASSET_DIR

__all__ = ["COMPOSE_ASSET_DIR", "DigitsComposeAdapter"]
