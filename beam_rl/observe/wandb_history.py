"""Reads W&B's local transaction log (run-<id>.wandb) back: which steps a run's earlier segments hold.

W&B writes every record of a run (history rows included) to this file in LevelDB's log format: a
7-byte file header, then 32 KiB blocks of records, each with a CRC-32 of its type byte and data,
split across blocks as FIRST/MIDDLE/LAST parts; each record is a `wandb_internal.Record` protobuf.
Its Python package ships no reader of the file (its Go core reads it), hence this small one.
W&B buffers the file a block at a time: after a crash it ends at some earlier row, and its last
block may be torn; reading stops at the first record that is short or fails its CRC.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

_FILE_HEADER = struct.Struct("<4sHB")  # ":W&B", magic 0xBEE1, format version 0
_RECORD_HEADER = struct.Struct("<IHB")  # CRC-32 of type byte + data, data length, type
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


class TransactionLogError(ValueError):
    """A file that is not a W&B transaction log."""


def records(path: Path) -> Iterator[bytes]:
    """The serialized records of a transaction log, in order, up to the end or a torn/corrupt record."""
    with path.open("rb") as f:
        header = f.read(_FILE_HEADER.size)
        if len(header) < _FILE_HEADER.size:
            return  # created, nothing written yet (W&B writes the header with the first block)
        ident, magic, _version = _FILE_HEADER.unpack(header)
        if ident != b":W&B" or magic != 0xBEE1:
            raise TransactionLogError(f"{path}: not a W&B transaction log (header {header!r})")
        parts: list[bytes] = []
        block = f.read(_BLOCK - _FILE_HEADER.size)  # blocks are aligned to the file's start
        while block:
            pos = 0
            while len(block) - pos >= _RECORD_HEADER.size:
                crc, length, kind = _RECORD_HEADER.unpack_from(block, pos)
                if kind == 0 and length == 0:
                    break  # zero padding to the block's end
                start = pos + _RECORD_HEADER.size
                data = block[start : start + length]
                if len(data) < length or zlib.crc32(bytes((kind,)) + data) != crc:
                    return  # torn by a crash (or damaged): what follows cannot be trusted
                pos = start + length
                if kind == _FULL:
                    yield data
                elif kind == _FIRST:
                    parts = [data]
                elif kind == _MIDDLE:
                    parts.append(data)
                elif kind == _LAST:
                    parts.append(data)
                    yield b"".join(parts)
                    parts = []
            block = f.read(_BLOCK)


def history_rows(path: Path) -> Iterator[dict[str, str]]:
    """Each history row (one `run.log` call) of a transaction log: key -> the value's JSON text."""
    from wandb.proto import wandb_internal_pb2

    for data in records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            yield {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}


def run_logs(root: Path, run_id: str) -> list[Path]:
    """The transaction logs of every segment (each process that ran it) of run `run_id` under `root`,
    offline and online ones alike; the `latest-run` link is not a segment of its own."""
    return sorted({path.resolve() for path in root.glob(f"*-{run_id}/run-{run_id}.wandb")})


def last_steps(logs: list[Path], markers: dict[str, str]) -> dict[str, int]:
    """The largest value of each marker key (key -> name of what it marks) over the logs' rows; 0 if none."""
    last = dict.fromkeys(markers.values(), 0)
    for path in logs:
        for row in history_rows(path):
            for key, name in markers.items():
                if key in row:
                    last[name] = max(last[name], int(json.loads(row[key])))
    return last
