"""How many rollouts a dispatcher keeps in flight (`dispatch.concurrency.mode`).

- `fixed`: `inference.max_inflight` permits, always.
- `goodput`: the cap that maximizes trained tokens per second: completion tokens of rollouts that finished
  inside the off-policy bound, per second. More in flight raises generated tokens/s until the engines
  saturate; past that it only makes each rollout slower, so more of its tokens come from policies the
  bound throws away (regenerated or cancelled: they never finish) and the trained rate falls. The
  controller starts at a quarter of the ceiling and grows by half while the rate is no worse (slow start),
  then steps down from the best cap by the same factor while the rate is no worse (descent: the start can be
  past the peak, when the KV caches hold fewer sequences than that), then probes one step up and one step
  down at a time, keeping a probe only when it measured better; probes get closer and rarer while they
  lose, so it settles near the peak, and open up again when the rate moves, so it follows a change of
  lengths or step times; a measurement far below the last accepted one (a collapse: the step time rose,
  or servers went away) halves the cap at once. Measurements span whole policy steps.
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

    def finished(self, trained_tokens: int, now: float, version: int | None = None) -> None:
        """A rollout finished (or was thrown away to be regenerated): `trained_tokens` of its completion tokens
        can train (0 when none can); `version` is the policy then (None: not known)."""

    def loads(self, kv_usages: Sequence[float], preempted: bool, now: float) -> None:
        """The KV-cache usage of each healthy server that reports it, as just polled, and whether any
        server preempted sequences since the last poll."""

    def describe(self) -> dict[str, object]:
        """What the controller holds now, for status and metrics."""


class FixedConcurrency:
    counts_trained_tokens = False

    def __init__(self, cap: int) -> None:
        self.cap = cap

    def finished(self, trained_tokens: int, now: float, version: int | None = None) -> None:
        pass

    def loads(self, kv_usages: Sequence[float], preempted: bool, now: float) -> None:
        pass

    def describe(self) -> dict[str, object]:
        return {"mode": "fixed", "cap": self.cap}


@dataclass
class _Measurement:
    cap: int
    warmup_left: int  # rollouts to let finish before measuring: those started under the previous cap
    set_at_step: int = 0  # the controller's count of policy steps when the cap was set
    version: int | None = None  # the policy when the measured span began
    steps: int = 0  # the controller's count of policy steps then
    started_at: float | None = None
    finished: int = 0
    tokens: int = 0
    squares: float = 0.0  # of each rollout's trained tokens: how much the sum varies

    def precise_to(self, precision: float) -> bool:
        """Is the rate's relative standard error under `precision`? Finishes as a Poisson stream, each with
        its own tokens: the sum's variance is the sum of the squares. A long tail needs many rollouts."""
        return self.tokens > 0 and self.squares**0.5 <= precision * self.tokens

    def rate(self, now: float) -> float:
        elapsed = now - self.started_at if self.started_at is not None else 0.0
        return self.tokens / elapsed if elapsed > 0 else 0.0


