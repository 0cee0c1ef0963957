"""The source's rules on their own, in plain Python: backpressure, the end of input, a shard's share, the
commits it follows, evaluation rounds, and a restored source running again exactly what was in flight."""

from __future__ import annotations

import time
import uuid

import pytest

from beam_rl import wiring
from beam_rl.config import EvalSection, config_from_dict
from beam_rl.rundir import RunDir
from beam_rl.source import DispatchRange, InFlight, RolloutSource, Shard, SourceSpec
from beam_rl.source.admission import AdmissionState, Hold, hold_reason, input_finished, limits_for
from beam_rl.source.commits import CommittedSteps
from beam_rl.source.eval_rounds import EvalRounds, first_eval_after
from beam_rl.source.schedule import EnvSchedule, PromptSchedule
from beam_rl.source.status import AllServersDownError, ServersDownWatch, StallWatch
from beam_rl.standin.faults import FaultConfig
from beam_rl.standin.server import EmbeddedServer
from beam_rl.standin.simulated import SimulatedParams
from beam_rl.types import TrainBatch

LIMITS = limits_for(rollouts_per_step=64, group_size=8, permits=64, max_async_level=1, with_trainer=True,
                    max_off_policy_steps=2)


def _state(**changes) -> AdmissionState:
    base = dict(stopping=False, last_committed=4, policy_version=4, groups_out=0, groups_in_transit=0,
                groups_waiting=0)
    return AdmissionState(**{**base, **changes})


def test_limits_follow_the_step_size_and_are_split_over_shards():
    assert (LIMITS.max_groups_out, LIMITS.max_groups_in_transit, LIMITS.backlog_groups) == (16, 8 + 64, 8)
    half = limits_for(64, 8, 32, 1, True, shards=2, max_off_policy_steps=2)
    assert (half.max_groups_out, half.max_groups_in_transit, half.backlog_groups) == (8, 36, 4)


@pytest.mark.parametrize(("changes", "reason"), [
    ({}, None),
    ({"stopping": True}, Hold.STOPPING),
    ({"policy_version": 2}, Hold.TRAINER),  # producing step 5 would be 2 steps past policy 2
    ({"policy_version": 3}, None),  # one step ahead: max_async_level 1 allows it
    ({"groups_out": 16}, Hold.GROUPS_OUT),
    # 64 rollouts a step: 128 ahead and a step's margin (half the bound) put a group admitted now in step 8,
    # training policy 7 = 3 past policy 4
    ({"groups_out": 8, "groups_in_transit": 8, "rollouts_ahead": 128}, Hold.OFF_POLICY),
    ({"groups_out": 8, "groups_in_transit": 7, "rollouts_ahead": 120}, None),
    ({"policy_version": 3, "groups_out": 1, "groups_in_transit": 15, "rollouts_ahead": 128}, Hold.OFF_POLICY),
    ({"groups_out": 8, "rollouts_ahead": 192, "room_share": 0.5}, None),  # filtered rollouts take no room
    ({"groups_out": 8, "rollouts_ahead": 192, "stalled": True}, None),  # a step needs more than is ahead
    ({"groups_waiting": 8}, Hold.BACKLOG),
])
def test_hold_reason_names_the_first_rule_that_holds_admission_back(changes, reason):
    assert hold_reason(_state(**changes), LIMITS) is reason


def test_a_slow_sink_holds_admission_where_the_off_policy_bound_allows_that_much_in_transit():
    loose = limits_for(64, 8, 64, 1, with_trainer=True, max_off_policy_steps=10)
    assert hold_reason(_state(groups_in_transit=72), loose) is Hold.SINK
    assert hold_reason(_state(groups_in_transit=72, room_share=0.5), loose) is None  # half take no room


def test_the_step_the_trainer_waits_for_is_always_admitted_without_the_margin():
    on_policy = limits_for(64, 8, 64, 0, with_trainer=True, max_off_policy_steps=0)
    assert hold_reason(_state(groups_out=7, rollouts_ahead=56), on_policy) is None  # step 5 still needs a group
    assert hold_reason(_state(groups_out=4, groups_in_transit=4, rollouts_ahead=64), on_policy) is Hold.OFF_POLICY
    # A trainer with a step to train will publish: the margin holds a group that could slip into step 6.
    one_step = limits_for(64, 8, 64, 1, with_trainer=True, max_off_policy_steps=1)
    assert hold_reason(_state(policy_version=3, groups_out=5, rollouts_ahead=40), one_step) is Hold.OFF_POLICY
    assert hold_reason(_state(policy_version=3, groups_out=3, rollouts_ahead=24), one_step) is None


