"""Where beam-rl caches what it builds once per machine (Prism, the Flink job server, the tiny model)."""

from __future__ import annotations

import os
import pathlib


def cache_root() -> pathlib.Path:
    """`$BEAM_RL_CACHE` if set, else `~/.cache/beam-rl`."""
    root = os.environ.get("BEAM_RL_CACHE")
    return pathlib.Path(root).expanduser() if root else pathlib.Path.home() / ".cache" / "beam-rl"
