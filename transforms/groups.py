"""CompleteGroups: collects each group's rollouts in keyed state and releases the group once all
`group_size` have arrived (the article's `add`, and the only place group completion is counted).

Errored and cancelled rollouts count toward completion (the dispatcher emits every started rollout
exactly once), so every admitted group is released; its state is cleared on release. Keyed by group id,
the stage spreads groups, and the scoring fused after it, over the runner's workers. A shard's EndOfInput
passes through untouched, on its way to the packer.
"""

from __future__ import annotations

import apache_beam as beam
from apache_beam.transforms import userstate

from beam_rl.source import EndOfInput
from beam_rl.types import Rollout
from transforms.coders import DomainCoder, GroupPart


class _CollectGroup(beam.DoFn):
    ARRIVED = userstate.BagStateSpec("arrived", DomainCoder())  # the group's rollouts so far

    def process(self, keyed: tuple[str, list[Rollout] | EndOfInput], arrived=beam.DoFn.StateParam(ARRIVED)):
        _, part = keyed  # keyed by the group (transforms/dispatch.py chooses the key)
        if isinstance(part, EndOfInput):
            yield keyed
            return
        if len(part) < part[0].group_size:
            group = [*arrived.read(), *part]
            if len(group) < part[0].group_size:
                for rollout in part:
                    arrived.add(rollout)
                return
            arrived.clear()
        else:  # the whole group at once: no state to read or write
            group = part
        beam.metrics.Metrics.counter("beam_rl", "groups_completed").inc()
        yield group[0].group_id, sorted(group, key=lambda r: r.attempt)


class CompleteGroups(beam.PTransform):
    """(a group's key, some of its rollouts) -> (group id, the group's rollouts ordered by attempt), once per group;
    (a key, EndOfInput) -> itself."""

    def expand(self, rollouts):
        return rollouts | beam.ParDo(_CollectGroup()).with_output_types(tuple[str, GroupPart])
