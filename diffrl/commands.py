"""``diffrl sample``, ``diffrl eval`` and ``diffrl export-lora`` (work in progress)."""

from __future__ import annotations


def add_parsers(sub) -> dict:
    """Add this module's sub-commands to ``sub``; return ``{name: handler(args) -> exit status}``."""
    return {}
