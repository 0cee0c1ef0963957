"""A shard's live state for people and the report: status files, load history, the errors it has seen, the
all-servers-down limit, the stall watch and the stop of a run that nothing can train."""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

from beam_rl.rundir import RunDir
from beam_rl.source.admission import Hold
from beam_rl.types import Rollout, RolloutStatus

_LOG = logging.getLogger(__name__)


class AllServersDownError(RuntimeError):
    """Every inference server of a shard stayed unhealthy past the configured limit."""


@dataclass
class HeldBack:
    """How long admission has been held back for each reason, in total."""

    total_s: dict[str, float] = field(default_factory=dict)
    _reason: Hold | None = None
    _since: float = 0.0

    def note(self, reason: Hold | None, now: float) -> None:
        if self._reason is not None:
            self.total_s[self._reason.value] = self.total_s.get(self._reason.value, 0.0) + now - self._since
        self._reason, self._since = reason, now

    @property
    def reason(self) -> Hold | None:
        return self._reason


class StallWatch:
    """Whether the pipeline has stalled: nothing is out, and no step has committed nor a group returned for
    `quiet_steps` step intervals (at least `min_quiet_s`; `first_quiet_s` before a step interval is known).
    Then the groups in transit cannot fill a step (filters took more of them than `room_share` says) and only
    admitting more moves the run: OFF_POLICY and SINK stand aside until the next step commits."""

    def __init__(self, min_quiet_s: float = 2.0, quiet_steps: float = 3.0, first_quiet_s: float = 10.0) -> None:
        self.min_quiet_s, self.quiet_steps, self.first_quiet_s = min_quiet_s, quiet_steps, first_quiet_s
        self.stalled = False
        self._step: int | None = None
        self._returned = -1
        self._last_news = 0.0  # when a step last committed or a group last returned
        self._committed_at: float | None = None
        self._step_s: float | None = None  # between the last two commits that no stall held up

    def update(
        self, now: float, last_committed: int, groups_out: int, groups_returned: int, waiting_for_trainer: bool = False
    ) -> bool:
        if waiting_for_trainer:  # no step comes until the trainer publishes: that is no stall
            self._last_news = now
        if last_committed != self._step:
            if self._committed_at is not None and not self.stalled:  # a stall's wait is no step's length
                self._step_s = now - self._committed_at
            self._step, self._committed_at, self._last_news, self.stalled = last_committed, now, now, False
        if groups_returned != self._returned:
            self._returned, self._last_news = groups_returned, now
        quiet_s = self.first_quiet_s if self._step_s is None else max(self.min_quiet_s, self.quiet_steps * self._step_s)
        if groups_out == 0 and now - self._last_news > quiet_s and not self.stalled:
            self.stalled = True
            _LOG.warning(
                "no step in %.0fs with nothing out: the groups returned were filtered out or errored "
                "(`beam-rl status RUN` shows errors by cause); admitting past the off-policy and sink "
                "limits until a step commits",
                now - self._last_news,
            )
        return self.stalled


class ServersDownWatch:
    """Waiting for servers that are all down is fine for a while; forever is not.

    - Servers that answered a request since this dispatcher started get `limit_s`.
    - Until one has, `startup_limit_s`, counted from the first moment all were down; a server that passes
      a health probe again without answering a request (one that answers every request with HTTP 500)
      does not restart that clock.
    """

    def __init__(self, urls: list[str], limit_s: float, startup_limit_s: float) -> None:
        self.urls = urls  # the shard's servers now (a living fleet changes them)
        self._limit_s = limit_s
        self._startup_limit_s = startup_limit_s
        self.down_since: float | None = None

    def check(self, healthy: int, answered: bool, now: float) -> None:
        if healthy > 0 and (answered or self.down_since is None):
            if self.down_since is not None:
                _LOG.warning("an inference server is healthy again; dispatch resumes")
            self.down_since = None
            return
        limit = self._limit_s if answered else self._startup_limit_s
        if self.down_since is None:
            self.down_since = now
            _LOG.warning(
                "all %d inference servers are unhealthy; waiting for one to come back (limit %.0fs)",
                len(self.urls),
                limit,
            )
        elif now - self.down_since > limit:
            servers = f"all {len(self.urls)} inference servers ({', '.join(self.urls)})"
            if answered:
                raise AllServersDownError(
                    f"{servers} have been unhealthy for {now - self.down_since:.0f}s, past "
                    f"inference.all_servers_down_timeout_s = {limit:g}"
                )
            raise AllServersDownError(
                f"none of {servers} has answered a request since the run started: all "
                f"unhealthy {now - self.down_since:.0f}s ago, past "
                f"inference.startup_timeout_s = {limit:g}"
            )


_ERROR_TYPE = re.compile(r"([A-Za-z_][\w.]*): ")
_HTTP_STATUS = re.compile(r"\bHTTP (\d{3})\b")
_EXAMPLE_CHARS = 300  # enough to say what went wrong; a server's whole answer would flood the status file


def error_cause(error: str) -> str:
    """What an error says went wrong without its particulars (which row, which server): the error's type
    (the text before its first ': '), and the HTTP status where it names one."""
    kind = match.group(1) if (match := _ERROR_TYPE.match(error)) else error[:60]
    status = _HTTP_STATUS.search(error)
    return f"{kind} (HTTP {status.group(1)})" if status else kind


