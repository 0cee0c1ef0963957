"""PackBatches: one stateful packer cuts scored groups into numbered train batches.

It holds the BatchBuilder (pending groups, window, next step) in Beam state under a single key, so
step numbers are assigned in one place. Batches are cut when full; the last, partial one is cut
when EndOfInput says every group has arrived (end of input is data here, never a timer).
"""

from __future__ import annotations

from typing import Any, Tuple

import apache_beam as beam
from apache_beam.coders import PickleCoder, VarIntCoder
from apache_beam.transforms import userstate

from beam_rl import components
from beam_rl.config import RunConfig
from beam_rl.rollout_source import EndOfInput
from beam_rl.sink import ScoredGroup
from beam_rl.types import TrainBatch

_PACKER_KEY = "packer"


class _PackFn(beam.DoFn):
    BUILDER = userstate.ReadModifyWriteStateSpec("builder", PickleCoder())
    GROUPS_SEEN = userstate.ReadModifyWriteStateSpec("groups_seen", VarIntCoder())
    GROUPS_EXPECTED = userstate.ReadModifyWriteStateSpec("groups_expected", VarIntCoder())

    def __init__(self, config: RunConfig, first_step: int, check_staleness: bool) -> None:
        self._config = config
        self._first_step = first_step
        self._check_staleness = check_staleness

    def process(self, keyed: Tuple[str, Any], builder_state=beam.DoFn.StateParam(BUILDER),
                seen_state=beam.DoFn.StateParam(GROUPS_SEEN),
                expected_state=beam.DoFn.StateParam(GROUPS_EXPECTED)):
        _, item = keyed
        builder = builder_state.read() or components.batch_builder(
            self._config, self._first_step, self._check_staleness)
        seen = seen_state.read() or 0
        expected = expected_state.read()
        batches: list[TrainBatch] = []
        if isinstance(item, EndOfInput):
            expected = item.groups
            expected_state.write(expected)
        else:
            seen += 1
            seen_state.write(seen)
            batches += builder.add(item)
        if expected is not None and seen >= expected:
            final = builder.flush()
            batches += [final] if final is not None else []
        builder_state.write(builder)
        for batch in batches:
            if batch.step <= self._config.run.max_steps:
                yield batch


class PackBatches(beam.PTransform):
    def __init__(self, config: RunConfig, first_step: int, check_staleness: bool = True) -> None:
        super().__init__()
        self._fn = _PackFn(config, first_step, check_staleness)

    def expand(self, scored_groups_and_end) -> beam.PCollection[TrainBatch]:
        return (scored_groups_and_end
                | "OneKey" >> beam.Map(lambda x: (_PACKER_KEY, x)).with_output_types(Tuple[str, Any])
                | beam.ParDo(self._fn))