def _train_fifo(limits, ticks: int = 400, generate_ticks: int = 3, packed_per_tick: int = 2,
                trains_every: int = 1) -> tuple[list[int], set]:
    """A pipeline slower than its servers (groups take `generate_ticks` to generate, the sink packs
    `packed_per_tick` a tick, in the order they returned; one group in `trains_every` trains, the others are
    filtered) with a trainer that publishes as each step commits. Returns every trained group's off-policy
    steps, and the reasons admission was held."""
    step_groups, committed, packed, admitted = 8, 0, 0, 0
    out, transit, staleness, held, recent, returned, watch = [], [], [], set(), [], 0, StallWatch(min_quiet_s=5)
    for tick in range(ticks):
        returned += sum(done <= tick for done, _ in out)
        transit += [g for done, g in out if done <= tick]  # returned whole, not yet in a committed step
        out = [(done, g) for done, g in out if done > tick]
        packed = min(packed + packed_per_tick, len(transit))
        trains = [i for i, (_, trained) in enumerate(transit[:packed]) if trained]
        if len(trains) >= step_groups:  # step committed + 1 trains policy `committed`
            cut = trains[step_groups - 1] + 1
            staleness += [committed - v for v, trained in transit[:cut] if trained]
            recent = [*recent[-3:], (step_groups, cut)]
            transit, packed, committed = transit[cut:], packed - cut, committed + 1
        share = sum(t for t, _ in recent) / sum(n for _, n in recent) if recent else 1.0
        stalled = watch.update(tick, committed, len(out), returned)
        while (hold := hold_reason(_state(last_committed=committed, policy_version=committed, groups_out=len(out),
                                          groups_in_transit=len(transit), rollouts_ahead=8 * (len(out) + len(transit)),
                                          room_share=share, stalled=stalled),
                                   limits)) is None:
            out.append((tick + generate_ticks, (committed, admitted % trains_every == 0)))
            admitted += 1
        held.add(hold)
    return staleness, held


def test_admission_never_queues_a_group_behind_more_work_than_the_bound_lets_it_wait_for():
    staleness, held = _train_fifo(LIMITS)
    # A step of the bound's two is the margin, for groups that slip behind later ones: none do here.
    assert len(staleness) > 500 and max(staleness) == 1 and Hold.OFF_POLICY in held
    # The same pipeline without the rule: the sink's backlog ages groups past the bound, for no more steps.
    loose, _ = _train_fifo(limits_for(64, 8, 64, 1, with_trainer=True, max_off_policy_steps=10))
    assert max(loose) > 2 and len(loose) == len(staleness)


@pytest.mark.parametrize("trains_every", [4, 8])
def test_admission_counts_only_the_groups_ahead_that_will_take_room_in_a_step(trains_every):
    # Most groups filtered: the bound's three steps of room hold 3 x 8 x trains_every groups ahead. Before the
    # first step tells how many train, admission assumes all do; at 1 in 8 no step can come of that, and the
    # stall watch lets more in.
    staleness, held = _train_fifo(LIMITS, trains_every=trains_every, packed_per_tick=8)
    assert len(staleness) > 2000 // trains_every and max(staleness) <= 2 and Hold.OFF_POLICY in held


def test_without_a_trainer_the_policy_and_the_groups_out_do_not_hold_back():
    free = limits_for(64, 8, 64, 1, with_trainer=False, max_off_policy_steps=2)
    assert hold_reason(_state(policy_version=0, groups_out=1000), free) is None


@pytest.mark.parametrize(("all_claimed", "stopping", "out", "finished"), [
    (True, False, 0, True), (True, False, 1, False), (False, False, 0, False), (False, True, 0, True),
    (False, True, 3, False),
])
def test_the_input_is_finished_when_claimed_or_stopped_and_nothing_is_out(all_claimed, stopping, out, finished):
    assert input_finished(all_claimed, stopping, out) is finished


