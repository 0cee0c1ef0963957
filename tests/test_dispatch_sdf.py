"""The dispatch splittable DoFn's end of input when the runner has split its restriction: the part
holding the end marker announces the end only after the other parts have claimed every position."""

from __future__ import annotations

import apache_beam as beam
from apache_beam.io.restriction_trackers import OffsetRange, OffsetRestrictionTracker
from apache_beam.runners.sdf_utils import RestrictionTrackerView, ThreadsafeRestrictionTracker
from apache_beam.utils.timestamp import Timestamp

import transforms.dispatch as dispatch
from beam_rl.config import config_from_dict
from beam_rl.rollout_source import EndOfInput, SourceSpec

END = 4  # positions 0..3 are groups, 4 is the end marker


class _Source:
    """Admits at once and finishes nothing: idle whenever asked."""

    def __init__(self) -> None:
        self.admitted, self.claimed = 0, 0

    def wants_more(self) -> bool:
        return True

    def admit(self, position: int) -> None:
        self.admitted += 1
        self.claimed += 1

    def poll(self, max_wait_s: float):
        return []

    def stopping(self) -> bool:
        return False

    def idle(self) -> bool:
        return True

    def claimed_all(self, end: int) -> bool:
        return self.claimed >= end

    def outstanding(self):
        return ()


class _Watermark:
    def get_estimator_state(self):
        return Timestamp.now(), None, ()

    def note(self, token, in_flight) -> None:
        pass

    def set_watermark(self, timestamp) -> None:
        pass


def _run_part(fn, start: int, stop: int):
    # What the SDK harness hands a splittable DoFn: a thread-safe view of the restriction tracker.
    tracker = ThreadsafeRestrictionTracker(OffsetRestrictionTracker(OffsetRange(start, stop)))
    outputs = list(fn.process(("run", END), tracker=RestrictionTrackerView(tracker), watermark=_Watermark()))
    ends = [o.value for o in outputs if isinstance(o, beam.pvalue.TaggedOutput)]
    return ends, tracker


def test_the_end_marker_part_waits_for_the_other_parts(monkeypatch):
    source = _Source()
    monkeypatch.setattr(dispatch, "source_for", lambda *args: source)
    monkeypatch.setattr(dispatch, "BUNDLE_S", 0.05)
    config = config_from_dict({"envs": [{"name": "reverse_text", "group_size": 2}]})
    fn = dispatch._DispatchFn(SourceSpec(config=config, server_urls=(), run_dir="/unused", run_id="run",
                                         first_step=1, with_trainer=False, schedule_groups=END))
    # The runner split [0, 5) into [0, 3) and [3, 5); the second part runs first.
    ends, tracker = _run_part(fn, 3, END + 1)
    assert ends == [] and tracker.deferred_status() is not None  # held back: it resumes later
    ends, _ = _run_part(fn, 0, 3)
    assert ends == []  # not the end marker's part
    ends, _ = _run_part(fn, END, END + 1)  # the held-back remainder resumes
    assert ends == [EndOfInput(groups=END)]
