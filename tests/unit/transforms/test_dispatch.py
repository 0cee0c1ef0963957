"""The dispatch splittable DoFn on its own: its restriction tracker, and process() driving a stand-in
source as the SDK harness would (claim, work, yield, defer; a checkpoint's residual carries what was in
flight; a replayed older residual rebuilds the worker's source)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
from apache_beam.runners.sdf_utils import RestrictionTrackerView, ThreadsafeRestrictionTracker
from apache_beam.utils.timestamp import Timestamp

import transforms.dispatch as dispatch
from beam_rl import wiring
from beam_rl.config import config_from_dict
from beam_rl.source import DispatchRange, EndOfInput, InFlight, SourceSpec
from beam_rl.types import Rollout

OFFSETS = 4  # offsets 0..3 are groups, 4 is the end marker


def test_the_tracker_claims_in_order_and_splits_only_to_checkpoint():
    tracker = dispatch._RangeTracker(DispatchRange(0, OFFSETS + 1))
    assert tracker.try_claim(0) and tracker.try_claim(2) and not tracker.try_claim(1)  # 1 was skipped
    assert tracker.try_split(0.5) is None  # a shard is one reader: no dynamic split
    tracker.current_restriction().in_flight = InFlight(redo=((2, (0, 1)),), emitted=1, token="t")
    primary, residual = tracker.try_split(0)
    assert (primary.start, primary.stop, primary.in_flight) == (0, 3, InFlight())
    assert (residual.start, residual.stop) == (3, OFFSETS + 1)
    assert residual.in_flight == InFlight(redo=((2, (0, 1)),), emitted=1, token="t") and residual.size() == 3
    tracker.check_done()  # the primary [0, 3) is all claimed

    last = dispatch._RangeTracker(DispatchRange(OFFSETS, OFFSETS + 1))
    with pytest.raises(ValueError, match="left unclaimed"):
        last.check_done()
    assert last.try_claim(OFFSETS) and last.try_split(0) is None  # nothing left to resume


class _Source:
    """Admits while allowed, returns each admitted group's single rollout at the next poll."""

    built: list[DispatchRange] = []

    def __init__(self, spec, shard, restriction: DispatchRange, parts) -> None:
        _Source.built.append(restriction)
        self.token = restriction.in_flight.token
        self.emitted = restriction.in_flight.emitted
        self.allow, self.admitted, self.out, self.closed = 2, [], [], False
        self.took_tokens = False

    def wants_more(self) -> bool:
        return len(self.admitted) < self.allow

    def next_stream(self) -> None:
        return None  # one stream: the offset is the draw

    def admit(self, offset: int, stream: None = None) -> None:
        self.admitted.append(offset)
        self.out.append(Rollout(f"g{offset}", "reverse_text", 0, 1))

    def poll(self, max_wait_s: float) -> list[Rollout]:
        out, self.out = self.out, []
        self.emitted += len(out)
        return out

    def in_flight(self, with_tokens: bool = False) -> InFlight:
        self.took_tokens = self.took_tokens or with_tokens
        return InFlight(tuple((int(r.group_id[1:]), (0,)) for r in self.out), self.emitted, self.token)

    def finished(self, all_claimed: bool) -> bool:
        return all_claimed and not self.out

    def close(self) -> None:
        self.closed = True


def _call(fn, restriction: DispatchRange):
    """One process() call as the SDK harness makes it: a thread-safe view of the tracker, then the
    checkpoint split when the call deferred its remainder."""
    restriction = copy.deepcopy(restriction)  # decoded afresh from the runner's copy
    tracker = ThreadsafeRestrictionTracker(dispatch._RangeTracker(restriction))
    outputs = list(fn.process(("run", (0, OFFSETS)), tracker=RestrictionTrackerView(tracker),
                              watermark=_Watermark()))
    residual = None
    if tracker.deferred_status() is not None:  # the runner keeps an encoded copy
        residual = copy.deepcopy(tracker.deferred_status()[0])
    # A shard's end of input leaves on the rollouts' output, keyed by its shard.
    values = [o.value for o in outputs]
    rollouts = [r for _, part in values if not isinstance(part, EndOfInput) for r in part]
    ends = [(key, part) for key, part in values if isinstance(part, EndOfInput)]
    return rollouts, ends, residual


class _Watermark:
    def set_watermark(self, timestamp: Timestamp) -> None:
        pass


