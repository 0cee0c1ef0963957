"""Which processes a test started: its descendants that were not there when it began (an earlier test
may leave a runner that Beam keeps for reuse in the same session)."""

from __future__ import annotations

import os

from bench.common import procs

_before: set[int] = set()


def mark() -> None:
    """Called as each test starts (tests/conftest.py)."""
    _before.clear()
    _before.update(procs.tree_pids(os.getpid()))


def started_since_test_began() -> list[int]:
    return [pid for pid in procs.tree_pids(os.getpid()) if pid != os.getpid() and pid not in _before]
