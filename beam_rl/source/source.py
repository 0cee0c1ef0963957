"""One shard of the prompt source and its dispatcher, as one object the dispatch transform drives.

The dispatch SDF claims offsets of the shard's part of the prompt schedule and hands each to `admit`
while `wants_more` says so; `poll` returns finished rollouts as they finish; `in_flight` is what a
checkpoint of the SDF's restriction must carry; `finished` says when the shard's input is over.
Each rule lives in its own module: backpressure (admission), the shard's share (shard), evaluation
rounds (eval_rounds), the commits it reads (commits), live status (status).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from beam_rl.config import RunConfig
from beam_rl.dispatch import DispatcherThread
from beam_rl.dispatch.resume import ResumePoint
from beam_rl.dispatch.weight_sync import WeightSync
from beam_rl.envs.base import Environment
from beam_rl.inference.inflight import UpdateTiming
from beam_rl.processes import worker_id
from beam_rl.rundir import RunDir
from beam_rl.rundir.failures import record_failure
from beam_rl.source.admission import AdmissionLimits, AdmissionState, Hold, hold_reason, input_finished
from beam_rl.source.commits import CommittedSteps
from beam_rl.source.curriculum import Curriculum
from beam_rl.source.eval_rounds import EvalRounds
from beam_rl.source.mixing import EnvMix
from beam_rl.source.restriction import DispatchRange, InFlight
from beam_rl.source.schedule import PromptSchedule
from beam_rl.source.shard import Shard
from beam_rl.source.status import (
    AllServersDownError,
    ErrorTally,
    HeldBack,
    NothingTrainsError,
    ProgressWatch,
    ServersDownWatch,
    StallWatch,
    StatusBoard,
)
from beam_rl.types import Rollout, RolloutStatus

_LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourceSpec:
    """What a worker needs to start a source: the config, the servers and the run directory."""

    config: RunConfig
    server_urls: tuple[str, ...]
    run_dir: str
    run_id: str
    first_step: int = 1  # the step this pipeline run starts at (last committed + 1)
    with_trainer: bool = True  # False: nobody publishes weights, so staleness is not checked
    schedule_groups: int = 0  # len(PromptSchedule), set by the launcher
    schedule_streams: tuple[int, ...] = ()  # PromptSchedule.stream_lengths (unset: one of schedule_groups)

    @property
    def shards(self) -> int:
        return self.config.dispatch.shards

    @property
    def stream_lengths(self) -> tuple[int, ...]:
        return self.schedule_streams or (self.schedule_groups,)

    def shard_draws(self, shard: int) -> int:
        """How many prompts shard `shard` draws over the run (its restriction's offsets)."""
        return sum(Shard(shard, self.shards).draws(self.stream_lengths))


@dataclass(frozen=True)
class SourceParts:
    """The parts a shard's source runs with, built by the wiring (beam_rl/wiring.py:DispatchParts.source_parts)
    from the config, the shard and the run directory as it is when the source starts; the source only
    stores them. The dispatcher and WeightSync need the source's own callbacks, so they come as factories."""

    envs: dict[str, Environment]
    schedule: PromptSchedule
    run_dir: RunDir
    commits: CommittedSteps
    curriculum: Curriculum | None  # None: no curriculum; else following the committed windows already
    mix: EnvMix | None  # None: one stream, environments taking turns; else following the committed windows
    fleet_changes: Callable[[float], list[str] | None] | None  # a living fleet: the shard's servers when changed
    permits: int  # this shard's share of inference.max_inflight
    limits: AdmissionLimits
    evals: EvalRounds
    status: StatusBoard
    servers_down: ServersDownWatch
    errors: ErrorTally
    progress: ProgressWatch  # counts what `errors` tallies
    # (the policy version to stamp) -> the shard's dispatcher, on its own thread
    start_dispatcher: Callable[[Callable[[], int]], DispatcherThread]
    # (how the servers load a version: (path, version) -> each server's timing) -> the shard's WeightSync
    weight_sync: Callable[[Callable[[Path, int], Sequence[UpdateTiming] | None]], WeightSync]


@dataclass(frozen=True)
class EndOfInput:
    """Sent once by each shard when its input is over: `groups` training groups left it whole in this
    pipeline run (counted as the packer's state counts them, across restores)."""

    shard: int
    groups: int


class RolloutSource:
    def __init__(self, spec: SourceSpec, shard: Shard, restored: DispatchRange, parts: SourceParts) -> None:
        self.spec, self.shard = spec, shard
        self.token = restored.in_flight.token  # the token the next process() call must bring (see InFlight)
        self.emitted = restored.in_flight.emitted  # training groups returned whole, this pipeline run
        self.envs = parts.envs
        self.schedule = parts.schedule
        self._run_dir = parts.run_dir
        self._commits = parts.commits
        self._curriculum = parts.curriculum
        self._curriculum_skipped = 0
        self._mix = parts.mix
        self._stream_draws = shard.draws(self.schedule.stream_lengths)  # per stream, the draws this shard owns
        self._draws = self._restored_draws(restored)
        self._next_mixed: int | None = None  # the stream wants_more found for the next claim (mixing)
        self._fleet_changes = parts.fleet_changes
        self._limits = parts.limits
        self._max_inflight = parts.permits
        self._dispatcher = parts.start_dispatcher(self.policy_version)
        self._weights = parts.weight_sync(self._update_servers)
        self._weights.poll()  # servers start on the newest published policy, not the initial one
        self._evals = parts.evals
        self._status = parts.status
        self._held = HeldBack()
        self._stall = StallWatch()
        self._servers_down = parts.servers_down
        self._errors = parts.errors
        self._progress = parts.progress
        self._not_all_errored: set[str] = set()  # training groups out with a rollout that did not error
        self._admitted: dict[str, int] = {}  # training group id -> schedule position, until returned whole
        self._evaluating: set[str] = set()  # evaluation group ids, until returned whole
        self._in_transit: set[int] = set()  # positions returned whole, not yet in a committed step
        self._rollouts_ahead = 0  # the rollouts of the groups admitted or in transit: what a new group queues behind
        self._stopping = False
        self._worker = worker_id()
        self._checkpoint_tokens = spec.config.dispatch.checkpoint_tokens
        self._resume_points: tuple[ResumePoint, ...] = ()  # the last taken (in_flight with_tokens)
        resume = collections.defaultdict(list)
        for point in restored.in_flight.resume:
            resume[point.group_id].append(point)
        for position, attempts in restored.in_flight.redo:
            self._admit(position, attempts, resume)
        if restored.in_flight.redo or restored.start:
            self._note_restore(restored)

    def _note_restore(self, restored: DispatchRange) -> None:
        resume = restored.in_flight.resume
        record = {
            "t": time.time(),
            "shard": self.shard.index,
            "offset": restored.start,
            "groups_emitted_before": self.emitted,
            "groups_run_again": len(self._admitted),
            "rollouts_redone": sum(len(attempts) for _, attempts in restored.in_flight.redo),
            "rollouts_resumed": sum(len(p.attempts) for p in resume),
            "tokens_resumed": sum(p.tokens for p in resume),
            "resume_bytes": sum(p.encoded_bytes for p in resume),
        }
        _LOG.warning(
            "shard %d restored at offset %d: %d groups left it before, %d run again, %d rollouts "
            "continue from %d tokens",
            self.shard.index,
            restored.start,
            self.emitted,
            len(self._admitted),
            record["rollouts_resumed"],
            record["tokens_resumed"],
        )
        self._run_dir.append_metrics({"dispatch_restore": record})

    def _restored_draws(self, restored: DispatchRange) -> list[int]:
        streams = len(self._stream_draws)
        if streams == 1:
            return [restored.start]
        draws = list(restored.draws) + [0] * (streams - len(restored.draws))
        if len(draws) != streams or sum(draws) != restored.start:
            raise ValueError(
                f"restored dispatch range {restored} does not say how many prompts each of the "
                f"schedule's {streams} streams gave (the environments or their ratios changed?)"
            )
        return draws

    def policy_version(self) -> int:
        return self._weights.version

    def _update_servers(self, path: Path, version: int) -> list[UpdateTiming]:
        weights = self.spec.config.weights
        return self._dispatcher.update_weights(
            path, version, weights.update_mode, drain_quiet_s=weights.drain_quiet_s, timeout_s=weights.update_timeout_s
        )

    # -- claim ------------------------------------------------------------------------------------

    def wants_more(self) -> bool:
        """Backpressure (admission.hold_reason) over what this shard and the run directory say now."""
        self._follow_the_run()
        now = time.monotonic()
        stalled = self._stall.update(
            now,
            self._commits.last_step,
            len(self._admitted),
            self.emitted,
            waiting_for_trainer=self._held.reason is Hold.TRAINER,
        )
        hold = hold_reason(
            AdmissionState(
                stopping=self._stopping,
                last_committed=self._commits.last_step,
                policy_version=self.policy_version(),
                groups_out=len(self._admitted),
                groups_in_transit=len(self._in_transit),
                groups_waiting=self._dispatcher.pending_groups(),
                rollouts_ahead=self._rollouts_ahead,
                room_share=self._commits.room_share,
                stalled=stalled,
            ),
            self._limits,
        )
        if hold is None and self._mix is not None:
            self._next_mixed = self._mixed_stream()
            if self._next_mixed is None:
                hold = Hold.ENV_CAPS
        self._held.note(hold, now)
        return hold is None

    def next_stream(self) -> int | None:
        """The stream the next offset claimed draws from: mixing's choice, or None with one stream (the
        offset is the draw). Once after each `wants_more` that said yes: it is the stream that call found."""
        if self._mix is None:
            return None
        stream, self._next_mixed = self._next_mixed, None
        if stream is None:
            raise RuntimeError("next_stream without a wants_more that said yes before it")
        return stream

    def admit(self, offset: int, stream: int | None = None) -> None:
        """Dispatch the group of this shard's `offset`-th prompt, unless a committed step already holds it:
        with one stream, its `offset`-th draw; mixed, the next draw of `stream` (next_stream's choice)."""
        if stream is None:
            stream, draw = 0, offset
        else:
            draw = self._draws[stream]
        self._draws[stream] = draw + 1
        self._admit(self.schedule.position_of(stream, self.shard.draw(draw)))

    def _admit(
        self,
        position: int,
        attempts: tuple[int, ...] | None = None,
        resume: Mapping[str, list[ResumePoint]] | None = None,
    ) -> None:
        """Dispatch the group at `position` (all its attempts, or those given, continuing those `resume`
        holds tokens of)."""
        if self.schedule.offset(position) in self._commits.consumed:
            return
        if attempts is None and self._skipped_by_curriculum(position):
            return
        group = self.schedule.group(position, attempts)
        if resume and group.group_id in resume:
            group = dataclasses.replace(
                group, resume=tuple(p for p in resume[group.group_id] if set(p.attempts) <= set(group.attempts_to_run))
            )
        self._admitted[group.group_id] = position
        self._rollouts_ahead += self.schedule.group_size(position)
        self._dispatcher.add_groups([group])

    def _mixed_stream(self) -> int | None:
        """Mixing: the stream of the environment furthest behind its target share, of those with prompts
        left and room under their in-flight cap (one group always has room); None if there is none."""
        assert self._mix is not None
        caps = self._mix.caps(self._dispatcher.inflight_cap)
        # Per environment, the rollouts of its groups not returned whole (as _rollouts_ahead counts them),
        # and its groups not yet in a committed step.
        inflight: collections.Counter[str] = collections.Counter()
        for position in self._admitted.values():
            inflight[self.schedule.offset(position)[0]] += self.schedule.group_size(position)
        pending = collections.Counter(
            self.schedule.offset(position)[0] for position in itertools.chain(self._admitted.values(), self._in_transit)
        )
        candidates = []
        for stream, env in enumerate(self.schedule.stream_envs):
            assert env is not None  # a mix draws from one stream per environment
            if self._draws[stream] >= self._stream_draws[stream]:
                continue
            if caps is None or inflight[env] == 0 or inflight[env] + self._mix.targets[env].group_size <= caps[env]:
                candidates.append(env)
        env = self._mix.choose(candidates, pending)
        return None if env is None else self.schedule.stream_envs.index(env)

    def _skipped_by_curriculum(self, position: int) -> bool:
        """Whether the curriculum keeps this group back; each one kept back is a metrics record. A group
        restored from a checkpoint (attempts given) is never kept back: some of it may be on its way."""
        if self._curriculum is None:
            return False
        env, epoch, index = self.schedule.offset(position)
        reason = self._curriculum.skip_reason(env, epoch, index)
        if reason is None:
            return False
        history = self._curriculum.prompts[(env, index)]
        self._curriculum_skipped += 1
        self._run_dir.append_metrics(
            {
                "curriculum_skip": {
                    "t": time.time(),
                    "shard": self.shard.index,
                    "env": env,
                    "epoch": epoch,
                    "index": index,
                    "reason": reason,
                    "outcome_epoch": history.epoch,
                    "pass_rates": history.pass_rates,
                    "after_step": self._commits.last_step,
                }
            }
        )
        return True

    # -- work -------------------------------------------------------------------------------------

    def poll(self, max_wait_s: float) -> list[Rollout]:
        """Rollouts finished since the last call, each once (waits at most `max_wait_s` for one)."""
        rollouts = self._dispatcher.poll(max_wait_s)
        for rollout in rollouts:
            rollout.dispatch_worker = self._worker
            self._note_outcome(rollout)
        for group_id in {r.group_id for r in rollouts}:
            if self._dispatcher.is_unreturned(group_id):
                continue
            if group_id in self._admitted:
                self._in_transit.add(self._admitted.pop(group_id))
                self.emitted += 1
                self._progress.group_returned(all_errored=group_id not in self._not_all_errored)
                self._not_all_errored.discard(group_id)
            self._evaluating.discard(group_id)
        now = time.monotonic()
        if self._status.due(now) or self._progress.too_many_errored_groups:  # the stop, at once
            self._publish_status(now)
        return rollouts

    def _note_outcome(self, rollout: Rollout) -> None:
        """Errors by cause (shown live), and what the progress watch counts of training rollouts."""
        if rollout.status is RolloutStatus.ERROR:
            self._errors.note(rollout, time.time())
        if rollout.is_eval:
            return
        self._progress.rollout_finished(rollout)
        if rollout.status is not RolloutStatus.ERROR:
            self._not_all_errored.add(rollout.group_id)

    def in_flight(self, with_tokens: bool = False) -> InFlight:
        """What a checkpoint taken now must carry: the attempts admitted whose rollouts `poll` has not
        returned yet (by schedule position: run again on restore), the groups emitted whole, and the token
        the next call must bring. `with_tokens` takes the tokens of those generating now (else the last
        taken are kept, for the attempts still to redo). Evaluation rounds are not restored."""
        if with_tokens and self._checkpoint_tokens:
            # Before `unreturned`: a rollout that finishes in between is redone from its tokens, not lost.
            self._resume_points = tuple(self._dispatcher.resume_points())
        unreturned = self._dispatcher.unreturned()
        redo = tuple(
            sorted(
                (position, unreturned[group_id])
                for group_id, position in self._admitted.items()
                if group_id in unreturned
            )
        )
        resume = tuple(
            p
            for p in self._resume_points
            if p.group_id in unreturned and set(p.attempts) <= set(unreturned[p.group_id])
        )
        return InFlight(redo, self.emitted, self.token, resume)

    def finished(self, all_claimed: bool) -> bool:
        # An evaluation round that started before the stop is finished too: its summary is the last one.
        return input_finished(all_claimed, self._stopping, len(self._admitted) + len(self._evaluating))

    def counters(self) -> dict[str, int]:
        return self._dispatcher.counters()

    def close(self) -> None:
        self._dispatcher.close()

    @property
    def closed(self) -> bool:
        return self._dispatcher.closed

    # -- the run around it ------------------------------------------------------------------------

    def _follow_the_run(self) -> None:
        """New commits, new weights, stop, and evaluation rounds due."""
        for consumed in self._commits.refresh():
            trained = self._in_transit & self.schedule.positions_of(consumed)
            self._in_transit -= trained
            self._rollouts_ahead -= sum(map(self.schedule.group_size, trained))
        if self._curriculum is not None:
            self._curriculum.follow(self._run_dir, self._commits.last_step)
        if self._mix is not None:
            self._mix.follow(self._run_dir, self._commits.last_step)
        if not self._stopping and self._commits.last_step >= self.spec.config.run.max_steps:
            self._stopping = True
            cancelled = self._dispatcher.cancel_groups(list(self._admitted))
            _LOG.info(
                "step %d committed: run complete, shard %d cancelled %d in-flight groups",
                self._commits.last_step,
                self.shard.index,
                len(cancelled),
            )
        if self._stopping:
            return
        if self._fleet_changes is not None and (servers := self._fleet_changes(time.time())) is not None:
            self._dispatcher.set_servers(servers)
            self._servers_down.urls = servers
        update = self._weights.poll()
        if update is not None:
            # The earliest step that could still train a rollout is version + 1, where its staleness is
            # version - its oldest token's; past max_off_policy_steps it could only ever be filtered out.
            regenerated, stale = self._dispatcher.handle_stale(
                update.version - self.spec.config.off_policy.max_off_policy_steps
            )
            self._run_dir.append_metrics(
                {
                    "weight_update": {
                        "t": time.time(),
                        "shard": self.shard.index,
                        **update.as_dict(),
                        "regenerated_rollouts": regenerated,
                        "cancelled_stale_rollouts": stale,
                    }
                }
            )
        rounds = self._evals.due(self._commits.last_step)
        if rounds:
            self._dispatcher.add_groups(rounds)
            self._evaluating.update(g.group_id for g in rounds)
            _LOG.info(
                "evaluation round after step %d: shard %d sends %d held-out prompts",
                rounds[0].eval_round,
                self.shard.index,
                len(rounds),
            )

    def _publish_status(self, now: float) -> None:
        counters, servers = self._dispatcher.counters_and_servers()
        try:
            self._servers_down.check(counters.get("healthy_servers", 1), counters.get("ok", 0) > 0, now)
        except AllServersDownError as err:
            record_failure(self._run_dir.path, "dispatch", err)
            raise
        self._held.note(self._held.reason, now)
        self._status.publish(
            {
                "policy_version": self.policy_version(),
                "waiting_for_trainer": self._held.reason is not None and self._held.reason.value == "trainer",
                "held_back_s": {reason: round(s, 3) for reason, s in self._held.total_s.items()},
                "groups_out": len(self._admitted),
                "groups_in_transit": len(self._in_transit),
                "groups_emitted": self.emitted,
                "weight_reloads": [
                    {"version": u.version, "seconds": round(u.seconds, 3)} for u in self._weights.updates
                ],
                # What the last update cost each server (every update's: metrics.jsonl "weight_update" records).
                "last_weight_update": self._weights.updates[-1].as_dict() if self._weights.updates else None,
                "all_servers_down_for_s": (
                    round(now - self._servers_down.down_since, 1) if self._servers_down.down_since is not None else None
                ),
                "max_inflight": self._max_inflight,
                "curriculum_skipped": self._curriculum_skipped,
                "mix": self._mix.summary(self._dispatcher.inflight_cap) if self._mix is not None else None,
                "servers": servers,
                "errors": self._errors.as_status(),
                **counters,
            },
            now,
        )
        try:  # after the status that shows why
            self._progress.check(now, self._commits.last_step, waiting_for_trainer=self._held.reason is Hold.TRAINER)
        except NothingTrainsError as err:
            record_failure(self._run_dir.path, "dispatch", err)
            raise
