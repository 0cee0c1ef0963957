"""Permits: the hard cap on in-flight rollouts (one permit per started rollout, given back on finish)."""

from __future__ import annotations


class Permits:
    """A counter, not a semaphore: the dispatcher never waits for a permit, it stops scheduling."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"max_inflight must be at least 1, got {capacity}")
        self.capacity = capacity
        self.in_use = 0

    @property
    def available(self) -> int:
        # A capacity lowered under the permits in use (beam_rl.dispatch.concurrency) frees none until
        # enough come back.
        return max(0, self.capacity - self.in_use)

    def resize(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"in-flight cap must be at least 1, got {capacity}")
        self.capacity = capacity

    def take(self, n: int) -> None:
        if n > self.available:
            raise RuntimeError(f"taking {n} permits with only {self.available} of {self.capacity} free")
        self.in_use += n

    def give_back(self, n: int) -> None:
        if n > self.in_use:
            raise RuntimeError(f"giving back {n} permits with only {self.in_use} taken")
        self.in_use -= n
