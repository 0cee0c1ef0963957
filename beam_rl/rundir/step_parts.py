"""A step written in parts: its plan (what the commit record will say), each rank's file and the window
file, written apart and in parallel, then the commit record once every part is durable.

`StepStore.write_rank` and `StepStore.write_window` write the files; `StepStore.commit_step` writes the
record. `CommitQueue` decides when: a step commits once its plan and every one of its files have come
(a part that came twice counts once) and the step before it is committed, so steps commit in order
and a commit record never names a file not yet written.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
from pydantic import TypeAdapter, ValidationError

from beam_rl.rundir.atomic import json_default
from beam_rl.types import MicroBatch, RolloutRecord, RolloutTokens, Sample, TrainBatch
from schemas.commit_record import FileEntry, Offset, WindowStats, first_error
from schemas.fields import SAMPLE_TOKEN_FIELDS, SHARED_TOKEN_ARRAYS

_TIMINGS = TypeAdapter(dict[str, float])


@dataclass(frozen=True)
class StepPlan:
    """What a step's commit record says besides its files: checked when the step is cut, before any of
    its files is written, so that a value the record cannot hold fails first."""

    step: int
    ranks: int
    group_ids: list[str]
    offsets: list[Offset]  # the (env, epoch, index) prompts the step consumes: a resume skips exactly these
    window: WindowStats
    timings: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, batch: TrainBatch, *, offsets: Iterable[Offset] = (), extra: dict[str, Any] | None = None) -> StepPlan:
        """The plan of `batch`; `extra` goes into the record, its "timings" dict apart. ValueError naming
        the step for a value the record cannot hold."""
        if not isinstance(batch.step, (int, np.integer)) or batch.step < 0:
            raise ValueError(f"step must be a non-negative integer, got {batch.step!r}")
        step = int(batch.step)
        extra = json.loads(json.dumps(extra or {}, default=json_default))
        try:
            window = WindowStats.model_validate(json.loads(json.dumps(batch.window, default=json_default)))
        except ValidationError as err:
            raise ValueError(f"step {step}: window stats: {first_error(err)}") from None
        try:
            timings = _TIMINGS.validate_python(extra.pop("timings", {}))
        except ValidationError as err:
            raise ValueError(f"step {step}: extra timings: {first_error(err)}") from None
        return cls(
            step=step,
            ranks=len(batch.micro_batches),
            group_ids=[str(g) for g in batch.group_ids],
            offsets=sorted((str(env), int(epoch), int(index)) for env, epoch, index in offsets),
            window=window,
            timings=timings,
            extra=extra,
        )


@dataclass(frozen=True)
class RankFile:
    """A rank file written (fsynced, its rename not yet made durable) and what the record counts of it."""

    step: int
    rank: int
    entry: FileEntry
    micro_batches: int
    samples: int
    tokens: int
    trained_tokens: int


@dataclass(frozen=True)
class WindowFile:
    """A step's window.arrow written (fsynced, its rename not yet made durable)."""

    step: int
    entry: FileEntry
    rows: int


StepPart = StepPlan | RankFile | WindowFile

WINDOW_PART = -1  # FileToWrite.part of a step's window.arrow; ranks are 0..ranks-1


@dataclass(frozen=True)
class FileToWrite:
    """One file of a cut step, to be written apart from the others: rank `part`'s micro-batches, or (part
    WINDOW_PART) the window's records.

    Pickled by columns: it leaves the packer's key for a writer, and pickle's cost is per object, so each
    per-token array goes as one concatenation over the file's samples or records, not one per rollout
    (a step's rank files pickled ~10x faster than as objects; bench/scale/packer.py).
    """

    step: int
    part: int
    micro_batches: list[MicroBatch] = field(default_factory=list)
    window: list[RolloutRecord] = field(default_factory=list)

    def __reduce__(self) -> tuple[Any, ...]:
        return _file_from_columns, (
            self.step,
            self.part,
            _sample_columns(self.micro_batches),
            _record_columns(self.window),
        )


def _file_from_columns(step: int, part: int, samples: Any, records: Any) -> FileToWrite:
    return FileToWrite(step, part, _samples_from_columns(samples), _records_from_columns(records))


_SAMPLE_VALUES = tuple(f.name for f in fields(Sample) if f.name not in {t.name for t in SAMPLE_TOKEN_FIELDS})
_RECORD_VALUES = tuple(f.name for f in fields(RolloutRecord) if f.name != "tokens")


def _concat(arrays: list[np.ndarray], dtype: Any) -> np.ndarray:
    """The arrays laid end to end."""
    return np.concatenate(arrays) if arrays else np.empty(0, dtype)


def _lengths(arrays: list[np.ndarray]) -> np.ndarray:
    return np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))


