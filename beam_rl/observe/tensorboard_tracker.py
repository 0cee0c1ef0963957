"""TensorBoard event files under <run dir>/tensorboard/: one event per stream and step, never two.

Each event holds all of one stream's figures of one step plus a "<stream>/step" marker, as one
CRC-checked record: a crash leaves a step's record whole or absent, never half of it. A resumed
tracker reads the existing event files for the last step of each stream and logs only later ones, so
events that never reached the file (queued when the process died) are logged again, and none twice.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from beam_rl.observe.figures import STREAMS, Figures
from beam_rl.observe.trackers import Sample

_LOG = logging.getLogger(__name__)


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, log_dir: Path) -> None:
        # Imported here: a run without TensorBoard does not pay for it.
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.log_dir = log_dir
        self.logged = logged_steps(log_dir)  # read before this writer adds its own (empty) file
        # The observer flushes after each poll that logged something; the queue only bounds memory.
        self._writer = EventFileWriter(str(log_dir), max_queue_size=1000, flush_secs=60)

    def log(self, stream: str, step: int, figures: Figures, samples: list[Sample] | None = None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=f"{stream}/step", simple_value=float(step))]
        values += [Summary.Value(tag=name, simple_value=value) for name, value in figures.items()]
        self._writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))
        self.logged[stream] = step

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def logged_steps(log_dir: Path) -> dict[str, int]:
    """The last step of each stream in the event files under `log_dir` (0 where none): the step after
    which a resumed run logs. A record torn by a crash ends its file's reading (TensorBoard does the same)."""
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    logged = dict.fromkeys(STREAMS, 0)
    markers = {f"{stream}/step": stream for stream in STREAMS}
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        for event in LegacyEventFileLoader(str(path)).Load():
            for value in event.summary.value:
                stream = markers.get(value.tag)
                if stream is not None:
                    logged[stream] = max(logged[stream], event.step)
                    break
    if any(logged.values()):
        _LOG.info("TensorBoard %s: resuming after steps %s", log_dir, logged)
    return logged
