"""What the embedded server asks of a backend (model, instant or simulated), and the pause gate
they share with it: vLLM 0.32's scheduler pause states.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from beam_rl.standin.generator import ChoiceResult, GenerationParams, Weights


class PauseState(enum.IntEnum):
    """vLLM 0.32's `PauseState`: what the scheduler still does while paused."""

    UNPAUSED = 0
    PAUSED_NEW = 1  # running requests keep stepping; queued and new ones wait (modes "wait", "abort")
    PAUSED_ALL = 2  # nothing steps: running requests freeze between two steps (mode "keep")


class IntervalClock:
    """Seconds spent inside intervals that `start` opens and `stop` closes, the open one included."""

    def __init__(self) -> None:
        self._closed_s = 0.0
        self._since: float | None = None

    @property
    def seconds(self) -> float:
        open_interval = time.monotonic() - self._since if self._since is not None else 0.0
        return self._closed_s + open_interval

    def start(self) -> None:
        if self._since is None:
            self._since = time.monotonic()

    def stop(self) -> None:
        if self._since is not None:
            self._closed_s += time.monotonic() - self._since
            self._since = None

    def add(self, since: float) -> None:
        """Count the interval from `since` (time.monotonic) to now, which no `start` opened."""
        self._closed_s += time.monotonic() - since


class PauseGate:
    """The pause state, with waits that end when it changes (or when `notify()` wakes them)."""

    def __init__(self) -> None:
        self.state = PauseState.UNPAUSED
        self._changed = asyncio.Event()
        self._listeners: list[Callable[[], None]] = []
        self._paused = IntervalClock()

    @property
    def admits(self) -> bool:
        """May queued requests start? Only when not paused at all."""
        return self.state == PauseState.UNPAUSED

    @property
    def steps(self) -> bool:
        """May running requests take another step?"""
        return self.state != PauseState.PAUSED_ALL

    @property
    def paused_seconds(self) -> float:
        """Seconds spent paused, as the server saw them (from the pause call to the resume call)."""
        return self._paused.seconds

    def set(self, state: PauseState) -> None:
        if state == PauseState.UNPAUSED:
            self._paused.stop()
        else:
            self._paused.start()
        self.state = state
        self.notify()

    def on_change(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def notify(self) -> None:
        """Wake every waiter (and listener) to look at the state again."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
        for listener in self._listeners:
            listener()

    async def changed(self) -> None:
        await self._changed.wait()


class PrefixCounters(Protocol):
    queries: int
    hits: int

    def reset(self) -> None: ...


class Backend(Protocol):
    """One way of generating tokens behind the HTTP API.

    Units follow vLLM V1, where each of a request's n choices is a sequence of its own:
    `running`, `waiting` and `max_running` count sequences.
    """

    vocab_size: int
    max_model_len: int

    @property
    def prefix_cache(self) -> PrefixCounters: ...

    @property
    def weights(self) -> Weights:
        """What the next step samples with; stamped on every token it samples (`ChoiceResult.sampled_by`)."""
        ...

    @property
    def running(self) -> int: ...

    @property
    def waiting(self) -> int: ...

    @property
    def max_running(self) -> int: ...

    @property
    def busy_seconds(self) -> float:
        """Seconds with at least one sequence running."""
        ...

    @property
    def stalled_seconds(self) -> float | None:
        """Seconds a pause kept the engine from stepping while it had sequences running or waiting: the
        engine time weight updates cost. None for a backend that does not measure it."""
        ...

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of the requests admitted so far."""
        ...

    @property
    def generation_tokens(self) -> int:
        """Tokens sampled so far, counted as they are sampled."""
        ...

    def kv_cache_usage(self) -> float: ...

    def generate(self, params: GenerationParams, progress: bool) -> AsyncIterator[list[ChoiceResult]]:
        """Run one request: yields its choices (one list, filled in place) after every step that
        sampled tokens when `progress`, and once more when all are finished. Honours the pause gate;
        `abort_all` finishes it early with finish_reason "abort" and the tokens sampled so far."""
        ...

    async def abort_all(self) -> None:
        """Finish every running and queued request with finish_reason "abort"; returns once they are."""
        ...

    async def running_drained(self) -> None:
        """Return once no sequence is running (queued ones may wait)."""
        ...

    async def quiesce(self) -> None:
        """Return once no step is in flight (after a pause "keep", nothing steps again)."""
        ...

    async def load_weights(self, weights_path: str) -> None:
        """Check and load a checkpoint between two steps; raises WeightsError, model untouched."""
        ...

    async def label_weights(self, label: str) -> None:
        """Name the weights that sample from the next step on (vLLM's `/update_weight_version`)."""
        ...

    def trace_since(self, since: float) -> dict[str, Any] | None:
        """Engine steps since `since` (unix time), or None for a backend that keeps no trace."""
        ...

    async def aclose(self) -> None: ...