def test_a_shard_owns_every_nth_position_server_and_its_share_of_permits():
    shards = [Shard(i, 3) for i in range(3)]
    assert [s.size(10) for s in shards] == [4, 3, 3]
    assert [[s.draw(o) for o in range(s.size(10))] for s in shards] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert [s.servers(["a", "b", "c", "d"]) for s in shards] == [["a", "d"], ["b"], ["c"]]
    assert [s.permits(64) for s in shards] == [22, 21, 21]
    with pytest.raises(ValueError, match="does not exist"):
        Shard(3, 3)


def test_committed_steps_are_read_once_each_as_they_commit(tmp_path):
    run_dir = RunDir(tmp_path)

    def commit(step: int, offsets, window=None):
        run_dir.write_step(TrainBatch(step=step, micro_batches=[], group_ids=[], window=window or {}), offsets=offsets)

    commit(1, [("e", 0, 1)])
    now = [0.0]
    commits = CommittedSteps(run_dir, poll_s=1.0, clock=lambda: now[0])
    assert commits.last_step == 1 and commits.consumed == {("e", 0, 1)} and commits.room_share == 1.0
    commit(2, [("e", 0, 2)], {"rollouts": 8, "trained_rollouts": 8})
    commit(3, [("e", 0, 3), ("e", 0, 4)], {"rollouts": 16, "trained_rollouts": 2, "filtered": {"stale": 2, "x": 12}})
    assert commits.refresh() == []  # within poll_s of the last look
    now[0] = 2.0
    assert commits.refresh() == [{("e", 0, 2)}, {("e", 0, 3), ("e", 0, 4)}] and commits.last_step == 3
    assert commits.room_share == (8 + 2 + 2) / (8 + 16)  # stale rollouts, fresh, would have taken room


def test_the_stall_watch_lets_admission_past_its_limits_only_while_nothing_moves():
    watch = StallWatch(min_quiet_s=10, quiet_steps=3)
    assert not watch.update(0, last_committed=0, groups_out=0, groups_returned=0)
    assert not watch.update(9, 0, 0, 0) and watch.update(11, 0, 0, 0)  # 10 s with nothing out, no step
    assert watch.update(12, 0, 0, 5) and not watch.update(13, 1, 0, 5)  # until a step commits
    assert not watch.update(20, 2, 0, 5)  # steps 7 s apart: 21 s of quiet now count
    assert not watch.update(40, 2, 0, 5) and not watch.update(45, 2, 1, 5)  # a group out: something moves
    assert watch.update(45, 2, 0, 5)


def test_evaluation_rounds_come_every_k_steps_as_this_shards_part_of_the_split():
    assert [first_eval_after(s, 5) for s in (0, 4, 5, 12)] == [5, 5, 10, 15] and first_eval_after(3, 0) is None
    schedule = PromptSchedule([EnvSchedule("e", [{"q": i} for i in range(5)], 4, 1)])
    rounds = EvalRounds(EvalSection(every_steps=5, samples_per_prompt=4), schedule, Shard(1, 2), last_committed=3)
    assert rounds.due(4) == []
    due = rounds.due(5)
    assert [g.index for g in due] == [1, 3] and all(g.is_eval and g.eval_round == 5 for g in due)
    assert {g.group_id.split("/", 1)[0] for g in due} == {"eval@5"} and {g.group_size for g in due} == {4}
    assert rounds.due(6) == [] and [g.eval_round for g in rounds.due(12)] == [10, 10]  # a missed round is not run twice


def _source(tmp_path, url: str, restored: DispatchRange, max_tokens: int = 4) -> RolloutSource:
    config = config_from_dict({
        "run": {"dir": str(tmp_path)}, "envs": [{"name": "reverse_text", "group_size": 4, "limit": 6}],
        "batch": {"rollouts_per_step": 8}, "inference": {"max_tokens": max_tokens, "max_inflight": 8},
    })
    spec = SourceSpec(config=config, server_urls=(url,), run_dir=str(tmp_path), run_id=uuid.uuid4().hex,
                      with_trainer=False, schedule_groups=6)
    return wiring.dispatch_parts(spec).source(Shard(), restored)


def _drain(source: RolloutSource, expected: int) -> list:
    out, deadline = [], time.monotonic() + 30
    while len(out) < expected and time.monotonic() < deadline:
        out += source.poll(0.05)
    return out


