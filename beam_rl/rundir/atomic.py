"""Crash-safe writes: a temp name in the final directory, fsync, rename, directory fsync; and their leftovers."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

TMP_MARK = ".tmp-"


def temp_path(path: Path) -> Path:
    """A hidden, unique name beside `path`; `is_temp` recognises it."""
    return path.with_name(f".{path.name}{TMP_MARK}{uuid.uuid4().hex[:12]}")


def atomic_write(path: Path, write: Callable[[BinaryIO], Any], fsync_dir: bool = True) -> None:
    """Write via a hidden temp file in the same directory: readers see the old file or the whole new one.

    `fsync_dir=False` leaves the rename's durability to one directory fsync by the caller after several."""
    tmp = temp_path(path)
    try:
        with tmp.open("wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync_dir:
        fsync_directory(path.parent)


def write_atomic(path: Path, data: bytes, overwrite: bool = True) -> None:
    """Write `data` to `path` crash-safely: a reader sees no file or the whole file."""
    if not overwrite and path.exists():
        raise FileExistsError(f"{path} already exists and must not be overwritten")
    atomic_write(path, lambda f: f.write(data))


def json_bytes(obj: Any, indent: int | None = None) -> bytes:
    return json.dumps(obj, default=json_default, indent=indent).encode()


def json_default(obj: Any) -> Any:
    """numpy scalars and arrays and paths as plain JSON (metrics and stats often come from numpy)."""
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(path: Path) -> None:
    # The rename is durable only once the directory entry is; without this a power loss can undo it.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_temp(path: Path) -> bool:
    # Ours are ".<name>.tmp-<hex>"; also catch ".<name>.<pid>.tmp" from other atomic writers.
    return path.name.startswith(".") and ".tmp" in path.name


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