@dataclass
class ErrorCause:
    count: int
    example: str  # the newest one, naming its environment and row
    last_at: float  # time.time() of the newest one


class ErrorTally:
    """The errored rollouts a shard has emitted, by cause (`error_cause`): how many, and the newest one."""

    def __init__(self) -> None:
        self.causes: dict[str, ErrorCause] = {}

    def note(self, rollout: Rollout, now: float) -> None:
        error = rollout.errors[-1] if rollout.errors else "no error message"
        where = f"env {rollout.env_name!r} row {rollout.index} (epoch {rollout.epoch})"
        example = " ".join((error if where in error else f"{where}: {error}").split())
        entry = self.causes.setdefault(error_cause(error), ErrorCause(0, "", 0.0))
        entry.count += 1
        entry.example, entry.last_at = example[:_EXAMPLE_CHARS], now

    @property
    def total(self) -> int:
        return sum(entry.count for entry in self.causes.values())

    def most_frequent(self) -> str:
        """The most frequent cause in one line: how many of the errored rollouts, and its newest example."""
        cause, entry = max(self.causes.items(), key=lambda item: (item[1].count, item[1].last_at))
        return f"{cause}, {entry.count} of {self.total} errored rollouts; the newest: {entry.example}"

    def as_status(self) -> list[dict[str, Any]]:
        """For the status file: each cause, the newest first."""
        return [
            {"cause": cause, "count": e.count, "example": e.example, "last_at": e.last_at}
            for cause, e in sorted(self.causes.items(), key=lambda item: -item[1].last_at)
        ]


class NothingTrainsError(RuntimeError):
    """The rollouts keep failing and no step can come of them: the run stops, naming the most frequent cause."""


class ProgressWatch:
    """Stops a run that nothing can train, so it does not retry in silence (rules 0 turns off):

    - every rollout of `errored_groups` consecutive training groups errored;
    - no step has committed for `failing_s` seconds (counted from this source's start, the last commit or
      the last wait for the trainer) while at least half of the training rollouts finished since errored.
    """

    def __init__(self, errored_groups: int, failing_s: float, tally: ErrorTally, now: float) -> None:
        self.errored_groups, self.failing_s, self._tally = errored_groups, failing_s, tally
        self.consecutive = 0  # training groups returned in a row whose every rollout errored
        self._step: int | None = None
        self._since = now
        self._ok = self._errored = 0  # training rollouts finished since `_since`

    def rollout_finished(self, rollout: Rollout) -> None:
        if rollout.status is RolloutStatus.ERROR:
            self._errored += 1
        elif rollout.status is RolloutStatus.OK:
            self._ok += 1

    def group_returned(self, all_errored: bool) -> None:
        self.consecutive = self.consecutive + 1 if all_errored else 0

    @property
    def too_many_errored_groups(self) -> bool:
        return bool(self.errored_groups) and self.consecutive >= self.errored_groups

    def check(self, now: float, last_committed: int, waiting_for_trainer: bool) -> None:
        """NothingTrainsError when a rule says the run cannot train."""
        if last_committed != self._step or waiting_for_trainer:
            self._step, self._since, self._ok, self._errored = last_committed, now, 0, 0
        if self.too_many_errored_groups:
            raise NothingTrainsError(
                f"nothing can train: every rollout of the last {self.errored_groups} groups errored "
                f"(run.stop_after_errored_groups = {self.errored_groups}); most frequent cause: "
                f"{self._tally.most_frequent()}"
            )
        if self.failing_s and now - self._since > self.failing_s and self._errored and self._errored >= self._ok:
            raise NothingTrainsError(
                f"nothing can train: no step committed in {now - self._since:.0f}s while {self._errored} of the "
                f"{self._errored + self._ok} rollouts finished errored (run.stop_after_failing_s = "
                f"{self.failing_s:g}); most frequent cause: {self._tally.most_frequent()}"
            )


class StatusBoard:
    """Writes the shard's status file at most every `status_s` and a load sample to metrics.jsonl at
    most every `history_s` (`beam-rl report` plots utilization from those)."""

    def __init__(self, run_dir: RunDir, shard: int, status_s: float = 1.0, history_s: float = 2.0) -> None:
        self._run_dir = run_dir
        self._shard = shard
        self._status_s = status_s
        self._history_s = history_s
        self._last_status = float("-inf")
        self._last_history = float("-inf")

    def due(self, now: float) -> bool:
        return now - self._last_status >= self._status_s

    def publish(self, status: dict[str, Any], now: float) -> None:
        self._last_status = now
        self._run_dir.write_status({"updated_at": time.time(), "shard": self._shard, **status}, shard=self._shard)
        if now - self._last_history < self._history_s:
            return
        self._last_history = now
        self._run_dir.append_metrics(
            {
                "dispatch": {
                    "t": time.time(),
                    "shard": self._shard,
                    "inflight": status["inflight"],
                    "max_inflight": status["max_inflight"],
                    "servers": status["servers"],
                }
            }
        )
