"""Ways a committed step gets damaged on disk, and what the error then says: shared by the tests of the
reader, the reference trainer and `beam-rl inspect`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path


def truncate(path: Path) -> None:
    """A torn copy: the file's first half."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip_bit(path: Path) -> None:
    """One bit flipped in the middle of the file (in the data, not the Arrow footer): the file still parses."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def delete(path: Path) -> None:
    path.unlink()


# damage -> (how, a regex of what the error says after "<path>: step <N> is corrupt: ")
FILE_DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated": (truncate, r"\d+ bytes, the commit record says \d+ \(truncated or overwritten\)"),
    "bit-flipped": (flip_bit, r"xxh3_128 checksum [0-9a-f]{32}, the commit record says [0-9a-f]{32} \(corrupt\)"),
    "missing": (delete, r"missing \(the commit record lists it\)"),
}


def truncate_record(path: Path) -> None:
    truncate(path)


def garbage_record(path: Path) -> None:
    path.write_bytes(b"\x00\xff not json at all")


def newer_record(path: Path) -> None:
    """A record written by a beam-rl that knows a newer record_version (and a field this one does not)."""
    record = json.loads(path.read_bytes())
    path.write_text(json.dumps({**record, "record_version": 2, "a_new_field": [1, 2]}))


# damage -> (how, a regex of what CommitRecordError says after "<path>: ")
RECORD_DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "truncated": (truncate_record, r"not a commit record: Invalid JSON: EOF while parsing"),
    "garbage": (garbage_record, r"not a commit record: Invalid JSON: expected value"),
    "newer version": (newer_record, r"record_version 2 is not supported \(newer than this beam-rl: upgrade it\)"),
}
