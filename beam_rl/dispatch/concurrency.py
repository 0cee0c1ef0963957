"""How many rollouts a dispatcher keeps in flight (`dispatch.concurrency.mode`).

- `fixed`: `inference.max_inflight` permits, always.
- `goodput`: the cap that maximizes trained tokens per second: completion tokens of rollouts that finished
  inside the off-policy bound, per second. More in flight raises generated tokens/s until the engines
  saturate; past that it only makes each rollout slower, so more of its tokens come from policies the
  bound throws away (regenerated or cancelled: they never finish) and the trained rate falls. The
  controller starts small and doubles while the rate improves (slow start), then probes one step up and
  one step down at a time, keeping a probe only when it measured better, so it follows a change of
  lengths or step times; a measurement far below the last accepted one (a collapse: the step time rose,
  or servers went away) halves the cap at once.
- `kv`: each server's KV-cache usage (vLLM's `vllm:kv_cache_usage_perc`) kept under a soft cap, additive
  increase and multiplicative decrease, on the loads the server pool polls.

A controller only sets the permits' capacity: a rollout running when the cap falls finishes; no new one
starts until the count is back under it. `inference.max_inflight` is the ceiling of every mode.
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

CONCURRENCY_MODES: tuple[str, ...] = ("fixed", "goodput", "kv")


class ConcurrencyController(Protocol):
    cap: int
    counts_trained_tokens: bool  # whether `finished` needs its argument (the dispatcher skips it if not)

    def finished(self, trained_tokens: int, now: float) -> None:
        """A rollout finished: `trained_tokens` of its completion tokens can train (0 when none can)."""

    def loads(self, kv_usages: Sequence[float], preempted: bool, now: float) -> None:
        """The KV-cache usage of each healthy server that reports it, as just polled, and whether any
        server preempted sequences since the last poll."""

    def describe(self) -> dict[str, object]:
        """What the controller holds now, for status and metrics."""


class FixedConcurrency:
    counts_trained_tokens = False

    def __init__(self, cap: int) -> None:
        self.cap = cap

    def finished(self, trained_tokens: int, now: float) -> None:
        pass

    def loads(self, kv_usages: Sequence[float], preempted: bool, now: float) -> None:
        pass

    def describe(self) -> dict[str, object]:
        return {"mode": "fixed", "cap": self.cap}


@dataclass
class _Measurement:
    cap: int
    warmup_left: int  # rollouts to let finish before measuring: those started under the previous cap
    started_at: float | None = None
    finished: int = 0
    tokens: int = 0

    def rate(self, now: float) -> float:
        elapsed = now - self.started_at if self.started_at is not None else 0.0
        return self.tokens / elapsed if elapsed > 0 else 0.0


class GoodputController:
    """Hill-climbs the in-flight cap on trained tokens per second (see the module docstring).

    A measurement under a cap starts once `cap` rollouts have finished since it was set (the pool turned
    over once) and lasts until `max(min_rollouts, measure_turns * cap)` more have finished."""

    counts_trained_tokens = True

    def __init__(self, ceiling: int, floor: int = 1, start: int | None = None, *, min_rollouts: int = 16,
                 measure_turns: int = 2, tolerance: float = 0.05, collapse: float = 0.5) -> None:
        self.ceiling, self.floor = ceiling, floor
        self.cap = _first_cap(ceiling, floor, start)
        self.min_rollouts, self.measure_turns = min_rollouts, measure_turns
        self.tolerance, self.collapse = tolerance, collapse
        self.phase: Literal["slow_start", "probing"] = "slow_start"
        self.accepted_cap, self.accepted_rate = self.cap, 0.0
        self._probe_up = True
        # (time, cap measured, trained tokens/s) of the latest decisions: a long run makes thousands.
        self.history: collections.deque[tuple[float, int, float]] = collections.deque(maxlen=256)
        self._measure = _Measurement(self.cap, warmup_left=0)

    def finished(self, trained_tokens: int, now: float) -> None:
        m = self._measure
        if m.warmup_left > 0:
            m.warmup_left -= 1
            return
        if m.started_at is None:
            m.started_at = now  # this rollout closes the warm-up: the measured span begins with it
            return
        m.finished += 1
        m.tokens += trained_tokens
        if m.finished >= max(self.min_rollouts, self.measure_turns * m.cap):
            self._decide(m.rate(now), now)

    def loads(self, kv_usages: Sequence[float], preempted: bool, now: float) -> None:
        pass

    def _decide(self, rate: float, now: float) -> None:
        self.history.append((now, self.cap, rate))
        if self.phase == "slow_start":
            if rate > self.accepted_rate * (1 + self.tolerance) and self.cap < self.ceiling:
                self.accepted_cap, self.accepted_rate = self.cap, rate
                self._set(self.cap * 2)
                return
            if rate > self.accepted_rate:
                self.accepted_cap, self.accepted_rate = self.cap, rate
            self.phase = "probing"
            self._set(self.accepted_cap)
            return
        if self.cap == self.accepted_cap:  # a re-measurement of the accepted cap: conditions may have changed
            if rate < self.accepted_rate * self.collapse:
                self.accepted_cap = max(self.floor, self.cap // 2)
                self.accepted_rate = 0.0
                self.phase = "slow_start"
                self._set(self.accepted_cap)
                return
            self.accepted_rate = rate
            self._set(self._probe())
            return
        if rate > self.accepted_rate * (1 + self.tolerance):
            self.accepted_cap, self.accepted_rate = self.cap, rate  # the probe won: keep going that way
            self._set(self._probe())
            return
        self._probe_up = not self._probe_up
        self._set(self.accepted_cap)

    def _probe(self) -> int:
        """One step (a quarter of the accepted cap) in the probing direction; the other one at a bound."""
        step = max(1, self.accepted_cap // 4)
        for _ in range(2):
            target = min(self.ceiling, max(self.floor, self.accepted_cap + (step if self._probe_up else -step)))
            if target != self.accepted_cap:
                return target
            self._probe_up = not self._probe_up
        return self.accepted_cap

    def _set(self, cap: int) -> None:
        self.cap = min(self.ceiling, max(self.floor, cap))
        self._measure = _Measurement(self.cap, warmup_left=self.cap)

    def describe(self) -> dict[str, object]:
        return {"mode": "goodput", "cap": self.cap, "phase": self.phase, "accepted_cap": self.accepted_cap,
                "accepted_tokens_per_s": round(self.accepted_rate, 1)}


class KvController:
    """Keeps the fullest server's KV-cache usage under `soft_cap`: +`step` permits a poll while it is below
    `soft_cap - headroom`, x`decrease` once it is above or a server preempted sequences (vLLM preempts when
    the cache is full: a preempted sequence waits and recomputes its prefix)."""

    counts_trained_tokens = False

    def __init__(self, ceiling: int, floor: int = 1, start: int | None = None, *, soft_cap: float = 0.9,
                 headroom: float = 0.1, step: int | None = None, decrease: float = 0.75) -> None:
        if not 0 < soft_cap <= 1:
            raise ValueError(f"the KV soft cap must be in (0, 1], got {soft_cap}")
        self.ceiling, self.floor = ceiling, floor
        self.cap = _first_cap(ceiling, floor, start)
        self.soft_cap, self.headroom, self.decrease = soft_cap, headroom, decrease
        self.step = step if step is not None else max(1, ceiling // 32)
        self.last_usage: float | None = None

    def finished(self, trained_tokens: int, now: float) -> None:
        pass

    def loads(self, kv_usages: Sequence[float], preempted: bool, now: float) -> None:
        if not kv_usages:
            return  # no server reports its cache: nothing to steer by
        self.last_usage = usage = max(kv_usages)
        if usage > self.soft_cap or preempted:
            self.cap = max(self.floor, int(self.cap * self.decrease))
        elif usage < self.soft_cap - self.headroom:
            self.cap = min(self.ceiling, self.cap + self.step)

    def describe(self) -> dict[str, object]:
        return {"mode": "kv", "cap": self.cap, "kv_cache_usage": self.last_usage}


def _first_cap(ceiling: int, floor: int, start: int | None) -> int:
    """`start` (default: an eighth of the ceiling) within [floor, ceiling]."""
    if not 1 <= floor <= ceiling:
        raise ValueError(f"the in-flight floor ({floor}) must be between 1 and the ceiling ({ceiling})")
    return min(ceiling, max(floor, start if start is not None else ceiling // 8))


def committed_concurrency(windows: Sequence[Any], servers: Collection[str]) -> int | None:
    """The most rollouts that were in flight at once on `servers`, among those of committed windows
    (their t_sent and t_finished): where a restarted controller starts, instead of from scratch. A lower
    bound on the cap that ran (rollouts of steps not committed yet were in flight too), which slow start
    then raises. None when the windows have no such rollout."""
    edges: list[tuple[float, int]] = []
    for window in windows:
        columns = window.select(["server", "t_sent", "t_finished"]).to_pydict()
        for server, sent, done in zip(columns["server"], columns["t_sent"], columns["t_finished"], strict=True):
            if server in servers and sent is not None and done is not None and done >= sent:
                edges += [(sent, 1), (done, -1)]
    if not edges:
        return None
    inflight = most = 0
    for _, change in sorted(edges, key=lambda e: (e[0], e[1])):  # a finish before a start at the same time
        inflight += change
        most = max(most, inflight)
    return most


def concurrency_controller(mode: str, ceiling: int, floor: int = 1, start: int | None = None, *,
                           kv_soft_cap: float = 0.9) -> ConcurrencyController:
    """The controller `mode` names, at most `ceiling` in flight."""
    if mode == "fixed":
        return FixedConcurrency(ceiling)
    if mode == "goodput":
        return GoodputController(ceiling, floor, start)
    if mode == "kv":
        return KvController(ceiling, floor, start, soft_cap=kv_soft_cap)
    raise ValueError(f"dispatch.concurrency.mode must be one of {CONCURRENCY_MODES}, got {mode!r}")
