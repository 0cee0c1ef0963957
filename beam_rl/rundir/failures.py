"""Why a run stopped, as a typed record: Beam hands a worker's exception back as text, so the stage
that stops the run writes `failure.json` (the error's type and message) before re-raising, and the
command that followed the job reads it back."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from beam_rl.processes import worker_id
from beam_rl.rundir import write_atomic

_LOG = logging.getLogger(__name__)

FAILURE_FILE = "failure.json"


class ServersNotReadyError(ValueError):
    """At start-up, some inference server cannot serve the run (the message names each and why)."""


class RunFailure(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    error: str  # the exception's class name, e.g. "AllServersDownError"
    message: str
    stage: str  # the pipeline stage that stopped, e.g. "dispatch", "write"
    worker: str  # host:pid of the worker it stopped on
    at: float  # time.time() when it was recorded

    def __str__(self) -> str:
        return f"{self.error}: {self.message}"


def record_failure(run_dir: str | os.PathLike[str], stage: str, err: BaseException) -> None:
    """Record `err` as the reason the run stops (the latest record wins). Never raises: the caller is
    about to re-raise `err`, and a disk too full for this record must not hide it."""
    failure = RunFailure(error=type(err).__name__, message=str(err), stage=stage, worker=worker_id(), at=time.time())
    try:
        write_atomic(Path(run_dir) / FAILURE_FILE, failure.model_dump_json(indent=2).encode())
    except OSError:
        _LOG.warning("could not record the failure of stage %s in %s", stage, run_dir, exc_info=True)


def read_failure(run_dir: str | os.PathLike[str], since: float = 0.0) -> RunFailure | None:
    """The failure recorded at or after `since` (a job's start: an older record is an earlier run's)."""
    try:
        failure = RunFailure.model_validate_json((Path(run_dir) / FAILURE_FILE).read_bytes())
    except (FileNotFoundError, ValidationError):
        return None
    return failure if failure.at >= since else None
