"""WeightSync: brings every inference server to the newest weights the trainer published.

The policy version is the step of the weights the servers hold (0 = the initial model). A
checkpoint is validated before any server is asked to load it: vLLM's `reload_weights` with a
mismatched tensor leaves the server broken. How a server takes it (reload, keep or continue) is the
`update` callable's business (docs/weight-updates.md); what each server's update cost is kept here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from beam_rl.inference.inflight import UpdateTiming
from beam_rl.rundir import RunDir

_LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightUpdate:
    """One version reaching every server: how long it took in all, and what it cost each server."""

    version: int
    seconds: float
    servers: tuple[UpdateTiming, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "seconds": round(self.seconds, 3),
            "servers": [t.as_dict() for t in self.servers],
        }


class WeightSync:
    def __init__(
        self,
        run_dir: RunDir,
        update: Callable[[Path, int], Sequence[UpdateTiming] | None],
        validate: Callable[[Path], object] | None = None,  # raises for a bad checkpoint
        poll_s: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._run_dir = run_dir
        self._update = update
        self._validate = validate
        self._poll_s = poll_s
        self._clock = clock
        self._last_poll = float("-inf")
        self.version = 0
        self.updates: list[WeightUpdate] = []  # oldest first

    def poll(self) -> WeightUpdate | None:
        """Loads newer published weights if there are any; returns the update, else None."""
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
        timings = self._update(path, step)
        update = WeightUpdate(step, time.monotonic() - started, tuple(timings or ()))
        self.updates.append(update)
        _LOG.info("inference servers now serve policy version %d (%s) after %.3fs", step, path, update.seconds)
        self.version = step
        return update
