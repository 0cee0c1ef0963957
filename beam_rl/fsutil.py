"""Crash-safe file writes: a reader sees either no file or the whole file, never a partial one."""

from __future__ import annotations

import os
from pathlib import Path

TMP_SUFFIX = ".tmp"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, overwrite: bool = True) -> None:
    """Write to a temporary name beside `path`, fsync, rename into place, fsync the directory."""
    path = Path(path)
    if not overwrite and path.exists():
        raise FileExistsError(f"{path} already exists and must not be overwritten")
    tmp = path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
