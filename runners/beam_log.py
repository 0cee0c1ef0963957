"""Beam's own output goes to the run directory's `beam.log`, not to the console.

- The SDK harness runs the pipeline's Python stages in this process (loopback), and for each failed
  bundle it prints the whole traceback to `sys.stderr` and logs it again (`sdk_worker.py`, `_execute`),
  among them the ones a cancelled job's last bundles raise on the way out (Ctrl-C, a stage that stopped
  the run). The user gets one line instead: the CLI's, or the typed failure a stage recorded
  (beam_rl/rundir/failures.py). `beam.log` keeps Beam's account.
- So, for the `beam-rl` command only: the `apache_beam` loggers write to that file, as do records Beam's
  code logs on the root logger, and `sys.stderr` (what Python code prints there; not file descriptor 2,
  which child processes share).
  The command's own log records keep the stream they were given at start-up.
- With `-v` nothing is redirected, nor where the caller has replaced `sys.stderr` (a test's capture).
- The routing stays after the job: a cancelled job's threads may still write while the process ends.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

BEAM_LOGGER = "apache_beam"
BEAM_LOG_FILE = "beam.log"

# gRPC's C core (Beam's runner channels) logs to stderr itself, outside Python's logging: keep its errors.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")


class _BeamLog(logging.StreamHandler):
    """The handler this module installs (told apart from anyone else's)."""


def route_beam_output(run_dir: Path) -> Path | None:
    """From now on, Beam's log records and whatever Python code prints to `sys.stderr` are appended to
    `<run_dir>/beam.log`; nothing changes when the root logger is at INFO or below (`beam-rl -v`).
    Returns the file's path, or None when nothing was redirected."""
    if logging.getLogger().isEnabledFor(logging.INFO) or sys.stderr is not sys.__stderr__:
        return None  # -v, or a caller that set sys.stderr itself (a test capturing output) keeps it
    path = Path(run_dir) / BEAM_LOG_FILE
    stream = open(path, "a", buffering=1, encoding="utf-8", errors="replace")  # noqa: SIM115 (kept open)
    logger, root = logging.getLogger(BEAM_LOGGER), logging.getLogger()
    for handler in [h for h in logger.handlers if isinstance(h, _BeamLog)]:
        logger.removeHandler(handler)
    for diversion in [f for f in root.filters if isinstance(f, _FromBeam)]:
        root.removeFilter(diversion)
    handler = _BeamLog(stream)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    root.addFilter(_FromBeam(handler))
    sys.stderr = stream
    return path


class _FromBeam(logging.Filter):
    """Beam's portable runner logs the job service's messages (a failed bundle, with its traceback) on the
    root logger: records made by Beam's own code go to its log instead."""

    _PACKAGE = f"{os.sep}apache_beam{os.sep}"

    def __init__(self, handler: logging.Handler) -> None:
        super().__init__()
        self._handler = handler

    def filter(self, record: logging.LogRecord) -> bool:
        if self._PACKAGE in record.pathname:
            self._handler.handle(record)
            return False
        return True
