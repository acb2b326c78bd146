"""Reading wandb's run file (``run-<id>.wandb``, the transaction log an offline run writes).

The format is LevelDB's log: a 7-byte file header (``:W&B``, magic ``0xBEE1``, version 0), then 32 KiB
blocks of records, each with a 7-byte header (CRC32 of type + data, length, type: full, first, middle or
last piece of a record). Each payload is a serialised ``wandb_internal_pb2.Record``.

Kept free of pandas so that :mod:`diffrl.logging` can use it to wait for a finished run's file.
"""

from __future__ import annotations

import struct
import time
import zlib
from pathlib import Path
from typing import Iterator

_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def payloads(path: Path) -> Iterator[bytes]:
    """The record payloads of a ``run-<id>.wandb`` file, in order (a record cut short by a writer that is
    still running ends the iteration; a CRC mismatch or a bad header is an error)."""
    data = path.read_bytes()
    if len(data) < 7 or struct.unpack("<4sHB", data[:7]) != (b":W&B", 0xBEE1, 0):
        raise ValueError(f"{path} is not a wandb run file (bad header)")
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # the rest of a block too small for a header is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # zero-filled tail of a block
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        if len(chunk) < length:  # a record cut by a still-running writer
            return
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            raise ValueError(f"{path}: corrupt record at byte {pos} (CRC mismatch)")
        pos += 7 + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""
        else:
            raise ValueError(f"{path}: unknown record type {kind} at byte {pos}")


def record_types(path: Path) -> list[str]:
    """The ``record_type`` of every complete record in the file (``header``, ``run``, ``history``, … ``exit``)."""
    from wandb.proto import wandb_internal_pb2 as pb

    kinds = []
    for payload in payloads(Path(path)):
        record = pb.Record()
        record.ParseFromString(payload)
        kinds.append(record.WhichOneof("record_type"))
    return kinds


def wait_until_complete(path: Path, timeout_s: float = 60.0, poll_s: float = 0.05) -> bool:
    """Wait until the run file holds its ``exit`` record: True once it does, False after ``timeout_s``.

    ``wandb.finish()`` can return before wandb's service has flushed the last records (the final history
    row and ``exit``) to the file; a reader that comes right after would miss them.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if Path(path).is_file() and "exit" in record_types(path):
                return True
        except ValueError:  # a partly written block: read again
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
