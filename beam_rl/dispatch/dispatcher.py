"""The dispatcher: starts rollouts on inference servers under a permit cap and emits each exactly once.

Every rule has one home: permits (`_schedule_group_rollout`), group affinity (`_pin_server`, `_moved`),
open groups first (`_try_schedule`), version stamps (`_schedule_group_rollout` / `_stamp_versions`),
re-dispatch on a failed server (failover.LaunchClient), regeneration of too-stale rollouts
(`regenerate_stale`, or `cancel_stale` as `stale_rule` says: `handle_stale`) and of those a restarted
server ran (`redo_on_restarted`), and exactly-once emission (`_on_finished`, `_cancel_group`). Groups
come in through `add` (any thread) and every finished rollout goes out through the `emit` callback, once,
as it finishes.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import heapq
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Literal

from beam_rl.dispatch.concurrency import ConcurrencyController, FixedConcurrency
from beam_rl.dispatch.failover import LaunchClient
from beam_rl.dispatch.ledger import DispatchCounters, Launch, OpenGroup, rollout_seed
from beam_rl.dispatch.permits import Permits
from beam_rl.dispatch.resume import Replay, ResumePoint
from beam_rl.dispatch.server_pool import PoolClient, Restore, Server, ServerPool
from beam_rl.envs.base import Environment, Trajectory
from beam_rl.envs.loop_local import close_loop_locals
from beam_rl.inference.inflight import UNKNOWN_VERSION
from beam_rl.inference.types import CompletionClient, SamplingParams
from beam_rl.types import GroupRequest, Rollout, RolloutStatus

log = logging.getLogger(__name__)

EnvMode = Literal["rollout", "group"]
ENV_MODES: tuple[str, ...] = ("rollout", "group")
# What `handle_stale` does with work new weights made too stale: "regenerate" (`regenerate_stale`) or
# "cancel_group" (`cancel_stale`, the rule before regeneration: bench/recovery/goodput.py's baseline).
StaleRule = Literal["regenerate", "cancel_group"]
STALE_RULES: tuple[str, ...] = ("regenerate", "cancel_group")


class Dispatcher:
    """Keeps the inference servers as busy as permits allow; finished rollouts leave via `emit`.

    It builds its server pool from `clients`, so the pool is told of a restarted server
    (`redo_on_restarted`) from the start; `restore`, `unhealthy_after` and `reprobe_s` are the pool's
    (ServerPool)."""

    def __init__(
        self,
        clients: Sequence[PoolClient],
        envs: Mapping[str, Environment],
        env_modes: Mapping[str, EnvMode],
        sampling: Mapping[str, SamplingParams],
        max_inflight: int,
        policy_version: Callable[[], int],
        emit: Callable[[Rollout], None],
        seed: int = 0,
        clock: Callable[[], float] = time.time,
        max_redispatches: int = 3,
        max_regenerations: int = 2,
        *,
        stale_rule: StaleRule = "regenerate",
        restore: Restore | None = None,
        unhealthy_after: int = 3,
        reprobe_s: float = 5.0,
        concurrency: ConcurrencyController | None = None,
        max_off_policy_steps: int | None = None,
        max_context: int | None = None,
    ) -> None:
        for name, env in envs.items():
            mode = env_modes.get(name, "rollout")
            if mode not in ENV_MODES:
                raise ValueError(f"env {name!r}: mode must be one of {ENV_MODES}, got {mode!r}")
            if mode == "group" and env.multi_turn:
                raise ValueError(f"env {name!r} is multi-turn: it cannot run in 'group' mode")
            if name not in sampling:
                raise ValueError(f"env {name!r} has no SamplingParams")
        if stale_rule not in STALE_RULES:
            raise ValueError(f"stale_rule must be one of {STALE_RULES}, got {stale_rule!r}")
        self.pool = ServerPool(
            clients,
            restore=restore,
            on_restart=self.redo_on_restarted,
            unhealthy_after=unhealthy_after,
            reprobe_s=reprobe_s,
            on_serving=self.wake,
        )
        self.envs = dict(envs)
        self.env_modes = {name: env_modes.get(name, "rollout") for name in envs}
        self.sampling = dict(sampling)
        self.seed = seed
        if max_redispatches < 0 or max_regenerations < 0:
            raise ValueError("max_redispatches and max_regenerations must be >= 0")
        self.max_redispatches = max_redispatches
        self.max_regenerations = max_regenerations
        self.stale_rule = stale_rule
        self.counters = DispatchCounters()
        self._max_inflight = max_inflight
        # The cap on rollouts in flight: fixed at max_inflight, or chosen as the run goes (concurrency).
        self.concurrency = concurrency if concurrency is not None else FixedConcurrency(max_inflight)
        if self.concurrency.cap > max_inflight:
            raise ValueError(f"the in-flight cap {self.concurrency.cap} is above max_inflight {max_inflight}")
        self._permits = Permits(self.concurrency.cap)
        self.max_off_policy_steps = max_off_policy_steps
        self.max_context = max_context  # model.max_context: a prompt this long leaves no room to generate
        self._cap_floor = 1
        self._preemptions_seen: dict[str, float] = {}  # each server's preemption counter at the last poll
        self._policy_version = policy_version
        self._emit_out = emit
        self._clock = clock
        # Added by the source, not yet opened. Appends (any thread) and pops (the loop) of a deque are
        # atomic, so the source hands groups over without a lock or a second queue.
        self._waiting: collections.deque[GroupRequest] = collections.deque()
        self._groups: dict[str, OpenGroup] = {}  # insertion order = admission order
        # Every open group with attempts still to start, on a heap by admission order (a group may stay on it
        # after its last attempt started, until it reaches the top): the rule open groups first takes the oldest
        # without walking the open groups, thousands with a large fleet, most of them with nothing to start.
        self._startable: list[tuple[int, int, OpenGroup]] = []
        self._admitted = itertools.count()
        self._pushed = itertools.count()  # ties between two entries of one group (a requeue)
        self._inflight: dict[asyncio.Task, Launch] = {}
        self._wakeup = asyncio.Event()

    # -- introspection --------------------------------------------------------------------------

    @property
    def max_inflight(self) -> int:
        """The hard cap: no concurrency mode goes above it."""
        return self._max_inflight

    @property
    def inflight_cap(self) -> int:
        """The cap now (max_inflight, or what the concurrency controller chose)."""
        return self._permits.capacity

    @property
    def inflight(self) -> int:
        """Rollouts running now (= permits taken)."""
        return self._permits.in_use

    @property
    def open_groups(self) -> list[str]:
        """Admitted groups with rollouts still to start or still running, in admission order."""
        return list(self._groups)

    @property
    def waiting(self) -> int:
        """Groups added but not yet opened (waiting for permits)."""
        return len(self._waiting)

    # -- schedule side ----------------------------------------------------------------------------

    def add(self, requests: Iterable[GroupRequest]) -> None:
        """Queue groups (from any thread); the caller wakes the loop so `fill` takes them."""
        self._waiting.extend(requests)

    def fill(self) -> int:
        """Start rollouts until no permit is free or there is no work; returns how many started."""
        started = 0
        while self._permits.available > 0:
            launched = self._try_schedule()
            if not launched:
                break
            started += launched
        return started

    def _try_schedule(self) -> int:
        # Rule: open groups first. Continuing a group reuses its pinned server's cached prompt,
        # and strict admission order keeps a big group-mode group from being starved by small ones.
        group = self._oldest_startable()
        if group is None:
            if self.pool.select() is None:
                return 0  # no healthy server: leave fresh work in the source
            group = self._admit_fresh_group()
            if group is None:
                return 0
        return self._schedule_group_rollout(group)

    def _oldest_startable(self) -> OpenGroup | None:
        """The earliest admitted open group with an attempt still to start."""
        while self._startable:
            group = self._startable[0][2]
            if group.rollouts_to_schedule > 0:
                return group
            heapq.heappop(self._startable)
        return None

    def _mark_startable(self, group: OpenGroup, order: int) -> None:
        heapq.heappush(self._startable, (order, next(self._pushed), group))

    def _admit_fresh_group(self) -> OpenGroup | None:
        while self._waiting:
            request = self._waiting.popleft()
            if request.group_id in self._groups:
                raise ValueError(f"group {request.group_id} is already open in this dispatcher")
            self.counters.groups_admitted += 1
            group = self._open(request)
            if group is not None:
                return group
        return None

    def _open(self, request: GroupRequest) -> OpenGroup | None:
        """The group ready to schedule, or None after emitting it as errors (it cannot run)."""
        try:
            env = self.envs[request.env_name]
        except KeyError:
            self._reject(request, f"UnknownEnvironment: {request.env_name!r} (known: {sorted(self.envs)})")
            return None
        mode = self.env_modes[request.env_name]
        if mode == "group" and request.group_size > self.max_inflight:
            self._reject(request, f"GroupTooLarge: group_size {request.group_size} > max_inflight {self.max_inflight}")
            return None
        if mode == "group" and request.group_size > self._cap_floor:
            self._cap_floor = request.group_size  # a group-mode call takes all its permits at once
            self._apply_cap()
        try:
            prompt_ids = list(env.render_prompt(request.row))
        except Exception as exc:
            self._reject(
                request,
                f"PromptRenderError: env {request.env_name!r} row {request.index} (epoch {request.epoch}): "
                f"{type(exc).__name__}: {exc}",
            )
            return None
        if self.max_context is not None and len(prompt_ids) >= self.max_context:
            # Sent, it would fail on every server, every attempt: one error for the group, no request.
            self._reject(
                request,
                f"PromptTooLong: env {request.env_name!r} row {request.index} (epoch {request.epoch}): the prompt "
                f"is {len(prompt_ids)} tokens, leaving no room to generate under model.max_context "
                f"({self.max_context})",
            )
            return None
        group = OpenGroup(
            request,
            env,
            mode,
            self.sampling[request.env_name],
            prompt_ids,
            collections.deque(request.attempts_to_run),
            t_admitted=self._clock(),
            resume={point.attempts: point for point in request.resume},
            order=next(self._admitted),
        )
        self._groups[request.group_id] = group
        self._mark_startable(group, group.order)
        return group

    def _reject(self, request: GroupRequest, error: str) -> None:
        log.error("group %s cannot run: %s", request.group_id, error)
        version, now = self._policy_version(), self._clock()
        for attempt in request.attempts_to_run:
            rollout = self._placeholder(request, attempt, [], version, version, None, now, now, t_admitted=now)
            rollout.capture_error(error)
            self._emit(rollout)

    def _schedule_group_rollout(self, group: OpenGroup) -> int:
        request = group.request
        # Rule: permits. A rollout-mode launch holds one; a group-mode call of n holds n, and when its
        # environment makes that one call, each comes back as the server ends its choice (_choice_ended).
        needed = group.rollouts_to_schedule if group.mode == "group" else 1
        if self._permits.available < needed:
            return 0
        server = self._pin_server(group)
        if server is None:
            return 0
        attempts = tuple(group.attempts.popleft() for _ in range(needed))
        # Rule: version stamps (start). The group's version is the one its first rollout started on.
        version = self._policy_version()
        if group.version_start is None:
            group.version_start = version
        sampling = replace(group.sampling, seed=rollout_seed(self.seed, request.group_id, attempts[0]))
        self._permits.take(needed)
        self.pool.started(server, needed)
        point = self._resume_point(group, attempts, version)
        launch = (
            Launch(group, attempts, server, version, self._clock())
            if point is None
            else self._resumed_launch(group, point, server)
        )
        if needed > 1 and group.env.group_is_one_call():
            launch.progress.on_choice_end = functools.partial(self._choice_ended, launch)
        client = LaunchClient(launch, self.pool, self.max_redispatches, self._moved)
        task = asyncio.create_task(
            _run_env(group.env, group.mode, client, request.row, group.prompt_ids, sampling, needed),
            name=f"rollout {launch.name}",
        )
        self._inflight[task] = launch
        group.tasks.add(task)
        task.add_done_callback(self._on_finished)
        self.counters.started += needed
        return needed

    def _resume_point(self, group: OpenGroup, attempts: tuple[int, ...], version: int) -> ResumePoint | None:
        """The tokens a checkpoint kept of these attempts, if they can still train: ones whose oldest token is
        past the off-policy bound now could only be filtered out, so they start again (counted as stale)."""
        point = group.resume.pop(attempts, None)
        if point is None:
            return None
        oldest, bound = point.oldest_version, self.max_off_policy_steps
        if bound is not None and oldest is not None and version - oldest > bound:
            for attempt, tokens in zip(attempts, point.tokens_per_choice()):
                group.discarded.setdefault(attempt, Counter())["stale"] += tokens
            return None
        return point

    def _resumed_launch(self, group: OpenGroup, point: ResumePoint, server: Server) -> Launch:
        """A launch that continues from a checkpoint's tokens, its start version and time the original's."""
        launch = Launch(group, point.attempts, server, point.version_start, point.t_start, replay=Replay(point))
        floor = point.oldest_version if point.oldest_version is not None else point.version_start
        for choice, tokens in enumerate(point.tokens_per_choice()):
            launch.progress.received(choice, tokens, floor)
        self.counters.resumed += launch.permits
        self.counters.resumed_tokens += point.tokens
        return launch

    def resume_points(self) -> list[ResumePoint]:
        """What a runner checkpoint taken now keeps of the launches in flight: their calls and tokens so
        far. Launches being cancelled or started again keep nothing."""
        points = []
        for task, launch in self._inflight.items():
            if task.done() or launch.cancel_requested or launch.regenerate_requested:
                continue
            point = launch.resume_point()
            if point is not None:
                points.append(point)
        return points

    def _pin_server(self, group: OpenGroup) -> Server | None:
        # Rule: group affinity. The first attempt picks the least-loaded server; later attempts go
        # to the same one so the shared prompt hits its prefix cache. A pinned server that turned
        # unhealthy has no cache worth keeping, so the group moves (as it does with a re-dispatch: _moved).
        if group.server is None or not group.server.healthy:
            group.server = self.pool.select()
        return group.server

    def _choice_ended(self, launch: Launch, choice: int) -> None:
        # A group call's choice that the server finished is a finished rollout: its permit comes back now,
        # so its slot takes other work while the group's longer ones generate. The last comes back with the
        # call (_on_finished).
        if launch.held <= 1:
            return
        launch.released += 1
        self._permits.give_back(1)
        self.pool.finished(launch.server, 1)
        self._wakeup.set()

    def _moved(self, launch: Launch, failed: Server, target: Server) -> None:
        # Group affinity (_pin_server) follows a re-dispatched launch: the group's later attempts go there too.
        self.pool.finished(failed, launch.held)
        self.pool.started(target, launch.held)
        launch.server = launch.group.server = target
        self.counters.redispatched += launch.permits

    # -- collect side -----------------------------------------------------------------------------

    def _on_finished(self, task: asyncio.Task) -> None:
        # Rule: exactly-once emission. This callback runs once per task; popping the ledger entry
        # makes any second look a no-op.
        launch = self._inflight.pop(task, None)
        if launch is None:
            return
        group, request = launch.group, launch.group.request
        group.tasks.discard(task)
        self._permits.give_back(launch.held)
        self.pool.finished(launch.server, launch.held)
        launch.released = launch.permits
        if launch.regenerate_requested and not (launch.cancel_requested or group.cancelled):
            self._requeue(launch)
            if self.concurrency.counts_trained_tokens:
                for _ in launch.attempts:
                    self._observe_finished(0, self._policy_version())  # its tokens are thrown away
            return
        # Rule: version stamps (end).
        version_end, t_finished = self._policy_version(), self._clock()
        rollouts = [
            self._placeholder(
                request,
                a,
                group.prompt_ids,
                launch.version_start,
                version_end,
                launch.server.url,
                launch.t_start,
                t_finished,
                group.t_admitted,
            )
            for a in launch.attempts
        ]
        received = launch.progress.tokens  # per rollout: what a failure or a cancellation throws away
        if launch.cancel_requested or task.cancelled():
            for rollout, tokens in zip(rollouts, received):
                rollout.status = RolloutStatus.CANCELLED
                rollout.discarded_tokens[launch.discard_fate] += tokens
        elif (error := task.exception()) is not None:
            fate = "server_failure" if getattr(error, "server_fault", False) else "errored"
            for rollout, tokens in zip(rollouts, received):
                rollout.capture_error(error)
                rollout.discarded_tokens[fate] += tokens
        else:
            try:
                for rollout, trajectory in zip(rollouts, task.result(), strict=True):
                    rollout.turns, rollout.info = list(trajectory.turns), dict(trajectory.info)
                    if trajectory.prompt_ids is not None:
                        rollout.prompt_ids = list(trajectory.prompt_ids)
                self._stamp_versions(launch, rollouts, version_end)
            except Exception as exc:  # a malformed trajectory must not lose the rollout
                for rollout, tokens in zip(rollouts, received):
                    rollout.turns, rollout.info = [], {}
                    rollout.capture_error(f"BadTrajectory: {type(exc).__name__}: {exc}")
                    rollout.discarded_tokens["errored"] += tokens
            for rollout in rollouts:
                if rollout.ok and (rollout.num_turns == 0 or rollout.completion_tokens == 0):
                    rollout.capture_error(
                        f"EmptyTrajectory: {rollout.num_turns} turns, {rollout.completion_tokens} completion tokens"
                    )
        for rollout in rollouts:
            rollout.t_first_token = launch.progress.first_token_at
            for fate, tokens in group.discarded.pop(rollout.attempt, Counter()).items():
                rollout.discarded_tokens[fate] += tokens
            if self.concurrency.counts_trained_tokens:
                self._observe_finished(self._trainable_tokens(rollout, version_end), version_end)
            self._emit(rollout)
        self._close_if_finished(group)

    def _trainable_tokens(self, rollout: Rollout, version_now: int) -> int:
        """Completion tokens of `rollout` that can train: all of an ok one whose oldest token is inside the
        off-policy bound now (none if it is not, or it failed)."""
        if not rollout.ok:
            return 0
        oldest, bound = rollout.token_version_min, self.max_off_policy_steps
        if bound is not None and oldest is not None and version_now - oldest > bound:
            return 0
        return rollout.completion_tokens

    def _observe_finished(self, trained_tokens: int, version: int) -> None:
        self.concurrency.finished(trained_tokens, self._clock(), version)
        self._apply_cap()

    def observe_loads(self) -> None:
        """Hand the concurrency controller the KV-cache usage the pool just polled, and whether a server
        preempted sequences since the last poll."""
        polled = [(s.url, s.load) for s in self.pool.healthy() if s.load is not None]
        counts = {url: load.preemptions for url, load in polled if load.preemptions is not None}
        preempted = any(n > self._preemptions_seen.get(url, n) for url, n in counts.items())
        self._preemptions_seen.update(counts)
        usages = [load.kv_cache_usage for _, load in polled if load.kv_cache_usage is not None]
        self.concurrency.loads(usages, preempted, self._clock())
        self._apply_cap()

    def _apply_cap(self) -> None:
        cap = min(self._max_inflight, max(self._cap_floor, self.concurrency.cap))
        if cap != self._permits.capacity:
            log.info("in-flight cap %d -> %d (%s)", self._permits.capacity, cap, self.concurrency.describe())
            self._permits.resize(cap)
            self._wakeup.set()

    def _stamp_versions(self, launch: Launch, rollouts: list[Rollout], version_end: int) -> None:
        """Rule: version stamps (per token). A turn the environment built from a completion without passing
        its versions on (environments are plug-ins) gets them from the completion it came from, matched by
        its tokens in call order; a turn matching none is the start version's when no update happened
        during the launch, else unknown."""
        recorded = [c for c in launch.completions if c.policy_versions]
        for rollout in rollouts:
            for turn in rollout.turns:
                if turn.policy_versions:
                    continue
                match = next((c for c in recorded if c.token_ids == turn.completion_ids), None)
                if match is not None:
                    recorded.remove(match)
                    turn.policy_versions = list(match.policy_versions)
                else:
                    unchanged = version_end == launch.version_start
                    turn.policy_versions = [launch.version_start if unchanged else UNKNOWN_VERSION] * len(
                        turn.completion_ids
                    )

    def redo_on_restarted(self, server: Server) -> int:
        """Every launch in flight on `server`, which restarted since its last weight update, starts again
        from its prompt: tokens it sampled on its initial weights carry the wrong version, and which of a
        launch's tokens came before the restart cannot be told. Their tokens count as lost to a server
        failure; the rollouts count as `redone_on_restart`, not against `max_regenerations`. Returns how
        many."""
        redone = 0
        for task, launch in list(self._inflight.items()):
            if launch.server is not server or launch.cancel_requested or launch.regenerate_requested:
                continue
            if task.cancel():
                launch.regenerate_requested = True
                launch.discard_fate = "server_failure"
                redone += launch.permits
        if redone:
            log.warning("%d rollouts in flight on %s start again: it restarted under them", redone, server.url)
        return redone

    def _requeue(self, launch: Launch) -> None:
        """A launch cancelled to run again: its attempts go back to the front of their group (open groups
        first: they start again next), their tokens counted as thrown away (stale, or to its server's restart)."""
        group = launch.group
        stale = launch.discard_fate == "stale"
        for attempt, tokens in zip(launch.attempts, launch.progress.tokens):
            group.discarded.setdefault(attempt, Counter())[launch.discard_fate] += tokens
            if stale:
                group.regenerations[attempt] += 1
        group.attempts.extendleft(reversed(launch.attempts))
        self._mark_startable(group, group.order)
        if stale:
            self.counters.regenerated += launch.permits
        else:
            self.counters.redone_on_restart += launch.permits
        self._wakeup.set()

    def _placeholder(
        self,
        request: GroupRequest,
        attempt: int,
        prompt_ids: list[int],
        version_start: int,
        version_end: int,
        server: str | None,
        t_sent: float,
        t_finished: float,
        t_admitted: float | None = None,
    ) -> Rollout:
        sampling = self.sampling.get(request.env_name, SamplingParams())
        return Rollout(
            group_id=request.group_id,
            env_name=request.env_name,
            attempt=attempt,
            group_size=request.group_size,
            prompt_ids=list(prompt_ids),
            policy_version_start=version_start,
            policy_version_end=version_end,
            server=server,
            t_admitted=t_admitted,
            t_sent=t_sent,
            t_finished=t_finished,
            temperature=sampling.temperature,
            row=request.row,
            epoch=request.epoch,
            index=request.index,
            is_eval=request.is_eval,
            eval_round=request.eval_round,
        )

    def _emit(self, rollout: Rollout) -> None:
        if rollout.status is RolloutStatus.OK:
            self.counters.ok += 1
        elif rollout.status is RolloutStatus.ERROR:
            self.counters.errored += 1
        else:
            self.counters.cancelled += 1
        self._emit_out(rollout)
        self._wakeup.set()  # a permit came back: fill() may start more

    def _close_if_finished(self, group: OpenGroup) -> None:
        if group.finished:
            self._groups.pop(group.group_id, None)

    async def wait_for_work(self, timeout: float | None) -> None:
        """Waits up to `timeout` for something that may let `fill` start more: a rollout finished (its
        permits came back), or `wake` (groups added, a server back in service)."""
        try:
            await asyncio.wait_for(self._wakeup.wait(), timeout)
        except TimeoutError:
            pass
        # Cleared after waiting, not before: a wake() that came while the caller was busy in fill()
        # must still make this call return at once.
        self._wakeup.clear()

    def wake(self) -> None:
        """Make a pending `wait_for_work` return now (e.g. new groups to admit)."""
        self._wakeup.set()

    # -- cancellation -----------------------------------------------------------------------------

    def cancel_groups(self, group_ids: Iterable[str]) -> list[str]:
        """Cancel open groups; returns the ids that were open. Their rollouts all leave as CANCELLED."""
        cancelled = []
        for group_id in group_ids:
            group = self._groups.get(group_id)
            if group is not None:
                self._cancel_group(group)
                cancelled.append(group_id)
        return cancelled

    def handle_stale(self, min_version: int) -> tuple[int, int]:
        """New weights put work whose oldest token may come from a policy older than `min_version` past
        the off-policy bound: `stale_rule` says what happens to it. Returns (rollouts regenerated,
        rollouts cancelled)."""
        if self.stale_rule == "regenerate":
            return self.regenerate_stale(min_version)
        before = self.counters.cancelled_stale
        self.cancel_stale(min_version)
        return 0, self.counters.cancelled_stale - before

    def regenerate_stale(self, min_version: int) -> tuple[int, int]:
        """Rule: regenerate, not cancel. Every launch in flight whose oldest token may come from a policy
        older than `min_version` (new weights put it past the off-policy bound: it could only be dropped)
        is started again under the current policy; its group's finished rollouts are kept, so the group
        still trains. A rollout regenerated `max_regenerations` times already (too long to ever finish
        inside the bound) is cancelled instead. Returns (rollouts regenerated, rollouts cancelled)."""
        regenerated = cancelled = 0
        for task, launch in list(self._inflight.items()):
            oldest = launch.progress.oldest_version
            if launch.cancel_requested or launch.regenerate_requested or oldest is None or oldest >= min_version:
                continue
            if not task.cancel():
                continue  # already done: its callback emits it, and the stale filter judges it
            launch.discard_fate = "stale"
            if all(launch.group.regenerations[a] < self.max_regenerations for a in launch.attempts):
                launch.regenerate_requested = True
                regenerated += launch.permits
            else:
                launch.cancel_requested = True
                cancelled += launch.permits
                self.counters.cancelled_stale += launch.permits
        return regenerated, cancelled

    def cancel_stale(self, min_version: int) -> list[str]:
        """Cancel groups whose first rollout started on a policy version older than `min_version`, whole:
        the behaviour `regenerate_stale` replaced, kept as the baseline bench/recovery/goodput.py measures it against
        (stale_rule "cancel_group")."""
        stale = [g for g in self._groups.values() if g.version_start is not None and g.version_start < min_version]
        for group in stale:
            for task in group.tasks:
                self._inflight[task].discard_fate = "stale"
            self.counters.cancelled_stale += sum(self._inflight[t].permits for t in group.tasks)
            self.counters.cancelled_stale += group.rollouts_to_schedule
        return self.cancel_groups([g.group_id for g in stale])

    def cancel_waiting(self, group_ids: set[str]) -> list[str]:
        """Emit groups added but never opened as CANCELLED, so they still complete downstream."""
        cancelled = [r for r in list(self._waiting) if r.group_id in group_ids]  # a snapshot: add() may append
        for request in cancelled:
            self._waiting.remove(request)
            self._cancel_request(request)
        return [r.group_id for r in cancelled]

    def _cancel_request(self, request: GroupRequest) -> None:
        version, now = self._policy_version(), self._clock()
        for attempt in request.attempts_to_run:
            rollout = self._placeholder(request, attempt, [], version, version, None, now, now)
            rollout.status = RolloutStatus.CANCELLED
            self._emit(rollout)

    def _cancel_group(self, group: OpenGroup) -> None:
        group.cancelled = True
        for task in list(group.tasks):
            # A task already done keeps its real result: its callback is queued and emits it. One being
            # cancelled for regeneration now leaves as cancelled instead of starting again.
            if task.cancel():
                self._inflight[task].cancel_requested = True
        # Attempts never started leave now, as CANCELLED, so the group still reaches group_size
        # downstream. Running ones leave from _on_finished once their task has unwound, which is
        # also when their permits come back: the cap holds for real HTTP calls.
        version, now = self._policy_version(), self._clock()
        server = group.server.url if group.server else None
        while group.attempts:
            rollout = self._placeholder(
                group.request,
                group.attempts.popleft(),
                group.prompt_ids,
                version,
                version,
                server,
                now,
                now,
                group.t_admitted,
            )
            rollout.status = RolloutStatus.CANCELLED
            for fate, tokens in group.discarded.pop(rollout.attempt, Counter()).items():
                rollout.discarded_tokens[fate] += tokens  # an attempt waiting to be regenerated
            self._emit(rollout)
        self._close_if_finished(group)

    async def aclose(self) -> None:
        """Cancel everything in flight, wait for it to unwind, close the clients and what this loop
        holds for its environments (beam_rl.envs.loop_local: the inference proxy, environment servers)."""
        self.cancel_waiting({r.group_id for r in list(self._waiting)})
        self.cancel_groups(list(self._groups))
        await asyncio.gather(*self._inflight, return_exceptions=True)
        await close_loop_locals()
        await self.pool.aclose()


async def _run_env(
    env: Environment,
    mode: str,
    client: CompletionClient,
    row: dict,
    prompt_ids: list[int],
    sampling: SamplingParams,
    n: int,
) -> list[Trajectory]:
    if mode == "group":
        trajectories = list(await env.run_group(client, row, list(prompt_ids), sampling, n=n))
        if len(trajectories) != n:
            raise RuntimeError(f"env {env.name!r} run_group returned {len(trajectories)} trajectories for n={n}")
        return trajectories
    return [await env.run(client, row, list(prompt_ids), sampling)]