class GoodputController:
    """Hill-climbs the in-flight cap on trained tokens per second (see the module docstring).

    A measurement under a cap begins at the first policy step after as many rollouts as the previous cap or
    this one (the larger) have finished since it was set, or `max_span_steps` policy steps after it: the pool
    turned over. It ends at the first policy step after `max(min_rollouts, measure_turns * cap)` more have
    finished and the rate is known to `precision` (its relative standard error, twice it in slow start and
    descent: a long tail of lengths needs more rollouts), or once it spans `max_span_steps` policy steps (and
    `min_rollouts`) or 16x the rollouts: past the peak, a cap's worth of rollouts can take minutes. Whole
    policy steps, because that is when work goes stale: a span cut mid-step would count a step's stale
    rollouts or not by chance. The first measurement waits for `fill_steps` policy steps: until then a pool
    that filled from empty has no stale work. Without policy versions (or when the policy does not move within 4x the
    rollouts), the counts alone decide.

    Probing: a probe moves the accepted cap by `step` (an eighth of it at first: past the peak, a probe is paid
    for at its rate). Each time a probe up and a probe down have both lost, the step halves (down to
    `min_step`) and the accepted cap is re-measured one more time before the next probe (up to `max_hold`
    times): near the peak it probes closer and less often. A probe is kept only if it wins twice in a row,
    and the accepted rate is then the mean of the two: one measurement near a full KV cache varies by up to
    a fifth, more than the margins a probe must win by. A winning probe, or a re-measurement that moved by
    more than `shift`, opens the search again."""

    counts_trained_tokens = True

    def __init__(
        self,
        ceiling: int,
        floor: int = 1,
        start: int | None = None,
        *,
        min_rollouts: int = 16,
        measure_turns: int = 1,
        precision: float = 0.05,
        tolerance: float = 0.03,
        down_tolerance: float = 0.02,
        collapse: float = 0.5,
        shift: float = 0.2,
        min_step: float = 1 / 16,
        max_hold: int = 4,
        fill_steps: int = 2,
        max_span_steps: int = 4,
        growth: float = 1.5,
        probe_step: float = 1 / 8,
    ) -> None:
        self.ceiling, self.floor = ceiling, floor
        self.cap = _first_cap(ceiling, floor, start, ceiling // 4)
        self.min_rollouts, self.measure_turns, self.precision = min_rollouts, measure_turns, precision
        # A probe up must win by `tolerance`, one down by `down_tolerance`: at equal rates fewer in flight
        # risk less (less KV, less work going stale).
        self.tolerance, self.down_tolerance = tolerance, down_tolerance
        self.collapse, self.shift = collapse, shift
        self.min_step, self.max_hold = min_step, max_hold
        self.fill_steps, self.max_span_steps = fill_steps, max_span_steps
        # Slow start's (and descent's) factor: short of doubling, because the step past the peak is measured
        # at its rate (a doubling past a full KV cache ran at half the best rate).
        self.growth, self.probe_step = growth, probe_step
        self.phase: Literal["slow_start", "descent", "probing"] = "slow_start"
        self.accepted_cap, self.accepted_rate = self.cap, 0.0
        self.step = probe_step
        self._probe_up = True
        self._lost = 0  # probes lost in a row since the last win
        self._hold = self._holds_left = 0  # re-measurements of the accepted cap between two probes
        self._first_win: float | None = None  # a probe's first winning rate, while it is measured again
        self._version: int | None = None  # the policy of the last finished rollout
        self._steps = 0  # policy steps seen
        # (time, cap measured, trained tokens/s) of the latest decisions: a long run makes thousands.
        self.history: collections.deque[tuple[float, int, float]] = collections.deque(maxlen=256)
        self._measure = _Measurement(self.cap, warmup_left=self.cap)

    def finished(self, trained_tokens: int, now: float, version: int | None = None) -> None:
        moved = version is None or version != self._version  # a new policy step (or none known)
        if moved and version is not None and self._version is not None:
            self._steps += 1
        self._version = version
        m = self._measure
        if m.started_at is None:
            m.warmup_left -= 1
            # A pool that filled from empty has no stale work before the policy moved twice (a bound of one
            # step): measured sooner, the first cap would look better than any after it. A policy that never
            # moved in 4x the rollouts: nothing goes stale, the counts alone decide.
            filled = (
                version is None or self._steps >= self.fill_steps or (self._steps == 0 and m.warmup_left <= -4 * m.cap)
            )
            # At a cap past the peak rollouts finish slowly: the pool has turned over after a few policy steps too.
            turned = m.warmup_left <= 0 or self._steps - m.set_at_step >= self.max_span_steps
            if turned and filled and (moved or m.warmup_left <= -4 * m.cap):
                m.started_at, m.version, m.steps = now, version, self._steps  # the span begins
            return
        m.finished += 1
        m.tokens += trained_tokens
        m.squares += trained_tokens**2
        enough = max(self.min_rollouts, self.measure_turns * m.cap)
        # Slow start and descent compare caps half again apart: a coarser rate tells them apart, in a quarter of the
        # rollouts.
        precision = self.precision * (2 if self.phase != "probing" else 1)
        long_enough = self._steps - m.steps >= self.max_span_steps or m.finished >= 16 * enough
        precise = m.finished >= enough and m.precise_to(precision)
        if m.finished < self.min_rollouts or not (precise or long_enough):
            return
        if moved or (m.version == version and m.finished >= 4 * enough):
            self._decide(m.rate(now), now)

    def loads(self, kv_usages: Sequence[float], preempted: bool, now: float) -> None:
        pass

    def _decide(self, rate: float, now: float) -> None:
        self.history.append((now, self.cap, rate))
        if self.phase == "slow_start":
            # Growing goes on while a cap is not clearly worse than the best so far: one measurement varies.
            if rate > self.accepted_rate * (1 - self.tolerance) and self.cap < self.ceiling:
                if rate > self.accepted_rate * (1 + self.tolerance):
                    self.accepted_cap, self.accepted_rate = self.cap, rate
                self._set(max(self.cap + 1, round(self.cap * self.growth)))
                return
            if rate > self.accepted_rate * (1 + self.down_tolerance):  # at equal rates, the smaller cap
                self.accepted_cap, self.accepted_rate = self.cap, rate
            self._descend()
            return
        if self.phase == "descent":  # down while no worse than the best so far: at equal rates, the smaller cap
            if rate >= self.accepted_rate * (1 - self.down_tolerance):
                self.accepted_cap, self.accepted_rate = self.cap, max(rate, self.accepted_rate)
                self._descend()
                return
            self._start_probing()
            return
        if self.cap == self.accepted_cap:  # a re-measurement of the accepted cap: conditions may have changed
            if rate < self.accepted_rate * self.collapse:
                self.accepted_cap = max(self.floor, self.cap // 2)
                self.accepted_rate = 0.0
                self.phase = "slow_start"
                self._set(self.accepted_cap)
                return
            if abs(rate - self.accepted_rate) > self.shift * self.accepted_rate:
                self._reopen()  # lengths or step times changed: the peak may have moved far
                self.accepted_rate = rate
            else:
                self.accepted_rate = (self.accepted_rate + rate) / 2  # two measurements: less noise to beat
            if self._holds_left > 0:
                self._holds_left -= 1
                self._set(self.accepted_cap)
            else:
                self._set(self._probe())
            return
        up = self.cap > self.accepted_cap
        if rate > self.accepted_rate * (1 + (self.tolerance if up else self.down_tolerance)):
            if self._first_win is None:
                # Measured again before it is kept. Up, a first measurement flatters: the KV cache fills, and
                # work goes stale, a rollout's lifetime after the cap rose.
                self._first_win = rate
                self._set(self.cap)
                return
            self.accepted_cap, self.accepted_rate = self.cap, (self._first_win + rate) / 2  # the probe won
            self._first_win = None
            self._reopen(step=self.step * 2)  # keep going that way
            self._set(self._probe())
            return
        self._first_win = None
        self._lost += 1
        self._probe_up = not self._probe_up
        if self._lost >= 2:  # lost both ways: the peak is within a step of the accepted cap
            self._lost = 0
            self.step = max(self.min_step, self.step / 2)
            self._hold = min(self.max_hold, self._hold + 1)
        self._holds_left = self._hold
        self._set(self.accepted_cap)

    def _descend(self) -> None:
        """A step below the accepted cap by slow start's factor; probing once there is none (the floor)."""
        below = max(self.floor, min(self.accepted_cap - 1, round(self.accepted_cap / self.growth)))
        if below >= self.accepted_cap:
            self._start_probing()
            return
        self.phase = "descent"
        self._set(below)

    def _start_probing(self) -> None:
        self.phase = "probing"
        self._reopen()
        self._set(self.accepted_cap)

    def _reopen(self, step: float | None = None) -> None:
        self.step = min(self.probe_step, step or self.probe_step)
        self._lost, self._hold, self._holds_left = 0, 0, 0

    def _probe(self) -> int:
        """One step in the probing direction; the other one at a bound."""
        step = max(1, round(self.accepted_cap * self.step))
        for _ in range(2):
            target = min(self.ceiling, max(self.floor, self.accepted_cap + (step if self._probe_up else -step)))
            if target != self.accepted_cap:
                return target
            self._probe_up = not self._probe_up
        return self.accepted_cap

    def _set(self, cap: int) -> None:
        # The warm-up lets the rollouts in flight under the previous cap finish: as many as the larger cap.
        previous, self.cap = self.cap, min(self.ceiling, max(self.floor, cap))
        self._measure = _Measurement(self.cap, warmup_left=max(previous, self.cap), set_at_step=self._steps)

    def describe(self) -> dict[str, object]:
        return {
            "mode": "goodput",
            "cap": self.cap,
            "phase": self.phase,
            "accepted_cap": self.accepted_cap,
            "accepted_tokens_per_s": round(self.accepted_rate, 1),
            "probe_step": self.step,
        }


class KvController:
    """Keeps the fullest server's KV-cache usage under `soft_cap`: +`step` permits a poll while it is below
    `soft_cap - headroom`, x`decrease` once it is above or a server preempted sequences (vLLM preempts when
    the cache is full: a preempted sequence waits and recomputes its prefix)."""

    counts_trained_tokens = False

    def __init__(
        self,
        ceiling: int,
        floor: int = 1,
        start: int | None = None,
        *,
        soft_cap: float = 0.9,
        headroom: float = 0.1,
        step: int | None = None,
        decrease: float = 0.75,
    ) -> None:
        if not 0 < soft_cap <= 1:
            raise ValueError(f"the KV soft cap must be in (0, 1], got {soft_cap}")
        self.ceiling, self.floor = ceiling, floor
        self.cap = _first_cap(ceiling, floor, start, ceiling // 2)
        self.soft_cap, self.headroom, self.decrease = soft_cap, headroom, decrease
        self.step = step if step is not None else max(1, ceiling // 32)
        self.last_usage: float | None = None

    def finished(self, trained_tokens: int, now: float, version: int | None = None) -> None:
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


def _first_cap(ceiling: int, floor: int, start: int | None, default: int) -> int:
    """`start` (else the mode's `default`) within [floor, ceiling]. The ceiling is the fleet's slots in a run
    that sizes `max_inflight` to them (the fixed mode's best guess). goodput starts at a quarter of them:
    with long completions the KV caches hold about that many sequences (bench/throughput/concurrency.json),
    and a cap past the peak is measured at its collapsed rate; kv at half, growing from its caches' usage."""
    if not 1 <= floor <= ceiling:
        raise ValueError(f"the in-flight floor ({floor}) must be between 1 and the ceiling ({ceiling})")
    return min(ceiling, max(floor, start if start is not None else default))


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


def concurrency_controller(
    mode: str, ceiling: int, floor: int = 1, start: int | None = None, *, kv_soft_cap: float = 0.9
) -> ConcurrencyController:
    """The controller `mode` names, at most `ceiling` in flight."""
    if mode == "fixed":
        return FixedConcurrency(ceiling)
    if mode == "goodput":
        return GoodputController(ceiling, floor, start)
    if mode == "kv":
        return KvController(ceiling, floor, start, soft_cap=kv_soft_cap)
    raise ValueError(f"dispatch.concurrency.mode must be one of {CONCURRENCY_MODES}, got {mode!r}")
