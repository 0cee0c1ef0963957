"""The streaming proof: ticks -> keyed count-completed groups -> packed Arrow batch files.

The same shape as the rollout pipeline (an unbounded source, a stateful group completion, a stateful
packer writing Arrow files), small enough to show that a runner streams: batch files appear while the
source is still emitting, and the last partial batch is flushed once every announced element has
arrived (end of input as data, not a timer: see _PackAndWrite).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import apache_beam as beam
import pyarrow as pa
from apache_beam.coders import PickleCoder, VarIntCoder
from apache_beam.transforms import userstate
from apache_beam.transforms.window import GlobalWindow, TimestampedValue
from apache_beam.utils.timestamp import Duration, Timestamp

from beam_rl.rundir import write_atomic
from transforms.sdf import OffsetRestrictions, WatermarkFromStart

TICK_SCHEMA = pa.schema([("element", pa.int64()), ("emitted_at", pa.float64())])


class _EmitTicks(beam.DoFn):
    """Emits tick i once `interval_s * i` seconds have passed; self-checkpoints instead of sleeping. With
    `last_waits_for`, the last tick also waits until that file exists (a test opens it)."""

    def __init__(self, interval_s: float, last_waits_for: str | None = None) -> None:
        self._interval_s = interval_s
        self._last_waits_for = last_waits_for
        self._t0: float | None = None

    @beam.DoFn.unbounded_per_element()
    def process(
        self,
        count: int,
        tracker=beam.DoFn.RestrictionParam(OffsetRestrictions(lambda count: count)),
        watermark=beam.DoFn.WatermarkEstimatorParam(WatermarkFromStart()),
    ):
        if self._t0 is None:
            self._t0 = time.time()
        position = tracker.current_restriction().start
        while True:
            now = time.time()
            due = self._t0 + position * self._interval_s
            if due <= now and position == count - 1 and not self._last_may_go():
                due = now + self._interval_s  # look again a tick later
            if due > now:
                watermark.set_watermark(Timestamp.of(now))
                tracker.defer_remainder(Duration.of(due - now))
                return
            if not tracker.try_claim(position):
                return
            watermark.set_watermark(Timestamp.of(now))
            yield TimestampedValue((position, now), now)
            position += 1

    def _last_may_go(self) -> bool:
        return self._last_waits_for is None or os.path.exists(self._last_waits_for)


class TickSource(beam.PTransform):
    """An unbounded source of `count` numbered ticks `(i, emitted_at)`, one every `interval_s`; the last
    one not before the file `last_waits_for` exists, if named."""

    def __init__(self, count: int, interval_s: float, last_waits_for: str | None = None) -> None:
        super().__init__()
        self._count = count
        self._interval_s = interval_s
        self._last_waits_for = last_waits_for

    def expand(self, pbegin):
        count = self._count
        return (pbegin | beam.Impulse() | beam.Map(lambda _: count)
                | beam.ParDo(_EmitTicks(self._interval_s, self._last_waits_for)))


class _ReleaseCompleteGroups(beam.DoFn):
    """Bag state per key; releases the key's elements once `group_size` arrived, then clears it."""

    BUFFER = userstate.BagStateSpec("buffer", PickleCoder())

    def __init__(self, group_size: int) -> None:
        self._group_size = group_size

    def process(self, keyed, buffer=beam.DoFn.StateParam(BUFFER)):
        key, value = keyed
        buffer.add(value)
        members = list(buffer.read())
        if len(members) >= self._group_size:
            buffer.clear()
            yield key, sorted(members)


