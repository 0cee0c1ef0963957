"""A peer's own virtualenv under the project's cache (`~/.cache/beam-rl/peers/<name>/venv`), built from the
package index with pinned versions by beam-rl's uv, once, under a file lock, and never touching beam-rl's venv.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
from pathlib import Path

from beam_rl.cache import cache_root


def peer_dir(name: str) -> Path:
    return cache_root() / "peers" / name


def venv_python(name: str) -> Path:
    return peer_dir(name) / "venv" / "bin" / "python"


def uv() -> str:
    """beam-rl's uv (installed beside its Python), else one on PATH."""
    beside = Path(sys.executable).parent / "uv"
    found = str(beside) if beside.exists() else shutil.which("uv")
    if found is None:
        raise RuntimeError("building a peer's venv needs uv (beside this Python or on PATH)")
    return found


def ensure_venv(name: str, pins: list[str]) -> Path:
    """The venv's Python, with `pins` installed; built the first time (a `complete` marker names the pins, so a
    changed pin rebuilds it). RuntimeError, one line, naming the peer, when the install fails."""
    root = peer_dir(name)
    root.mkdir(parents=True, exist_ok=True)
    venv, marker, wanted = root / "venv", root / "complete", " ".join(pins) + "\n"
    with open(root / "venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists() and marker.read_text() == wanted:
            return venv_python(name)
        marker.unlink(missing_ok=True)
        subprocess.run([uv(), "venv", "-q", "--clear", "--python", sys.executable, str(venv)], check=True)
        done = subprocess.run(
            # compiled now, so a first run does not compile the packages while the harness times its start
            [uv(), "pip", "install", "-q", "--compile-bytecode", "--python", str(venv_python(name)), *pins],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
            raise RuntimeError(f"peer {name!r}: uv pip install {' '.join(pins)} failed: {lines[-1]}")
        marker.write_text(wanted)
    return venv_python(name)
