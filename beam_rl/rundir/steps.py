"""Committed steps: a step's Arrow files and then its commit record, written once; read back verified."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa

from beam_rl.rundir.arrow import rollouts_to_table, samples_to_table
from beam_rl.rundir.atomic import atomic_write, fsync_directory, is_temp, json_bytes, remove
from beam_rl.rundir.errors import RunDirError, StepAlreadyCommittedError, StepCorruptError, StepNotCommittedError
from beam_rl.rundir.layout import COMMIT_FILE, RunLayout, step_dirs
from beam_rl.rundir.step_parts import RankFile, StepPlan, WindowFile
from beam_rl.types import MicroBatch, Rollout, RolloutRecord, TrainBatch
from schemas.commit_record import (
    WINDOW_FILE,
    CommitRecord,
    CommitRecordError,
    FileEntry,
    Offset,
    StepCounts,
    new_checksum,
    rank_file_name,
)
from schemas.train_batch import SCHEMA_VERSION, check_schema
from schemas.window import ROLLOUT_RECORD_SCHEMA


class StepStore(RunLayout):
    """The rollouts side of a run directory, written by the orchestrator and read by trainers.

    Every file is written under a hidden temporary name in its final directory, fsynced, renamed into
    place and the directory fsynced, so a crash leaves either the old state or the new one, plus temp
    files that `clean_uncommitted` removes. One orchestrator process writes a run's rollouts at a time.
    """

    def is_committed(self, step: int) -> bool:
        return self.commit_path(step).is_file()

    def write_step(
        self,
        batch: TrainBatch,
        extra: dict[str, Any] | None = None,
        *,
        offsets: Iterable[Offset] = (),
        window: Sequence[Rollout | RolloutRecord] | pa.Table | None = None,
    ) -> Path:
        """Write and commit one step; returns its directory.

        `offsets` are the (env, epoch, index) prompts this step consumes: on resume the source skips
        exactly these. `window` overrides the observation window written as window.arrow (default:
        `batch.rollouts`, every rollout since the previous step). `extra` goes into the commit record;
        its "timings" dict is merged with the write timing, the rest kept under `extra`.
        The pipeline writes the same files in parts instead (`write_rank`, `write_window`, `commit_step`).
        """
        plan = StepPlan.of(batch, offsets=offsets, extra=extra)
        if self.is_committed(plan.step):
            raise StepAlreadyCommittedError(f"{self.step_dir(plan.step)}: step {plan.step} is already committed")
        t0 = time.monotonic()
        step_dir = self.step_dir(plan.step)
        if step_dir.exists():
            shutil.rmtree(step_dir)  # an uncommitted leftover of a crashed attempt at this step
        ranks = [self.write_rank(plan.step, rank, mbs) for rank, mbs in enumerate(batch.micro_batches)]
        written = self.write_window(plan.step, batch.rollouts if window is None else window)
        return self.commit_step(plan, ranks, written, t_started=t0)

    def write_rank(self, step: int, rank: int, micro_batches: Sequence[MicroBatch]) -> RankFile:
        """Write rank `rank`'s file of an uncommitted step (atomically, fsynced; its rename made durable by
        `commit_step`). The bytes depend on the micro-batches only, so writing it again, after a crash or
        by a duplicated write, puts the same file in place."""
        table = samples_to_table(micro_batches)
        with self._writing(step):
            self._open_step_dir(step)
            entry = _write_checksummed(self.rank_path(step, rank), table)
        return RankFile(
            step=step,
            rank=rank,
            entry=entry,
            micro_batches=len(micro_batches),
            samples=table.num_rows,
            tokens=sum(mb.num_tokens for mb in micro_batches),
            trained_tokens=sum(int(np.count_nonzero(s.loss_mask)) for mb in micro_batches for s in mb.samples),
        )

    def write_window(self, step: int, window: Sequence[Rollout | RolloutRecord] | pa.Table) -> WindowFile:
        """Write an uncommitted step's window.arrow, its rows stamped as committed now (atomically, fsynced)."""
        # The window's rows learn when their step was committed: now, beside its rank files.
        table = _window_table(window, committed_at=time.time())
        with self._writing(step):
            self._open_step_dir(step)
            entry = _write_checksummed(self.window_path(step), table)
        return WindowFile(step=step, entry=entry, rows=table.num_rows)

    @contextlib.contextmanager
    def _writing(self, step: int) -> Iterator[None]:
        """A file of an uncommitted step: an OSError while writing it names the step that did not make it."""
        try:
            yield
        except OSError as err:
            raise _not_committed(self.step_dir(step), step, err) from err

    def _open_step_dir(self, step: int) -> Path:
        """The step's directory, made (and its name made durable) by whichever writer comes first."""
        step_dir = self.step_dir(step)
        if not step_dir.is_dir():
            self.rollouts_dir.mkdir(parents=True, exist_ok=True)
            step_dir.mkdir(exist_ok=True)
            fsync_directory(self.rollouts_dir)
        return step_dir

    def commit_step(
        self, plan: StepPlan, ranks: Sequence[RankFile], window: WindowFile, *, t_started: float | None = None
    ) -> Path:
        """Commit a step whose files are written: one directory fsync makes every rename durable, then the
        commit record names them. `ranks` must hold each of the step's ranks (duplicates are the same file)."""
        step = plan.step
        by_rank = {r.rank: r for r in ranks}
        if sorted(by_rank) != list(range(plan.ranks)) or window.step != step:
            raise ValueError(f"step {step}: files of ranks {sorted(by_rank)} for {plan.ranks} ranks")
        if self.is_committed(step):
            raise StepAlreadyCommittedError(f"{self.step_dir(step)}: step {step} is already committed")
        step_dir = self.step_dir(step)
        files = {rank_file_name(r): by_rank[r].entry for r in range(plan.ranks)}
        files[WINDOW_FILE] = window.entry
        rank_files = [by_rank[r] for r in range(plan.ranks)]
        record = CommitRecord(
            step=step,
            schema_version=SCHEMA_VERSION,
            committed_at=time.time(),
            group_ids=plan.group_ids,
            offsets=plan.offsets,
            counts=StepCounts(
                ranks=plan.ranks,
                micro_batches=[r.micro_batches for r in rank_files],
                samples=sum(r.samples for r in rank_files),
                tokens=sum(r.tokens for r in rank_files),
                trained_tokens=sum(r.trained_tokens for r in rank_files),
                groups=len(plan.group_ids),
                window_rollouts=window.rows,
            ),
            timings={**plan.timings, **({"write_s": round(time.monotonic() - t_started, 6)} if t_started else {})},
            files=files,
            window=plan.window,
            extra=plan.extra,
        )
        try:
            # One directory fsync makes every rename above durable before the commit record can exist.
            fsync_directory(step_dir)
            atomic_write(self.commit_path(step), lambda f: f.write(record.to_json()))
        except OSError as err:
            if self.is_committed(step):
                raise  # the commit record exists: only its directory fsync failed; the step stands
            raise _not_committed(step_dir, step, err) from err
        return step_dir

    def mark_input_exhausted(self, last_step: int) -> None:
        """Every group of the run's input is in a committed step up to `last_step`: the run is over."""
        data = json_bytes({"last_step": last_step, "at": time.time()})
        atomic_write(self.input_exhausted_path, lambda f: f.write(data))

    def input_last_step(self) -> int | None:
        """The last step of a run whose input is exhausted (INPUT_EXHAUSTED.json), else None."""
        try:
            return int(json.loads(self.input_exhausted_path.read_bytes())["last_step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def run_over(self, max_steps: int) -> bool:
        """max_steps are committed, or the input is exhausted: the job may be ended."""
        return self.input_exhausted_path.is_file() or (self.last_committed_step() or 0) >= max_steps

    def committed_steps(self) -> list[int]:
        return sorted(step for step, path in step_dirs(self.rollouts_dir) if (path / COMMIT_FILE).is_file())

    def last_committed_step(self) -> int | None:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def next_step(self) -> int:
        """The step a (re)started orchestrator writes next."""
        last = self.last_committed_step()
        return 1 if last is None else last + 1

    def read_commit(self, step: int) -> CommitRecord:
        """The step's commit record; StepNotCommittedError if there is none, CommitRecordError (naming the
        file) if it cannot be read, is not a valid record, is of another step or of a newer record_version."""
        path = self.commit_path(step)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise StepNotCommittedError(f"{path}: step {step} is not committed") from None
        except OSError as err:
            raise CommitRecordError(f"{path}: unreadable: {err}") from err
        record = CommitRecord.from_json(data, str(path))
        if record.step != step:
            raise CommitRecordError(f"{path}: the record is of step {record.step}, not {step}")
        return record

    def consumed_offsets(self, before_step: int | None = None) -> set[Offset]:
        """Every (env, epoch, index) some committed step (before `before_step`, if given) consumed:
        what a resumed source must skip."""
        return {
            offset
            for step in self.committed_steps()
            if before_step is None or step < before_step
            for offset in self.read_commit(step).offsets
        }

    def map_committed_file(self, record: CommitRecord, name: str, *, verify: bool = True) -> pa.Buffer:
        """A file of a committed step, memory-mapped and checked against its entry in the commit record.

        Always checks the size (catches a torn file for free); with `verify`, also the XXH3-128
        checksum, hashed straight from the mapping: the pages it faults in are the ones Arrow then reads,
        so verifying never reads the file twice. Measured by bench/cost/verify_cost.py on a 64 MiB rank file
        (medians of 21 interleaved rounds; ranges over three runs on a shared 2-core machine): in the
        page cache, mapping and hashing it took 16-21 ms against 0.1 ms to map it unverified, and
        verifying added 7-12 ms to a `StepReader.read_step` of 55-75 ms; read cold and then consumed
        whole, as a trainer does, verified reads took 132-144 ms and unverified ones 150-171 ms (the
        hash brings the pages in once, sequentially). StepCorruptError names the step and the file.
        """
        path = self.step_dir(record.step) / name
        entry = record.files.get(name)
        if entry is None:
            raise StepCorruptError(record.step, path, "not listed in the commit record")
        try:
            with pa.memory_map(str(path), "r") as mapped:
                # The mapping outlives this `with`: the buffer (and Arrow arrays on it) keep it referenced.
                data = mapped.read_buffer()
        except FileNotFoundError:
            raise StepCorruptError(record.step, path, "missing (the commit record lists it)") from None
        except OSError as err:
            raise StepCorruptError(record.step, path, f"unreadable: {err}") from err
        problem = entry.mismatch(data, verify_checksum=verify)
        if problem:
            raise StepCorruptError(record.step, path, problem)
        return data

    def verify_step(self, record: CommitRecord) -> list[Path]:
        """Check every file the commit record lists (StepCorruptError on the first that fails); returns
        the files in the step directory it does not list. Those are not part of the step: readers never
        open them, so they are reported, not an error (`clean_uncommitted` removes crash leftovers)."""
        for name in sorted(record.files):
            self.map_committed_file(record, name)
        step_dir = self.step_dir(record.step)
        return sorted(p for p in step_dir.iterdir() if p.name not in record.files and p.name != COMMIT_FILE)

    def read_window(self, step: int) -> pa.Table:
        """The step's observation window (ROLLOUT_RECORD_SCHEMA), verified against its commit record."""
        record = self.read_commit(step)
        path = self.window_path(step)
        table = open_arrow_file(step, path, self.map_committed_file(record, WINDOW_FILE)).read_all()
        check_schema(table.schema, ROLLOUT_RECORD_SCHEMA, str(path))
        return table

    def clean_uncommitted(self) -> list[Path]:
        """Remove what a crash left behind: uncommitted step dirs and temp files; returns what was removed.

        Only the orchestrator's side: the weights side belongs to the trainer, which may be mid-publish.
        """
        removed: list[Path] = []
        for _, path in step_dirs(self.rollouts_dir):
            if not (path / COMMIT_FILE).is_file():
                shutil.rmtree(path)
                removed.append(path)
                continue
            removed += _remove_temps(path)
        for directory in (self.path, self.rollouts_dir):
            if directory.is_dir():
                removed += _remove_temps(directory)
        return removed


def open_arrow_file(step: int, path: Path, data: pa.Buffer) -> pa.ipc.RecordBatchFileReader:
    """An Arrow IPC file reader on a committed file's bytes; StepCorruptError, not Arrow's bare message."""
    try:
        return pa.ipc.open_file(data)
    except (pa.ArrowInvalid, pa.ArrowIOError) as err:
        raise StepCorruptError(step, path, f"not a readable Arrow IPC file: {err}") from None


def _not_committed(step_dir: Path, step: int, err: OSError) -> RunDirError:
    # A full disk (ENOSPC) or an I/O error mid-step: say which step did not make it. Files already
    # renamed into the step dir stay uncommitted; `clean_uncommitted` removes them.
    return RunDirError(f"{step_dir}: step {step} is not committed: writing it failed: {err}")


def _remove_temps(directory: Path) -> list[Path]:
    removed = [path for path in directory.iterdir() if is_temp(path)]
    for path in removed:
        remove(path)
    return removed


def _window_table(window: Sequence[Rollout | RolloutRecord] | pa.Table, committed_at: float) -> pa.Table:
    if isinstance(window, pa.Table):
        table = window.select(ROLLOUT_RECORD_SCHEMA.names).cast(ROLLOUT_RECORD_SCHEMA)
    else:
        table = rollouts_to_table(window)
    column = ROLLOUT_RECORD_SCHEMA.get_field_index("t_committed")
    stamp = pa.array(np.full(table.num_rows, committed_at), pa.float64())
    return table.set_column(column, ROLLOUT_RECORD_SCHEMA.field(column), stamp)


def _write_checksummed(path: Path, table: pa.Table) -> FileEntry:
    """Write `table` atomically (no directory fsync: the caller does one for all), checksumming the bytes
    as they go out rather than reading the file back."""
    out: _ChecksummingFile | None = None

    def write(f: BinaryIO) -> None:
        nonlocal out
        out = _ChecksummingFile(f)
        _write_arrow_file(out, table)

    atomic_write(path, write, fsync_dir=False)
    assert out is not None  # atomic_write called write
    return out.entry()


def _write_arrow_file(f: BinaryIO | _ChecksummingFile, table: pa.Table) -> None:
    # IPC *file* format (not stream): it has a footer, so readers can memory-map it and seek to any batch.
    with pa.ipc.new_file(f, table.schema) as writer:
        for record_batch in table.to_batches():
            writer.write_batch(record_batch)


class _ChecksummingFile:
    """A write-only file object that counts and checksums what passes through it to the real file."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._checksum = new_checksum()
        self._bytes = 0

    def write(self, data: Any) -> int:
        written = self._f.write(data)
        self._checksum.update(data)
        self._bytes += memoryview(data).nbytes
        return written

    def tell(self) -> int:
        return self._f.tell()

    def flush(self) -> None:
        self._f.flush()

    @property
    def closed(self) -> bool:
        return self._f.closed

    def entry(self) -> FileEntry:
        return FileEntry(bytes=self._bytes, xxh3_128=self._checksum.hexdigest())