def test_a_restored_source_runs_again_exactly_the_attempts_in_flight_and_counts_what_left(tmp_path):
    with EmbeddedServer(mode="instant") as server:
        # Saved when offsets 0..2 were claimed, 4 groups had left whole, and offset 1's attempts 2 and 3
        # had not left yet: only those run again.
        restored = DispatchRange(3, 7, InFlight(redo=((1, (2, 3)),), emitted=4, token="t0"))
        source = _source(tmp_path, server.url, restored)
        try:
            assert source.token == "t0" and source.emitted == 4
            rollouts = _drain(source, 2)
            assert sorted((r.index, r.attempt) for r in rollouts) == [(1, 2), (1, 3)]
            assert source.emitted == 5 and source.in_flight() == InFlight((), 5, "t0")
            assert source.finished(all_claimed=True) and not source.finished(all_claimed=False)
            # A committed step holds offset 4's prompt: admitting it does nothing.
            RunDir(tmp_path).write_step(TrainBatch(step=1, micro_batches=[], group_ids=[], window={}),
                                        offsets=[("reverse_text", 0, 4)])
            source._commits.refresh(force=True)
            source.admit(4)
            assert source.poll(0.3) == [] and source.finished(all_claimed=True)
        finally:
            source.close()


def test_servers_never_up_get_the_start_up_patience_and_a_probe_alone_does_not_restart_it():
    """Until a server answers a request, all of them down is an error after inference.startup_timeout_s,
    counted from the first time all were down, however often a health probe passes in between (a server
    that answers every request with HTTP 500); after one has answered, the longer limit applies."""
    watch = ServersDownWatch(["http://a"], limit_s=300.0, startup_limit_s=5.0)
    watch.check(healthy=0, answered=False, now=100.0)
    watch.check(healthy=1, answered=False, now=102.0)  # its /health passes; its requests still fail
    watch.check(healthy=0, answered=False, now=104.0)
    with pytest.raises(AllServersDownError, match=r"none of all 1 inference servers \(http://a\) has answered a "
                                                  r"request since the run started: .* past inference.startup_timeout_s = 5"):
        watch.check(healthy=0, answered=False, now=106.0)
    up_once = ServersDownWatch(["http://a"], limit_s=300.0, startup_limit_s=5.0)
    up_once.check(healthy=0, answered=True, now=100.0)
    up_once.check(healthy=0, answered=True, now=399.0)
    up_once.check(healthy=1, answered=True, now=399.5)  # back: the clock restarts
    up_once.check(healthy=0, answered=True, now=600.0)
    with pytest.raises(AllServersDownError, match="past inference.all_servers_down_timeout_s = 300"):
        up_once.check(healthy=0, answered=True, now=901.0)


def test_a_restored_source_continues_the_rollouts_it_had_in_flight_from_their_tokens(tmp_path):
    long = SimulatedParams(length_median=400, length_sigma=0.1)  # every completion runs to max_tokens
    with EmbeddedServer(mode="simulated", simulated=long, faults=FaultConfig(step_delay_s=0.02)) as server:
        source = _source(tmp_path, server.url, DispatchRange(0, 7), max_tokens=40)
        try:
            source.admit(0)
            deadline = time.monotonic() + 30
            # reverse_text runs a group as one request of n=4: one launch, its four choices' tokens.
            while not (saved := source.in_flight(with_tokens=True)).resume or min(
                    saved.resume[0].tokens_per_choice()) < 3:
                assert time.monotonic() < deadline, "no tokens streamed"
                time.sleep(0.02)
            assert [p.attempts for p in saved.resume] == [(0, 1, 2, 3)]
            assert saved.redo == ((0, (0, 1, 2, 3)),)
            assert source.in_flight().resume == saved.resume  # between two takes, the last one is carried
        finally:
            source.close()
        asked_before = len(server.requests_seen)
        restored = _source(tmp_path, server.url, DispatchRange(1, 7, saved), max_tokens=40)
        try:
            rollouts = _drain(restored, 4)
        finally:
            restored.close()
    kept = dict(enumerate(saved.resume[0].tokens_per_choice()))
    assert sorted(r.attempt for r in rollouts) == [0, 1, 2, 3] and all(r.completion_tokens == 40 for r in rollouts)
    asked = list(server.requests_seen)[asked_before:]
    assert sorted(a.max_tokens for a in asked) == sorted(40 - n for n in kept.values())
    (record,) = [m["dispatch_restore"] for m in RunDir(tmp_path).read_metrics() if "dispatch_restore" in m]
    assert record["rollouts_resumed"] == 4 and record["tokens_resumed"] == sum(kept.values())
    assert 0 < record["resume_bytes"] <= 12 * sum(kept.values())
