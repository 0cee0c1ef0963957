"""What a source learns from the run directory's committed steps, read incrementally as steps commit."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

from beam_rl.rundir import Offset, RunDir


class CommittedSteps:
    """The newest committed step and every prompt offset committed steps consumed, kept current by
    reading each new commit record once, at most every `poll_s` seconds; and, over the last `share_steps`,
    the share of their windows' rollouts that took room in a step or would have but for being stale (the
    rest were filtered or errored)."""

    share_steps = 4

    def __init__(self, run_dir: RunDir, poll_s: float = 0.25, clock: Callable[[], float] = time.monotonic) -> None:
        self._run_dir = run_dir
        self._poll_s = poll_s
        self._clock = clock
        self._last_read = float("-inf")
        self.last_step = 0
        self.consumed: set[Offset] = set()
        self._recent: collections.deque[tuple[int, int]] = collections.deque(maxlen=self.share_steps)
        self.refresh(force=True)

    @property
    def room_share(self) -> float:
        """1.0 before any step (or with no window stats)."""
        seen = sum(n for _, n in self._recent)
        return sum(t for t, _ in self._recent) / seen if seen else 1.0

    def refresh(self, force: bool = False) -> list[set[Offset]]:
        """Read the steps committed since the last call; returns each new step's consumed offsets."""
        now = self._clock()
        if not force and now - self._last_read < self._poll_s:
            return []
        self._last_read = now
        if force:  # the first read: every step committed so far
            steps = self._run_dir.committed_steps()
        else:  # steps commit in order: one stat tells whether the next one is there
            steps = []
            while self._run_dir.is_committed(self.last_step + len(steps) + 1):
                steps.append(self.last_step + len(steps) + 1)
        new = []
        for step in steps:
            record = self._run_dir.read_commit(step)
            offsets = set(record.offsets)
            self.consumed |= offsets
            window = record.window
            if window.rollouts:  # stale rollouts count: their room went to no one, but fresh they would train
                self._recent.append((window.trained_rollouts + window.filtered.get("stale", 0), window.rollouts))
            new.append(offsets)
            self.last_step = max(self.last_step, step)
        return new
