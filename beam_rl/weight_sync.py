"""WeightSync: brings every inference server to the newest weights the trainer published.

The policy version is the step of the weights the servers hold (0 = the initial model). A
checkpoint is validated before any server is asked to load it: vLLM's `reload_weights` with a
mismatched tensor leaves the server broken.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

from beam_rl.rundir import RunDir

_LOG = logging.getLogger(__name__)


class WeightSync:
    def __init__(
        self,
        run_dir: RunDir,
        reload: Callable[[Path], None],
        validate: Callable[[Path], None] | None = None,
        poll_s: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._run_dir = run_dir
        self._reload = reload
        self._validate = validate
        self._poll_s = poll_s
        self._clock = clock
        self._last_poll = float("-inf")
        self.version = 0
        self.reloads: list[tuple[int, float]] = []  # (version, seconds the reload took)

    def poll(self) -> int | None:
        """Loads newer published weights if there are any; returns the new version, else None."""
        now = self._clock()
        if now - self._last_poll < self._poll_s:
            return None
        self._last_poll = now
        latest = self._run_dir.latest_stable_weights()
        if latest is None or latest[0] <= self.version:
            return None
        step, path = latest
        if self._validate is not None:
            self._validate(path)
        started = time.monotonic()
        self._reload(path)
        self.reloads.append((step, time.monotonic() - started))
        _LOG.info("inference servers now serve policy version %d (%s)", step, path)
        self.version = step
        return step