class CompleteByCount(beam.PTransform):
    def __init__(self, group_size: int) -> None:
        super().__init__()
        self._group_size = group_size

    def expand(self, ticks):
        size = self._group_size
        return (ticks | "KeyByGroup" >> beam.Map(lambda tick: (tick[0] // size, tick))
                | beam.ParDo(_ReleaseCompleteGroups(size)))


class _PackAndWrite(beam.DoFn):
    """Collects complete groups under one key; writes a batch file whenever enough arrived.

    The last partial batch is flushed when every element the source announced has arrived: end of
    input is data, not a timer. (On Prism 2.62 the watermark behind a self-checkpointing source
    jumps to +inf after its first checkpoint, so an end-of-window timer would fire at the start.)
    With `probe_timers`, an event-time and a processing-time timer are set only to log when they
    fire; nothing waits on them.
    """

    GROUPS = userstate.BagStateSpec("groups", PickleCoder())
    NEXT_BATCH = userstate.ReadModifyWriteStateSpec("next_batch", VarIntCoder())
    RECEIVED = userstate.ReadModifyWriteStateSpec("received", VarIntCoder())
    EVENT_PROBE = userstate.TimerSpec("event_probe", userstate.TimeDomain.WATERMARK)
    PROCESSING_PROBE = userstate.TimerSpec("processing_probe", userstate.TimeDomain.REAL_TIME)

    def __init__(self, out_dir: str, groups_per_batch: int, total: int, probe_timers: bool) -> None:
        self._out_dir = out_dir
        self._groups_per_batch = groups_per_batch
        self._total = total
        self._probe = probe_timers

    def process(self, keyed_group, groups=beam.DoFn.StateParam(GROUPS),
                next_batch=beam.DoFn.StateParam(NEXT_BATCH),
                received=beam.DoFn.StateParam(RECEIVED),
                event_probe=beam.DoFn.TimerParam(EVENT_PROBE),
                processing_probe=beam.DoFn.TimerParam(PROCESSING_PROBE)):
        _, group = keyed_group
        seen = received.read() or 0
        if seen == 0 and self._probe:
            self._note("timers_set", time.time())
            event_probe.set(GlobalWindow().max_timestamp())
            processing_probe.set(Timestamp.now() + Duration(seconds=1))
        seen += len(group[1])
        received.write(seen)
        groups.add(group)
        pending = list(groups.read())
        if len(pending) >= self._groups_per_batch or seen >= self._total:
            self._write(pending, groups, next_batch)

    @userstate.on_timer(EVENT_PROBE)
    def event_probe_fired(self):
        self._note("event_time_timer_fired", time.time())

    @userstate.on_timer(PROCESSING_PROBE)
    def processing_probe_fired(self):
        self._note("processing_time_timer_fired", time.time())

    def _write(self, pending, groups, next_batch) -> None:
        batch = next_batch.read() or 0
        rows = [tick for _, members in pending for tick in members]
        table = pa.table({"element": [e for e, _ in rows], "emitted_at": [t for _, t in rows]},
                         schema=TICK_SCHEMA)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, TICK_SCHEMA) as writer:
            writer.write_table(table)
        write_atomic(Path(self._out_dir) / f"batch_{batch:05d}.arrow", sink.getvalue().to_pybytes(),
                     overwrite=False)
        groups.clear()
        next_batch.write(batch + 1)

    def _note(self, name: str, when: float) -> None:
        with open(Path(self._out_dir) / "timers.log", "a") as log:
            log.write(f"{name} {when:.3f}\n")


class PackToArrowFiles(beam.PTransform):
    def __init__(self, out_dir: str, groups_per_batch: int, total: int, probe_timers: bool = False):
        super().__init__()
        self._fn = _PackAndWrite(out_dir, groups_per_batch, total, probe_timers)

    def expand(self, groups):
        return groups | "OneKey" >> beam.Map(lambda g: (0, g)) | beam.ParDo(self._fn)


def build_streaming_demo(pipeline: beam.Pipeline, out_dir: str, count: int = 40, interval_s: float = 0.1,
                         group_size: int = 4, groups_per_batch: int = 3,
                         probe_timers: bool = False, last_waits_for: str | None = None) -> None:
    (pipeline
     | "Ticks" >> TickSource(count, interval_s, last_waits_for)
     | "CompleteGroups" >> CompleteByCount(group_size)
     | "PackBatches" >> PackToArrowFiles(out_dir, groups_per_batch, count, probe_timers))


def read_batch_files(out_dir: str | Path) -> list[tuple[Path, pa.Table]]:
    files = sorted(Path(out_dir).glob("batch_*.arrow"))
    return [(f, pa.ipc.open_file(pa.memory_map(str(f))).read_all()) for f in files]
