"""DispatchRollouts: PromptSource + Dispatch as one splittable DoFn, an unbounded source of rollouts.

Like an IO connector's reader, the DoFn claims prompt offsets from its restriction as the dispatcher
has room, emits finished rollouts as they finish, and checkpoints itself every fraction of a second
so they leave in small bundles. The dispatcher's event loop lives across bundles (RolloutSource).
Position len(schedule) is the end marker: it is claimed, and EndOfInput sent, only once every
admitted group has come back, so the restriction is never done while rollouts are in flight.
"""

from __future__ import annotations

import time
import uuid
from typing import List, Tuple

import apache_beam as beam
from apache_beam.io.watermark_estimators import ManualWatermarkEstimator
from apache_beam.transforms.core import WatermarkEstimatorProvider
from apache_beam.utils.timestamp import Duration, Timestamp

from beam_rl.rollout_source import EndOfInput, Restored, SourceSpec, source_for
from beam_rl.types import Rollout
from transforms import coders  # noqa: F401  (registers the coder of List[Rollout])
from transforms.sdf import OffsetRestrictions

END_OF_INPUT = "end_of_input"
BUNDLE_S = 0.2  # how long one process() call collects rollouts before it checkpoints
POLL_S = 0.02


def _restriction_size(element: tuple[str, int]) -> int:
    _, groups = element
    return groups + 1  # every group of the schedule + the end marker


class _SourceWatermark(ManualWatermarkEstimator):
    """A manual watermark whose state, saved with every residual (and so in every Flink
    checkpoint), also carries what the restriction alone cannot: the positions claimed but still in
    flight (a restore must dispatch them again), and a token naming the process() call that saved it
    (a replayed, older residual carries a token the in-process source no longer expects)."""

    def __init__(self, state) -> None:
        watermark, self.token, self.in_flight = state
        super().__init__(watermark)

    def get_estimator_state(self):
        return self.current_watermark(), self.token, self.in_flight

    def note(self, token: str, in_flight: tuple[int, ...]) -> None:
        self.token, self.in_flight = token, in_flight


class _SourceWatermarks(WatermarkEstimatorProvider):
    def initial_estimator_state(self, element, restriction):
        return Timestamp.now(), None, ()

    def create_watermark_estimator(self, estimator_state):
        return _SourceWatermark(estimator_state)


class _DispatchFn(beam.DoFn):
    """The element is (run id, groups in the schedule): plain values with a deterministic coder, which
    Flink needs to key the source's residuals; the spec itself travels with the DoFn."""

    def __init__(self, spec: SourceSpec) -> None:
        self._spec = spec
        # Flink restores checkpoints; Prism never replays a restriction (a failed Prism job is over),
        # and may run split parts of it at once, which a token per call cannot tell from a replay.
        self._restorable = spec.config.runner.name != "direct"

    @beam.DoFn.unbounded_per_element()
    def process(
        self,
        element: tuple[str, int],
        tracker=beam.DoFn.RestrictionParam(OffsetRestrictions(_restriction_size)),
        watermark=beam.DoFn.WatermarkEstimatorParam(_SourceWatermarks()),
    ):
        end_marker = element[1]
        restriction = tracker.current_restriction()
        _, token, in_flight = watermark.get_estimator_state()
        if self._restorable:
            source = source_for(self._spec, token, Restored(restriction.start, tuple(in_flight)))
            # What this call saves is only valid for this call's successor: a later replay of the
            # restriction this call got (a restore) is then told apart from normal progress.
            token = source.token = uuid.uuid4().hex
        else:
            source = source_for(self._spec)
        watermark.note(token, source.outstanding())
        position, stop = restriction.start, min(restriction.stop, end_marker)
        deadline = time.monotonic() + BUNDLE_S
        while True:
            while position < stop and source.wants_more():
                if not tracker.try_claim(position):
                    return
                source.admit(position)
                watermark.note(token, source.outstanding())
                position += 1
            now = Timestamp.now()
            for group in source.poll(POLL_S):
                yield beam.window.TimestampedValue(group, now)
            watermark.note(token, source.outstanding())
            watermark.set_watermark(now)
            exhausted = position >= stop or source.stopping()
            # The part holding the end marker ends last: after every other part has claimed all
            # its positions (the runner may have split the restriction), or on a stop.
            final = restriction.stop - 1
            ends_input = final == end_marker
            if exhausted and source.idle() and (not ends_input or source.stopping() or source.claimed_all(end_marker)):
                # Claiming the last position finishes this part (skipping what a stop left
                # unclaimed); only the part holding the end marker announces the end.
                if position <= final and tracker.try_claim(final) and ends_input:
                    yield beam.pvalue.TaggedOutput(END_OF_INPUT, EndOfInput(source.admitted))
                return
            if time.monotonic() >= deadline:
                tracker.defer_remainder(Duration.of(0))
                return


class DispatchRollouts(beam.PTransform):
    """Every group of the run as its last rollout finishes (a list of its rollouts, errored and
    cancelled ones included); plus one EndOfInput."""

    def __init__(self, spec: SourceSpec) -> None:
        super().__init__()
        self._spec = spec

    def expand(self, pbegin):
        spec = self._spec
        element = (spec.run_id, spec.schedule_groups)
        return (pbegin
                | beam.Impulse()
                | "RunAndSize" >> beam.Map(lambda _: element).with_output_types(Tuple[str, int])
                | beam.ParDo(_DispatchFn(spec)).with_output_types(List[Rollout])
                .with_outputs(END_OF_INPUT, main="rollouts"))
