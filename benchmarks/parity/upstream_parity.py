"""What the upstream-parity scripts share (``imagereward_upstream.py``, ``hpsv3_upstream.py``): each runs twice, once as
``upstream`` (the upstream package scores images and writes them with its scores into ``--out``) and once as ``ours``
(diffrl scores the same images and writes ``parity.json``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import torch


def write_parity(out: Path, report: dict) -> None:
    """``report`` → ``out/parity.json``, and printed."""
    (out / "parity.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


def main(doc: str, upstream: Callable[[Path], None], ours: Callable[[Path], None]) -> None:
    """The command line: ``{upstream,ours} --out DIR`` on 2 torch threads."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("side", choices=["upstream", "ours"])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    (upstream if args.side == "upstream" else ours)(Path(args.out))
