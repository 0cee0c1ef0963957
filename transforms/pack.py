"""PackBatches: one stateful packer cuts scored groups into numbered train batches.

It holds the BatchBuilder in Beam state under a single key, so step numbers are assigned in one place:
the groups waiting for a batch in a bag (each added once), the rest (window records, counts, next step)
as one small value. Beam state is the only copy. Batches are cut when full; the last, partial one when
every shard's EndOfInput has come and every group it announced has arrived (end of input is data here,
never a timer), followed by an InputExhausted marker for the writer.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, List, Tuple

import apache_beam as beam
from apache_beam.coders import PickleCoder
from apache_beam.transforms import userstate
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.timestamp import Timestamp
from apache_beam.utils.windowed_value import WindowedValue

from beam_rl import components
from beam_rl.config import RunConfig
from beam_rl.packing.batches import BatchBuilder, InputExhausted
from beam_rl.rundir import RunDir
from beam_rl.source import EndOfInput
from transforms.coders import PackerItem, PackerOutput

_PACKER_KEY = "packer"
BATCH_GROUPS = 64  # at most this many scored groups reach the packer as one element
_LOG = logging.getLogger(__name__)


@dataclass
class _PackerState:
    builder: BatchBuilder
    groups_seen: int = 0
    ended: dict[int, int] = field(default_factory=dict)  # shard -> groups it announced in its EndOfInput
    flushed: bool = False  # the final, partial batch was cut

    def input_exhausted(self, shards: int) -> bool:
        return len(self.ended) == shards and self.groups_seen >= sum(self.ended.values())


class _PackFn(beam.DoFn):
    STATE = userstate.ReadModifyWriteStateSpec("packer", PickleCoder())  # _PackerState, no pending groups
    PENDING = userstate.BagStateSpec("pending", PickleCoder())  # its pending groups, in packing order

    def __init__(self, config: RunConfig, first_step: int, check_staleness: bool, run_dir: str) -> None:
        self._config = config
        self._first_step = first_step
        self._check_staleness = check_staleness
        self._run_dir = run_dir

    def setup(self) -> None:
        self._dir = RunDir(self._run_dir)

    def process(self, keyed: Tuple[str, Any], state=beam.DoFn.StateParam(STATE),
                pending=beam.DoFn.StateParam(PENDING)):
        _, items = keyed
        packer, rewrite = self._current(state.read(), pending)
        before = packer.builder.pending
        out: list[PackerOutput] = []
        groups = [item for item in items if not isinstance(item, EndOfInput)]
        for end in (item for item in items if isinstance(item, EndOfInput)):
            packer.ended[end.shard] = end.groups
        packer.groups_seen += len(groups)
        out += packer.builder.add_all(groups)
        exhausted = packer.input_exhausted(self._config.dispatch.shards) and not packer.flushed
        if exhausted:
            final = packer.builder.flush()
            out += [final] if final is not None else []
            packer.flushed = True
        self._store(packer, before, rewrite, state, pending)
        for batch in out:
            if batch.step <= self._config.run.max_steps:
                yield batch
        if exhausted:
            yield InputExhausted(last_step=packer.builder.next_step - 1)

    def _current(self, durable: _PackerState | None, pending) -> tuple[_PackerState, bool]:
        """Beam's copy (or a new packer), and whether its pending bag must be rewritten. Steps are never
        rolled back in the run directory: if the step this packer would write next is committed already,
        Flink restored a checkpoint older than the run directory (or restarted with none), so the groups
        those steps hold are dropped and their step numbers are not given out again."""
        if durable is None:
            packer = _PackerState(components.batch_builder(self._config, self._first_step, self._check_staleness))
        else:
            packer = durable
            packer.builder.restore_pending(list(pending.read()))
        if not self._dir.is_committed(packer.builder.next_step):
            return packer, False
        dropped = packer.builder.drop_committed(self._dir.consumed_offsets(), self._dir.next_step())
        beam.metrics.Metrics.counter("beam_rl", "packer_groups_dropped_after_restore").inc(dropped)
        _LOG.warning("packer behind the run directory: now at step %d, dropped %d groups a committed "
                     "step holds", packer.builder.next_step, dropped)
        return packer, True

    @staticmethod
    def _store(packer: _PackerState, before: list, rewrite: bool, state, pending) -> None:
        rest, after = packer.builder.split_pending()
        state.write(dataclasses.replace(packer, builder=rest))
        kept = len(before) <= len(after) and all(a is b for a, b in zip(before, after))
        if rewrite or not kept:  # a batch was cut (or groups dropped): store what is left
            pending.clear()
            added = after
        else:
            added = after[len(before):]
        for group in added:
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
        return WindowedValue(items, self._latest, [GlobalWindow()])


class PackBatches(beam.PTransform):
    def __init__(self, config: RunConfig, first_step: int, check_staleness: bool, run_dir: str) -> None:
        super().__init__()
        self._fn = _PackFn(config, first_step, check_staleness, run_dir)

    def expand(self, scored_groups_and_end) -> beam.PCollection[PackerOutput]:
        return (scored_groups_and_end
                # Up to a bundle's worth of groups per element: the packer's state is read and written
                # once per element, and on Prism each element for the single key cost a bundle round
                # trip (the runner's CPU per rollout fell ~3x; bench/README.md).
                | "PerBundle" >> beam.ParDo(_PerBundle()).with_output_types(List[PackerItem])
                | "OneKey" >> beam.Map(lambda x: (_PACKER_KEY, x)).with_output_types(Tuple[str, List[PackerItem]])
                | beam.ParDo(self._fn).with_output_types(PackerOutput))
