"""The dispatcher's ledger: open groups, calls in flight, counters, and per-attempt sampling seeds."""

from __future__ import annotations

import asyncio
import collections
import hashlib
from collections import Counter
from dataclasses import dataclass, field

from beam_rl.dispatch.resume import Call, Replay, ResumePoint
from beam_rl.dispatch.server_pool import Server
from beam_rl.envs.base import Environment
from beam_rl.inference.inflight import Progress
from beam_rl.inference.types import Completion, SamplingParams
from beam_rl.types import GroupRequest


def rollout_seed(run_seed: int, group_id: str, attempt: int) -> int:
    """A sampling seed distinct per (run, group, attempt) and stable across restarts.

    Stable so a re-dispatched group samples the same tokens; 31 bits so every server accepts it.
    """
    digest = hashlib.blake2b(f"{run_seed}/{group_id}/{attempt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & 0x7FFF_FFFF


@dataclass
class DispatchCounters:
    started: int = 0  # rollouts launched (permits taken)
    ok: int = 0
    errored: int = 0
    cancelled: int = 0  # launched ones cancelled plus attempts cancelled before they started
    groups_admitted: int = 0
    redispatched: int = 0  # times a launch moved off a failed server (a group call of n counts n)
    regenerated: int = 0  # rollouts started again because new weights made them too stale
    cancelled_stale: int = 0  # rollouts cancelled as too stale once regenerating them could not help
    redone_on_restart: int = 0  # rollouts started again from their prompt: their server restarted under them
    resumed: int = 0  # rollouts continued from the tokens a runner checkpoint kept (dispatch/resume.py)
    resumed_tokens: int = 0  # the tokens they were continued from

    @property
    def emitted(self) -> int:
        return self.ok + self.errored + self.cancelled


@dataclass(eq=False)
class OpenGroup:
    """A group admitted from the source whose rollouts have not all been emitted yet."""

    request: GroupRequest
    env: Environment
    mode: str
    sampling: SamplingParams
    prompt_ids: list[int]
    attempts: collections.deque[int]  # not started yet, in order
    server: Server | None = None  # the pinned server
    version_start: int | None = None  # policy version its first rollout started on
    t_admitted: float | None = None  # when it was opened
    tasks: set[asyncio.Task] = field(default_factory=set)
    cancelled: bool = False  # its launches still unwinding leave as cancelled, none starts again
    # Per attempt, across its launches: times it was regenerated, and the tokens its earlier launches
    # generated and lost, by fate (schemas/fields.py DISCARD_FATES).
    regenerations: Counter[int] = field(default_factory=Counter)
    discarded: dict[int, Counter[str]] = field(default_factory=dict)
    # Restored from a runner checkpoint: per attempts of a launch, the tokens it had (dispatch/resume.py).
    resume: dict[tuple[int, ...], ResumePoint] = field(default_factory=dict)
    order: int = 0  # admission order in its dispatcher (open groups first)

    @property
    def group_id(self) -> str:
        return self.request.group_id

    @property
    def rollouts_to_schedule(self) -> int:
        return len(self.attempts)

    @property
    def finished(self) -> bool:
        return self.rollouts_to_schedule == 0 and not self.tasks


@dataclass(eq=False)
class Launch:
    """One `env.run` (one attempt) or `env.run_group` (all attempts) call in flight."""

    group: OpenGroup
    attempts: tuple[int, ...]
    server: Server  # where it runs now: the pinned server, or where a re-dispatch moved it
    version_start: int
    t_start: float
    cancel_requested: bool = False
    regenerate_requested: bool = False  # cancelled to run again under the current policy
    # What its tokens count as if it is cancelled or run again: "cancelled" (a shutdown), "stale" (new weights
    # put it past the bound), or "server_failure" (its server restarted under it, on the wrong weights).
    discard_fate: str = "cancelled"
    redispatches: int = 0
    released: int = 0  # permits given back before it ended: its choices the server finished (group calls)
    progress: Progress = field(default_factory=Progress)  # its tokens as they arrive, over every server
    completions: list[Completion] = field(default_factory=list)  # what the environment got, in call order
    # A checkpoint's view of it (dispatch/resume.py): its finished calls, the digest of the one in flight
    # (whose tokens so far are `progress.live`), and, resumed after a restore, the record it answers from.
    # A finished call waits in `calls_to_compact` (prompt digest, completions) until a checkpoint compacts it
    # into `calls`: most launches end before any checkpoint takes them, and so never pay for it.
    calls: list[Call] = field(default_factory=list)
    calls_to_compact: list[tuple[bytes, list[Completion]]] = field(default_factory=list)
    live_prompt: bytes | None = None
    replay: Replay | None = None

    def __post_init__(self) -> None:
        if self.progress.choices != len(self.attempts):
            self.progress = Progress(len(self.attempts))

    @property
    def permits(self) -> int:
        """Its rollouts: the permits it took."""
        return len(self.attempts)

    @property
    def held(self) -> int:
        """The permits it holds now."""
        return self.permits - self.released

    def resume_point(self) -> ResumePoint | None:
        """What a checkpoint taken now keeps of it; None when it holds no token yet. Its finished calls are
        compacted first, once: the next checkpoint reuses them."""
        if self.replay is not None and not self.calls and not self.calls_to_compact and self.live_prompt is None:
            return self.replay.point  # resumed, and its environment has not called yet
        self._compact_finished_calls()
        calls = list(self.calls)
        live = self.progress.live
        if self.live_prompt is not None and live is not None and any(c.token_ids for c in live):
            calls.append(Call.of(self.live_prompt, live, finished=False))
        if not any(call.tokens for call in calls):
            return None
        return ResumePoint(self.group.group_id, self.attempts, self.version_start, self.t_start, tuple(calls))

    def _compact_finished_calls(self) -> None:
        self.calls += [Call.of(prompt, done, finished=True) for prompt, done in self.calls_to_compact]
        self.calls_to_compact.clear()

    @property
    def name(self) -> str:
        return f"{self.group.group_id}/{self.attempts[0]}" + (
            f"..{self.attempts[-1]}" if len(self.attempts) > 1 else ""
        )
