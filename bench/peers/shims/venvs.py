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


def _marker(pins: list[str], exclude_newer: str | None) -> str:
    return " ".join(pins) + (f" --exclude-newer {exclude_newer}" if exclude_newer else "") + "\n"


def is_built(name: str, pins: list[str], exclude_newer: str | None = None) -> bool:
    """The venv holds exactly `pins` (resolved as the index stood on `exclude_newer`, when given)."""
    marker = peer_dir(name) / "complete"
    return marker.exists() and marker.read_text() == _marker(pins, exclude_newer)


def ensure_venv(name: str, pins: list[str], exclude_newer: str | None = None, timeout_s: float | None = None) -> Path:
    """The venv's Python, with `pins` installed; built the first time (a `complete` marker names the pins, so a
    changed pin rebuilds it). `exclude_newer` (an RFC 3339 time) resolves what the pins leave open as the index
    stood then; `timeout_s` bounds each uv command. RuntimeError, one line, naming the peer, when a step fails."""
    root = peer_dir(name)
    root.mkdir(parents=True, exist_ok=True)
    venv = root / "venv"
    with open(root / "venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_built(name, pins, exclude_newer):
            return venv_python(name)
        (root / "complete").unlink(missing_ok=True)
        # --compile-bytecode: a first run does not compile the packages while the harness times its start
        install = [uv(), "pip", "install", "-q", "--compile-bytecode", "--python", str(venv_python(name))]
        if exclude_newer:
            install += ["--exclude-newer", exclude_newer]
        for argv in ([uv(), "venv", "-q", "--clear", "--python", sys.executable, str(venv)], [*install, *pins]):
            try:
                done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"peer {name!r}: `uv {argv[1]} ...` took over {timeout_s:g} s") from None
            if done.returncode != 0:
                lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
                raise RuntimeError(f"peer {name!r}: `uv {argv[1]} ...` failed: {lines[-1]}")
        (root / "complete").write_text(_marker(pins, exclude_newer))
    return venv_python(name)
