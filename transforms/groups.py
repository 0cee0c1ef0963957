"""CompleteGroups: keyed by group id, releases a group once all `group_size` rollouts arrived.

Input elements are lists of rollouts of one group (the dispatcher sends a whole group at once, but
nothing here relies on that).

Errored and cancelled rollouts count toward completion (the dispatcher emits every started rollout
exactly once), so every admitted group is released; its state is cleared on release.
"""

from __future__ import annotations

from typing import Any, Tuple

import apache_beam as beam
from apache_beam.coders import PickleCoder, VarIntCoder
from apache_beam.transforms import userstate

from beam_rl.types import Rollout


class _ReleaseCompleteGroups(beam.DoFn):
    ROLLOUTS = userstate.BagStateSpec("rollouts", PickleCoder())
    ARRIVED = userstate.ReadModifyWriteStateSpec("arrived", VarIntCoder())

    def process(self, keyed: Tuple[str, list[Rollout]], rollouts=beam.DoFn.StateParam(ROLLOUTS),
                arrived=beam.DoFn.StateParam(ARRIVED)):
        group_id, part = keyed
        count = (arrived.read() or 0) + len(part)
        for rollout in part:
            rollouts.add(rollout)
        if count < part[0].group_size:
            arrived.write(count)
            return
        group = sorted(rollouts.read(), key=lambda r: r.attempt)
        rollouts.clear()
        arrived.clear()
        beam.metrics.Metrics.counter("beam_rl", "groups_completed").inc()
        yield group_id, group


class CompleteGroups(beam.PTransform):
    def expand(self, rollouts):
        return (rollouts
                | "KeyByGroup" >> beam.Map(lambda part: (part[0].group_id, part)).with_output_types(Tuple[str, Any])
                | beam.ParDo(_ReleaseCompleteGroups()))
