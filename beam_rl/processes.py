"""Stopping the child processes a run started (servers, clusters): politely, then for sure."""

from __future__ import annotations

import subprocess
from collections.abc import Iterable


def stop_processes(procs: Iterable[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """SIGTERM all at once (they shut down in parallel), then SIGKILL whoever outlives `timeout_s`."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
