"""The digits editing miniature (family ``digits_edit``): an InstructPix2Pix-style editor of 16×16 digits.

Pretrained by ``scripts/pretrain_digits_edit.py`` and shipped in ``assets/digits_edit``; its world (the
instructions, the built-in source digits), reward and gold judge are in ``rewards.digits.edit``.
"""

from pipelines.digits_edit.adapter import DigitsEditAdapter
from rewards.digits.edit import EDIT_ASSET_DIR

__all__ = ["EDIT_ASSET_DIR", "DigitsEditAdapter"]
