"""PackBatches: one stateful packer cuts scored groups into numbered train batches.

It holds the packer's state (beam_rl/packing/state.py) in Beam state under a single key, so step numbers
are assigned in one place: the value in one ReadModifyWrite state, the groups waiting for a batch in a
bag the domain's save appends to (each group added once). Beam state is the only copy; each element is
one load, one add and one save. Batches are cut when full; the last, partial one when every shard's
EndOfInput has come and every group it announced has arrived (end of input is data here, never a timer),
followed by an InputExhausted marker for the writer.
"""

from __future__ import annotations

from typing import Any

import apache_beam as beam
from apache_beam.coders import PickleCoder
from apache_beam.transforms import userstate
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.timestamp import Timestamp
from apache_beam.utils.windowed_value import WindowedValue

from beam_rl import wiring
from beam_rl.config import RunConfig
from beam_rl.packing.batches import BatchBuilder
from beam_rl.packing.state import Packer, PackerState, PackerWrites
from beam_rl.rundir import RunDir
from transforms.coders import PackerItem, PackerOutput

_PACKER_KEY = "packer"
BATCH_GROUPS = 64  # at most this many scored groups reach the packer as one element


# The name savepoints taken before the packer's state moved to the domain recorded its value under.
_PackerState = PackerState


class _PackFn(beam.DoFn):
    STATE = userstate.ReadModifyWriteStateSpec("packer", PickleCoder())  # PackerState, no pending groups
    PENDING = userstate.BagStateSpec("pending", PickleCoder())  # its pending groups, in packing order

    def __init__(self, config: RunConfig, first_step: int, check_staleness: bool, run_dir: str) -> None:
        self._config = config
        self._first_step = first_step
        self._check_staleness = check_staleness
        self._run_dir = run_dir

    def setup(self) -> None:
        self._dir = RunDir(self._run_dir)
        self._parts = wiring.packing_parts(self._config, self._check_staleness)

    def process(self, keyed: tuple[str, Any], state=beam.DoFn.StateParam(STATE), pending=beam.DoFn.StateParam(PENDING)):
        _, items = keyed
        packer = Packer.load(state.read(), pending.read(), new_builder=self._new_builder, steps=self._dir)
        out = packer.add(items, shards=self._config.dispatch.shards, max_steps=self._config.run.max_steps)
        self._write(packer.save(), state, pending)
        if packer.dropped:
            beam.metrics.Metrics.counter("beam_rl", "packer_groups_dropped_after_restore").inc(packer.dropped)
        yield from out

    def _new_builder(self) -> BatchBuilder:
        return self._parts.batch_builder(self._first_step)

    @staticmethod
    def _write(writes: PackerWrites, state, pending) -> None:
        state.write(writes.value)
        if writes.clear_first:
            pending.clear()
        for group in writes.pending:
            pending.add(group)


class _PerBundle(beam.DoFn):
    """Groups a bundle's elements into lists of at most BATCH_GROUPS, flushed when full and at the
    bundle's end, stamped with the newest element's timestamp (BatchElements stamps the end of the
    global window, which holds the list back on Prism)."""

    def start_bundle(self) -> None:
        self._items: list[Any] = []
        self._latest: Timestamp | None = None

    def process(self, item, timestamp=beam.DoFn.TimestampParam):
        self._items.append(item)
        self._latest = timestamp if self._latest is None else max(self._latest, timestamp)
        if len(self._items) >= BATCH_GROUPS:
            yield self._flush()

    def finish_bundle(self):
        if self._items:
            yield self._flush()

    def _flush(self) -> WindowedValue:
        items, self._items = self._items, []
        assert self._latest is not None  # set with the first item
        return WindowedValue(items, self._latest, (GlobalWindow(),))


class PackBatches(beam.PTransform):
    def __init__(self, config: RunConfig, first_step: int, check_staleness: bool, run_dir: str) -> None:
        super().__init__()
        self._fn = _PackFn(config, first_step, check_staleness, run_dir)

    def expand(self, scored_groups_and_end) -> beam.PCollection[PackerOutput]:
        return (
            scored_groups_and_end
            # Up to a bundle's worth of groups per element: the packer's state is read and written
            # once per element, and on Prism each element for the single key cost a bundle round
            # trip (the runner's CPU per rollout fell ~3x; bench/history.md).
            | "PerBundle" >> beam.ParDo(_PerBundle()).with_output_types(list[PackerItem])
            | "OneKey" >> beam.Map(lambda x: (_PACKER_KEY, x)).with_output_types(tuple[str, list[PackerItem]])
            | beam.ParDo(self._fn).with_output_types(PackerOutput)
        )
