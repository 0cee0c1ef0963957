"""First-come-first-served admission of sequences under a `max_num_seqs` cap, like vLLM's scheduler.

Requests that do not fit, or arrive while the pause gate holds new work back, wait in arrival order;
their sequences count as waiting until admitted. Single event loop only (no locks): every method
must be called from the loop that owns it.
"""

from __future__ import annotations

import asyncio
from collections import deque

from beam_rl.standin.backend import IntervalClock, PauseGate


class Aborted(Exception):
    """A queued request ended by `/pause?mode=abort` before it was admitted."""


class Admission:
    def __init__(self, max_num_seqs: int, gate: PauseGate | None = None) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, not {max_num_seqs}")
        self.max_num_seqs = max_num_seqs
        self.running = 0
        self.max_running = 0  # high-water mark, for tests and metrics
        self._gate = gate
        self._busy = IntervalClock()  # time with at least one sequence running
        self._queue: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._changed: asyncio.Event | None = None
        if gate is not None:
            gate.on_change(self._admit)  # a resume admits the queue

    @property
    def waiting(self) -> int:
        return sum(n for n, _ in self._queue)

    def _fits(self, n: int) -> bool:
        if self._gate is not None and not self._gate.admits:
            return False
        # A request larger than the cap still runs, alone, rather than waiting forever.
        return self.running == 0 or self.running + n <= self.max_num_seqs

    @property
    def busy_seconds(self) -> float:
        """Seconds with at least one sequence running (how busy the engine was kept)."""
        return self._busy.seconds

    def _take(self, n: int) -> None:
        if self.running == 0:
            self._busy.start()
        self.running += n
        self.max_running = max(self.max_running, self.running)

    async def acquire(self, n: int) -> None:
        """Wait until `n` sequences may run; FIFO, so a big request is not starved by small ones.

        Raises Aborted if `abort_waiting` ends the wait."""
        if not self._queue and self._fits(n):
            self._take(n)
            return
        entry = (n, asyncio.get_running_loop().create_future())
        self._queue.append(entry)
        try:
            await entry[1]
        except asyncio.CancelledError:
            if entry[1].done() and not entry[1].cancelled() and entry[1].exception() is None:
                self.release(n)  # admitted just as the client gave up: hand the slots on
            elif entry in self._queue:
                self._queue.remove(entry)
                self._admit()  # the head may have been blocking smaller requests behind it
            raise

    def release(self, n: int) -> None:
        self.running -= n
        if self.running == 0:
            self._busy.stop()
        self._admit()

    def abort_waiting(self) -> None:
        """End every queued wait with Aborted."""
        while self._queue:
            _, future = self._queue.popleft()
            if not future.done():
                future.set_exception(Aborted())
        self._signal()

    def _admit(self) -> None:
        while self._queue and self._fits(self._queue[0][0]):
            n, future = self._queue.popleft()
            self._take(n)
            future.set_result(None)
        self._signal()

    def _signal(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def drained(self, *, queued: bool = True) -> None:
        """Return once nothing is running (and, with `queued`, nothing waits either)."""
        while self.running or (queued and self._queue):
            if self._changed is None:
                self._changed = asyncio.Event()
            self._changed.clear()
            await self._changed.wait()
