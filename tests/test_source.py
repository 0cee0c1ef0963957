"""The source's rules on their own, in plain Python: backpressure, the end of input, a shard's share, the
commits it follows, evaluation rounds, and a restored source running again exactly what was in flight."""

from __future__ import annotations

import time
import uuid

import pytest

from beam_rl.config import EvalSection, config_from_dict
from beam_rl.inference.server import EmbeddedServer
from beam_rl.rundir import RunDir
from beam_rl.schedule import EnvSchedule, PromptSchedule
from beam_rl.source import DispatchRange, InFlight, RolloutSource, Shard, SourceSpec
from beam_rl.source.admission import AdmissionState, Hold, hold_reason, input_finished, limits_for
from beam_rl.source.commits import CommittedSteps
from beam_rl.source.eval_rounds import EvalRounds, first_eval_after
from beam_rl.types import TrainBatch

LIMITS = limits_for(rollouts_per_step=64, group_size=8, permits=64, max_async_level=1, with_trainer=True)


def _state(**changes) -> AdmissionState:
    base = dict(stopping=False, last_committed=4, policy_version=4, groups_out=0, groups_in_transit=0,
                groups_waiting=0)
    return AdmissionState(**{**base, **changes})


def test_limits_follow_the_step_size_and_are_split_over_shards():
    assert (LIMITS.max_groups_out, LIMITS.max_groups_in_transit, LIMITS.backlog_groups) == (16, 8 + 64, 8)
    half = limits_for(64, 8, 32, 1, True, shards=2)
    assert (half.max_groups_out, half.max_groups_in_transit, half.backlog_groups) == (8, 36, 4)


@pytest.mark.parametrize(("changes", "reason"), [
    ({}, None),
    ({"stopping": True}, Hold.STOPPING),
    ({"policy_version": 2}, Hold.TRAINER),  # producing step 5 would be 2 steps past policy 2
    ({"policy_version": 3}, None),  # one step ahead: max_async_level 1 allows it
    ({"groups_out": 16}, Hold.GROUPS_OUT),
    ({"groups_in_transit": 72}, Hold.SINK),
    ({"groups_waiting": 8}, Hold.BACKLOG),
])
def test_hold_reason_names_the_first_rule_that_holds_admission_back(changes, reason):
    assert hold_reason(_state(**changes), LIMITS) is reason


def test_without_a_trainer_the_policy_and_the_groups_out_do_not_hold_back():
    free = limits_for(64, 8, 64, 1, with_trainer=False)
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
    assert [[s.position(o) for o in range(s.size(10))] for s in shards] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert [s.offset(7) for s in shards] == [None, 2, None]
    assert [s.servers(["a", "b", "c", "d"]) for s in shards] == [["a", "d"], ["b"], ["c"]]
    assert [s.permits(64) for s in shards] == [22, 21, 21]
    with pytest.raises(ValueError, match="does not exist"):
        Shard(3, 3)


def test_committed_steps_are_read_once_each_as_they_commit(tmp_path):
    run_dir = RunDir(tmp_path)

    def commit(step: int, offsets):
        run_dir.write_step(TrainBatch(step=step, micro_batches=[], group_ids=[], window={}), offsets=offsets)

    commit(1, [("e", 0, 1)])
    now = [0.0]
    commits = CommittedSteps(run_dir, poll_s=1.0, clock=lambda: now[0])
    assert commits.last_step == 1 and commits.consumed == {("e", 0, 1)}
    commit(2, [("e", 0, 2)])
    commit(3, [("e", 0, 3)])
    assert commits.refresh() == []  # within poll_s of the last look
    now[0] = 2.0
    assert commits.refresh() == [{("e", 0, 2)}, {("e", 0, 3)}] and commits.last_step == 3


def test_evaluation_rounds_come_every_k_steps_as_this_shards_part_of_the_split():
    assert [first_eval_after(s, 5) for s in (0, 4, 5, 12)] == [5, 5, 10, 15] and first_eval_after(3, 0) is None
    schedule = PromptSchedule([EnvSchedule("e", [{"q": i} for i in range(5)], 4, 1)])
    rounds = EvalRounds(EvalSection(every_steps=5, samples_per_prompt=4), schedule, Shard(1, 2), last_committed=3)
    assert rounds.due(4) == []
    due = rounds.due(5)
    assert [g.index for g in due] == [1, 3] and all(g.is_eval and g.eval_round == 5 for g in due)
    assert {g.group_id.split("/", 1)[0] for g in due} == {"eval@5"} and {g.group_size for g in due} == {4}
    assert rounds.due(6) == [] and [g.eval_round for g in rounds.due(12)] == [10, 10]  # a missed round is not run twice


def _source(tmp_path, url: str, restored: DispatchRange) -> RolloutSource:
    config = config_from_dict({
        "run": {"dir": str(tmp_path)}, "envs": [{"name": "reverse_text", "group_size": 4, "limit": 6}],
        "batch": {"rollouts_per_step": 8}, "inference": {"max_tokens": 4, "max_inflight": 8},
    })
    spec = SourceSpec(config=config, server_urls=(url,), run_dir=str(tmp_path), run_id=uuid.uuid4().hex,
                      with_trainer=False, schedule_groups=6)
    return RolloutSource(spec, Shard(), restored)


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
