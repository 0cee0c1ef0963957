"""CompleteGroups: releases each group once all `group_size` rollouts arrived.

Input elements are lists of rollouts of one group. The dispatcher sends a whole group at once, and
whole groups go straight through (no shuffle, no state: on Prism the stage then fuses with Dispatch
and Score). Partial lists, should a source ever send them, are keyed by group id and collected in
state until the group is complete.

Errored and cancelled rollouts count toward completion (the dispatcher emits every started rollout
exactly once), so every admitted group is released; its state is cleared on release.
"""

from __future__ import annotations

from typing import List, Tuple

import apache_beam as beam
from apache_beam.coders import PickleCoder, VarIntCoder
from apache_beam.transforms import userstate

from beam_rl.types import Rollout
from transforms import coders  # noqa: F401  (registers the coder of Rollout)

_PARTS = "parts"


def _released(group_id: str, rollouts: list[Rollout]) -> tuple[str, list[Rollout]]:
    beam.metrics.Metrics.counter("beam_rl", "groups_completed").inc()
    return group_id, sorted(rollouts, key=lambda r: r.attempt)


class _WholeOrPart(beam.DoFn):
    def process(self, part: list[Rollout]):
        if len(part) == part[0].group_size:
            yield _released(part[0].group_id, part)
        else:
            yield beam.pvalue.TaggedOutput(_PARTS, part)


class _CollectParts(beam.DoFn):
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
        group = list(rollouts.read())
        rollouts.clear()
        arrived.clear()
        yield _released(group_id, group)


class CompleteGroups(beam.PTransform):
    """(group id, the group's rollouts ordered by attempt), once per group."""

    def expand(self, rollouts):
        split = (rollouts | "WholeOrPart" >> beam.ParDo(_WholeOrPart()).with_output_types(Tuple[str, List[Rollout]])
                 .with_outputs(_PARTS, main="whole"))
        completed = (split[_PARTS]
                     | "KeyByGroup" >> beam.Map(lambda part: (part[0].group_id, part))
                     .with_output_types(Tuple[str, List[Rollout]])
                     | "CollectParts" >> beam.ParDo(_CollectParts()).with_output_types(Tuple[str, List[Rollout]]))
        return (split.whole, completed) | "Released" >> beam.Flatten()