def _split_at(flat: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    return np.split(flat, np.cumsum(lengths)[:-1]) if len(lengths) else []


def _sample_columns(micro_batches: list[MicroBatch]) -> Any:
    samples = [s for mb in micro_batches for s in mb.samples]
    arrays = {t.name: _concat([getattr(s, t.name) for s in samples], t.dtype) for t in SAMPLE_TOKEN_FIELDS}
    lengths = _lengths([s.input_ids for s in samples])
    values = {name: [getattr(s, name) for s in samples] for name in _SAMPLE_VALUES}
    return [len(mb.samples) for mb in micro_batches], lengths, arrays, values


def _samples_from_columns(columns: Any) -> list[MicroBatch]:
    sizes, lengths, arrays, values = columns
    split = {name: _split_at(flat, lengths) for name, flat in arrays.items()}
    samples = iter(
        [
            Sample(**{name: parts[i] for name, parts in split.items()}, **{k: v[i] for k, v in values.items()})
            for i in range(len(lengths))
        ]
    )
    return [MicroBatch([next(samples) for _ in range(size)]) for size in sizes]


def _record_columns(window: list[RolloutRecord]) -> Any:
    records = [r.record() for r in window]  # a Rollout given as its own window is its record
    tokens = [r.tokens for r in records]
    if any(t is not None and any(getattr(t, a) is None for a in SHARED_TOKEN_ARRAYS) for t in tokens):
        return records  # stored without their arrays (never so in a cut step): as objects
    known = [t for t in tokens if t is not None]
    parts = {a: [getattr(t, a) for t in known] for a in SHARED_TOKEN_ARRAYS}
    arrays = {a: (_concat(p, np.int32), _lengths(p)) for a, p in parts.items()}
    shape = [None if t is None else (t.segments, t.finish_reasons) for t in tokens]
    values = {name: [getattr(r, name) for r in records] for name in _RECORD_VALUES}
    return len(records), values, arrays, shape


def _records_from_columns(columns: Any) -> list[RolloutRecord]:
    if isinstance(columns, list):
        return columns
    count, values, arrays, shape = columns
    split = {a: iter(_split_at(flat, lengths)) for a, (flat, lengths) in arrays.items()}
    records = []
    for i in range(count):
        tokens = None
        if shape[i] is not None:
            segments, finish_reasons = shape[i]
            tokens = RolloutTokens(
                **{a: next(parts) for a, parts in split.items()}, segments=segments, finish_reasons=finish_reasons
            )
        records.append(RolloutRecord(**{k: v[i] for k, v in values.items()}, tokens=tokens))
    return records


def files_to_write(batch: TrainBatch) -> list[FileToWrite]:
    """A step's files: one per rank, and its window."""
    ranks = [FileToWrite(batch.step, rank, micro_batches=mbs) for rank, mbs in enumerate(batch.micro_batches)]
    return [*ranks, FileToWrite(batch.step, WINDOW_PART, window=batch.rollouts)]


@dataclass(frozen=True)
class ReadyStep:
    """A step whose plan and files have all come: what `StepStore.commit_step` takes."""

    plan: StepPlan
    ranks: list[RankFile]
    window: WindowFile


class CommitQueue:
    """The parts of uncommitted steps, as a runner stores them (a list it appends to), and the steps they
    complete. `is_committed` reads the run directory: a step commits only after the one before it."""

    def __init__(self, parts: Iterable[StepPart], is_committed: Callable[[int], bool]) -> None:
        self._is_committed = is_committed
        self._plans: dict[int, StepPlan] = {}
        self._ranks: dict[int, dict[int, RankFile]] = {}
        self._windows: dict[int, WindowFile] = {}
        for part in parts:
            self._add(part)

    def _add(self, part: StepPart) -> None:
        if isinstance(part, StepPlan):
            self._plans[part.step] = part
        elif isinstance(part, RankFile):
            self._ranks.setdefault(part.step, {})[part.rank] = part  # a part written twice is the same file
        else:
            self._windows[part.step] = part

    def add(self, part: StepPart) -> None:
        self._add(part)

    def ready(self) -> list[ReadyStep]:
        """The steps that may commit now, in order: each complete, and the first (step 1) or after a
        committed one."""
        out: list[ReadyStep] = []
        for step in sorted(self._plans):
            after_committed = step <= 1 or (out and out[-1].plan.step == step - 1) or self._is_committed(step - 1)
            if not (after_committed and self._complete(step)):
                break
            plan = self._plans[step]
            out.append(ReadyStep(plan, [self._ranks[step][r] for r in range(plan.ranks)], self._windows[step]))
        return out

    def plans(self) -> list[StepPlan]:
        return [self._plans[step] for step in sorted(self._plans)]

    def _complete(self, step: int) -> bool:
        plan = self._plans[step]
        return step in self._windows and len(self._ranks.get(step, {})) >= plan.ranks

    def forget(self, steps: Iterable[int]) -> None:
        """Drop the parts of steps committed (or found committed)."""
        for step in steps:
            self._plans.pop(step, None)
            self._ranks.pop(step, None)
            self._windows.pop(step, None)

    def parts(self) -> list[StepPart]:
        """What to store again after `forget`: every part still held."""
        return [
            *self._plans.values(),
            *(r for ranks in self._ranks.values() for r in ranks.values()),
            *self._windows.values(),
        ]
