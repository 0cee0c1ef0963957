"""Processes of a run: which worker this is, and stopping the children a run started."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterable


def worker_id() -> str:
    """host:pid of this process: which worker dispatched or scored a rollout."""
    return f"{socket.gethostname()}:{os.getpid()}"


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
