"""PackBatches: one stateful packer cuts scored groups into numbered train batches.

It holds the BatchBuilder in Beam state under a single key, so step numbers are assigned in one
place: the groups waiting for a batch in a bag (each added once), the rest (window records, counts,
next step) as one small value. It mirrors the whole in the worker's memory (see _MIRRORS). Batches
are cut when full; the last, partial one is cut when EndOfInput says every group has arrived (end of
input is data here, never a timer).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any, List, Tuple

import apache_beam as beam
from apache_beam.coders import PickleCoder
from apache_beam.transforms import userstate
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.timestamp import Timestamp
from apache_beam.utils.windowed_value import WindowedValue

from beam_rl import components
from beam_rl.config import RunConfig
from beam_rl.rollout_source import EndOfInput, note_packed
from beam_rl.rundir import RunDir
from beam_rl.sink import BatchBuilder
from beam_rl.types import TrainBatch
from transforms.coders import PackerItem

_PACKER_KEY = "packer"
BATCH_GROUPS = 64  # at most this many scored groups reach the packer as one element
_LOG = logging.getLogger(__name__)


@dataclass
class _PackerState:
    builder: BatchBuilder
    groups_seen: int = 0
    groups_expected: int | None = None  # set by EndOfInput
    revision: int = 0  # one more per element processed


# The packer state of each run in this worker process, by run id. Beam state is the durable copy
# (what a restarted Flink worker restores). On Prism this mirror wins whenever Beam's copy is older,
# which Prism 2.62 does to keyed state in global windows once its watermark has run ahead (README).
# On Flink keyed state is never lost, so a Beam copy other than the one this process last wrote was
# restored from a checkpoint: it is the truth, and the mirror (ahead of it) is ignored.
_MIRRORS: dict[str, _PackerState] = {}
# Held for a whole element: should the runner ever run two bundles of the packer at once, the second
# continues from the first's result (the newer mirror) instead of numbering the same step twice.
_MIRRORS_LOCK = threading.Lock()


class _PackFn(beam.DoFn):
    STATE = userstate.ReadModifyWriteStateSpec("packer", PickleCoder())  # _PackerState, no pending groups
    PENDING = userstate.BagStateSpec("pending", PickleCoder())  # its pending groups, oldest first

    def __init__(self, config: RunConfig, run_id: str, first_step: int, check_staleness: bool,
                 run_dir: str | None = None) -> None:
        self._config = config
        self._run_id = run_id
        self._first_step = first_step
        self._check_staleness = check_staleness
        self._run_dir = run_dir
        self._state_is_durable = config.runner.name != "direct"  # Flink: Beam state is never reset

    def _new_packer(self) -> _PackerState:
        return _PackerState(components.batch_builder(self._config, self._first_step, self._check_staleness))

    def _current(self, durable: _PackerState | None, pending) -> tuple[_PackerState, bool]:
        """The packer to continue from, and whether Beam's copy was behind (and must be rewritten)."""
        mirror = _MIRRORS.get(self._run_id)
        if mirror is not None and durable is not None and durable.revision == mirror.revision:
            return mirror, False  # the same packer, already in memory: its pending bag is not read
        if self._state_is_durable:
            return self._restored(durable, pending), True
        if mirror is not None and (durable is None or durable.revision < mirror.revision):
            beam.metrics.Metrics.counter("beam_rl", "packer_state_restored_from_mirror").inc()
            return mirror, True
        if durable is None:
            return self._new_packer(), False
        durable.builder.restore_pending(list(pending.read()))
        return durable, False

    def _restored(self, durable: _PackerState | None, pending) -> _PackerState:
        """Beam's copy (or a new packer) after a Flink restore or the first element: steps committed
        since that checkpoint stay committed (the run directory is never rolled back), so the groups
        they hold are dropped and their step numbers are not given out again."""
        if durable is None:
            packer = self._new_packer()
        else:
            packer = durable
            packer.builder.restore_pending(list(pending.read()))
        if self._run_dir is not None:
            run_dir = RunDir(self._run_dir)
            dropped = packer.builder.drop_committed(run_dir.consumed_offsets(), run_dir.next_step())
            if dropped:
                beam.metrics.Metrics.counter("beam_rl", "packer_groups_dropped_after_restore").inc(dropped)
                _LOG.warning("packer restored at step %d: dropped %d groups a step committed since holds",
                             packer.builder.next_step, dropped)
        return packer

    def process(self, keyed: Tuple[str, Any], state=beam.DoFn.StateParam(STATE),
                pending=beam.DoFn.StateParam(PENDING)):
        _, items = keyed
        if not _MIRRORS_LOCK.acquire(blocking=False):
            _LOG.warning("the runner runs two bundles of the packer at once; the second waits")
            beam.metrics.Metrics.counter("beam_rl", "packer_bundles_concurrent").inc()
            _MIRRORS_LOCK.acquire()
        try:
            batches = self._step(items, state, pending)
        finally:
            _MIRRORS_LOCK.release()
        for batch in batches:
            if batch.step <= self._config.run.max_steps:
                yield batch

    def _step(self, items: list[Any], state, pending) -> list[TrainBatch]:
        packer, rewrite = self._current(state.read(), pending)
        before = packer.builder.pending
        batches: list[TrainBatch] = []
        for item in items:
            if isinstance(item, EndOfInput):
                packer.groups_expected = item.groups
            else:
                packer.groups_seen += 1
                batches += packer.builder.add(item)
        if packer.groups_expected is not None and packer.groups_seen >= packer.groups_expected:
            final = packer.builder.flush()
            batches += [final] if final is not None else []
        packer.revision += 1
        self._store(packer, before, rewrite, state, pending)
        _MIRRORS[self._run_id] = packer
        note_packed(self._run_id, packer.groups_seen)
        return batches

    @staticmethod
    def _store(packer: _PackerState, before: list, rewrite: bool, state, pending) -> None:
        rest, after = packer.builder.split_pending()
        state.write(dataclasses.replace(packer, builder=rest))
        kept = len(before) <= len(after) and all(a is b for a, b in zip(before, after))
        if rewrite or not kept:  # a batch was cut (or Beam's copy was behind): store what is left
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
    def __init__(self, config: RunConfig, run_id: str, first_step: int, check_staleness: bool = True,
                 run_dir: str | None = None) -> None:
        super().__init__()
        self._fn = _PackFn(config, run_id, first_step, check_staleness, run_dir)

    def expand(self, scored_groups_and_end) -> beam.PCollection[TrainBatch]:
        return (scored_groups_and_end
                # Up to a bundle's worth of groups per element: the packer's state is read and written
                # once per element, and on Prism each element for the single key cost a bundle round
                # trip (the runner's CPU per rollout fell ~3x; bench/README.md).
                | "PerBundle" >> beam.ParDo(_PerBundle()).with_output_types(List[PackerItem])
                | "OneKey" >> beam.Map(lambda x: (_PACKER_KEY, x)).with_output_types(Tuple[str, List[PackerItem]])
                | beam.ParDo(self._fn).with_output_types(TrainBatch))


def forget_packer(run_id: str) -> None:
    """Drop a finished run's in-memory packer state."""
    with _MIRRORS_LOCK:
        _MIRRORS.pop(run_id, None)
