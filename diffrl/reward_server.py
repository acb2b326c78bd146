"""``diffrl serve-reward``: serve a registered reward over HTTP (work in progress)."""

from __future__ import annotations


def add_parsers(sub) -> dict:
    """Add ``serve-reward`` to ``sub``; return ``{name: handler(args) -> exit status}``."""
    return {}
