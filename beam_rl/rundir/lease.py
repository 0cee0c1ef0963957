"""Who follows a run directory now, and which runner job works for it.

One process at a time follows a run (submits its job, or attaches to the job already running, and ends
it once the run is over): it holds an exclusive lock on `run.lock` for as long as it lives, and the lock
goes when the process does, however it dies. `job.json` names the job submitted for the run, so a later
`beam-rl run --resume` attaches to that job while it still runs instead of submitting a second one.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from beam_rl.processes import worker_id
from beam_rl.rundir import write_atomic

LOCK_FILE = "run.lock"
JOB_FILE = "job.json"


class RunDirBusyError(RuntimeError):
    """Another live process follows this run directory."""


class RunLease:
    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> RunLease:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirBusyError(
                f"{self.path.parent} is followed by another beam-rl process ({holder}); "
                "stop it first, or wait for it to end"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"holder": worker_id(), "since": time.time()}).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the lock
            self._fd = None

    def __enter__(self) -> RunLease:
        return self.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def write_job_record(run_dir: str | os.PathLike[str], record: dict[str, Any]) -> None:
    write_atomic(Path(run_dir) / JOB_FILE, json.dumps(record, indent=2).encode())


def read_job_record(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    try:
        return json.loads((Path(run_dir) / JOB_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