@pytest.fixture
def fn(monkeypatch):
    monkeypatch.setattr(wiring.DispatchParts, "source",
                        lambda parts, shard, restored: _Source(parts.spec, shard, restored, parts))
    monkeypatch.setattr(dispatch, "BUNDLE_S", 0.05)
    monkeypatch.setattr(dispatch, "IDLE_BUNDLE_S", 0.05)
    _Source.built = []
    config = config_from_dict({"envs": [{"name": "reverse_text", "group_size": 1}]})
    dofn = dispatch._DispatchFn(SourceSpec(config=config, server_urls=(), run_dir="/unused", run_id="run",
                                           with_trainer=False, schedule_groups=OFFSETS))
    dofn.setup()
    return dofn


def test_process_claims_while_the_source_admits_yields_keyed_rollouts_and_defers(fn):
    rollouts, ends, residual = _call(fn, DispatchRange(0, OFFSETS + 1))
    assert [r.group_id for r in rollouts] == ["g0", "g1"] and ends == []
    assert (residual.start, residual.in_flight.emitted) == (2, 2)
    assert residual.in_flight.token is not None  # the successor call must bring it
    source = fn._sources._by_shard[0]
    assert source.took_tokens  # a deferring call takes the generating rollouts' tokens for its residual
    source.allow = 4
    rollouts, ends, residual = _call(fn, residual)
    assert [r.group_id for r in rollouts] == ["g2", "g3"]
    assert ends == [("end_of_input/0", EndOfInput(shard=0, groups=4))] and residual is None and source.closed
    assert len(_Source.built) == 1  # one source served both calls


def test_a_call_ends_soon_after_its_first_output_and_runs_longer_with_nothing_to_give(fn, monkeypatch):
    """A call's output reaches the next stage only as the call ends, so it ends BUNDLE_S after its first
    output; a call with nothing to give runs IDLE_BUNDLE_S (each call costs the runner alike)."""
    clock = [0.0]
    monkeypatch.setattr(dispatch, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(dispatch, "BUNDLE_S", 0.2)
    monkeypatch.setattr(dispatch, "IDLE_BUNDLE_S", 1.0)
    poll = _Source.poll

    def waiting_poll(self, max_wait_s):  # nothing finished: the wait runs out
        out = poll(self, max_wait_s)
        clock[0] += 0 if out else max_wait_s
        return out

    monkeypatch.setattr(_Source, "poll", waiting_poll)
    rollouts, _, residual = _call(fn, DispatchRange(0, OFFSETS + 1))
    assert len(rollouts) == 2 and clock[0] == pytest.approx(dispatch.BUNDLE_S, abs=dispatch.POLL_S)
    clock[0] = 0.0
    rollouts, _, residual = _call(fn, residual)  # the source admits no more: nothing to give
    assert rollouts == [] and residual is not None
    assert clock[0] == pytest.approx(dispatch.IDLE_BUNDLE_S, abs=dispatch.POLL_S)


def test_a_replayed_older_residual_rebuilds_the_source_from_it(fn):
    _, _, first = _call(fn, DispatchRange(0, OFFSETS + 1))
    _, _, _ = _call(fn, first)  # normal progress: the source moves on past `first`
    old = fn._sources._by_shard[0]
    _call(fn, first)  # the runner restored the older checkpoint
    assert old.closed and len(_Source.built) == 2 and _Source.built[-1].start == first.start


def test_on_flink_groups_are_dealt_round_robin_over_the_subtasks_by_position():
    from apache_beam.coders import StrUtf8Coder

    from beam_rl.source.schedule import EnvSchedule, PromptSchedule
    from transforms.flink_keys import operator_index

    class _Schedule:  # what _GroupKeys asks of a source
        schedule = PromptSchedule([EnvSchedule("e", [{}] * 96, 8, 1)])

    keys = dispatch._GroupKeys("flink", parallelism=2)
    rollouts = [Rollout(f"e/e0-i{i}", "e", 0, 8, index=i) for i in range(96)]
    subtasks = [operator_index(StrUtf8Coder().encode_nested(keys.key(r, _Schedule)), 2) for r in rollouts]
    assert subtasks == [i % 2 for i in range(96)]  # an even split, where hashing group ids is not
    assert keys.key(rollouts[5], _Schedule) == keys.key(Rollout("e/e0-i5", "e", 3, 8, index=5), _Schedule)
    assert dispatch._GroupKeys("direct", parallelism=2).key(rollouts[5], _Schedule) == "e/e0-i5"
