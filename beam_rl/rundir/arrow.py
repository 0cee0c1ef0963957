"""The run directory's Arrow files from the domain's types and back: a rank file from micro-batches of
Samples, window.arrow from rollouts. The files' layout (columns, Arrow schemas, versions) is declared in
schemas/, which imports nothing of beam-rl; the converters, which need the domain's types, live here,
beside the step store that writes and reads the files."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from beam_rl.types import MicroBatch, Rollout, RolloutRecord, RolloutStatus, RolloutTokens, Sample, Turn
from schemas.fields import (
    ROLLOUT_FIELDS,
    SAMPLE_FIELDS,
    SAMPLE_TOKEN_FIELDS,
    SHARED_TOKEN_ARRAYS,
    TOKEN_FIELDS,
    TURN_FIELDS,
    TURNS_TYPE,
)
from schemas.train_batch import TRAIN_BATCH_SCHEMA, SchemaError, check_schema
from schemas.window import ROLLOUT_RECORD_SCHEMA

# -- rank_<R>.arrow: micro-batches of Samples ---------------------------------------------------------


def samples_to_table(micro_batches: Sequence[MicroBatch]) -> pa.Table:
    """All micro-batches of one rank as a table whose chunks are the micro-batches, in order: every column
    built once for the rank (one concatenate each), then sliced per micro-batch, since building a record
    batch per micro-batch took ~15 Arrow calls each (a rank file of 64 micro-batches of 256-token samples built
    3.3x slower, measured against the same file bytes)."""
    samples = [s for mb in micro_batches for s in mb.samples]
    for s in samples:
        _check_sample(s)
    lengths = np.fromiter((len(s) for s in samples), dtype=np.int64, count=len(samples))
    sizes = [len(mb.samples) for mb in micro_batches]
    row_starts = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=row_starts[1:])
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    written = {
        "micro_batch": np.repeat(np.arange(len(sizes), dtype=np.int32), sizes),
        "seq_len": lengths.astype(np.int32),
        "position_ids": np.arange(offsets[-1], dtype=np.int32) - np.repeat(offsets[:-1], lengths).astype(np.int32),
    }
    flat: dict[str, np.ndarray] = {}
    for t in TOKEN_FIELDS:
        if t.written:
            flat[t.name] = written[t.name]
        else:  # as the declared dtype first: a mask given as ints must still land as 0/1
            parts = [np.asarray(getattr(s, t.name), dtype=t.dtype) for s in samples]
            flat[t.name] = np.concatenate(parts) if parts else np.empty(0, t.dtype)
        if t.dtype == np.bool_:
            flat[t.name] = flat[t.name].view(np.uint8)
    values = {f.name: written[f.name] if f.written else [getattr(s, f.name) for s in samples] for f in SAMPLE_FIELDS}
    batches = []
    for start, end in zip(row_starts[:-1].tolist(), row_starts[1:].tolist()):
        # Numpy views, each an Arrow buffer of its own size: an Arrow slice would carry its neighbours'
        # bytes into the file as padding, and the files stay byte for byte what they were.
        first, last = offsets[start], offsets[end]
        list_offsets = pa.array((offsets[start : end + 1] - first).astype(np.int32))
        columns = [pa.array(values[f.name][start:end], f.arrow_type) for f in SAMPLE_FIELDS]
        columns += [
            pa.ListArray.from_arrays(list_offsets, pa.array(flat[t.name][first:last], t.arrow_type))
            for t in TOKEN_FIELDS
        ]
        batches.append(pa.RecordBatch.from_arrays(columns, schema=TRAIN_BATCH_SCHEMA))
    return pa.Table.from_batches(batches, schema=TRAIN_BATCH_SCHEMA)


def table_to_micro_batches(table: pa.Table, source: str = "<table>") -> list[MicroBatch]:
    """The inverse of samples_to_table: rows grouped by their micro_batch column, in index order."""
    check_schema(table.schema, TRAIN_BATCH_SCHEMA, source)
    table = table.combine_chunks()
    mb_index = table.column("micro_batch").to_numpy()
    seq_len = table.column("seq_len").to_numpy()
    offsets = np.zeros(len(seq_len) + 1, dtype=np.int64)
    np.cumsum(seq_len, out=offsets[1:])
    flat: dict[str, np.ndarray] = {}
    for f in SAMPLE_TOKEN_FIELDS:
        column = table.column(f.name)
        list_array = column.chunk(0) if column.num_chunks else pa.array([], column.type)
        if not np.array_equal(np.diff(list_array.offsets.to_numpy()), seq_len):
            raise SchemaError(f"{source}: column {f.name!r} disagrees with seq_len on some row's token count")
        values = list_array.flatten().to_numpy()
        flat[f.name] = values.view(np.bool_) if f.dtype == np.bool_ else values
    per_sample = {f.name: table.column(f.name).to_pylist() for f in SAMPLE_FIELDS if not f.written}
    by_index: dict[int, list[Sample]] = {}
    for row in np.argsort(mb_index, kind="stable"):
        start, end = offsets[row], offsets[row + 1]
        by_index.setdefault(int(mb_index[row]), []).append(
            Sample(
                **{name: values[start:end] for name, values in flat.items()},
                **{name: values[row] for name, values in per_sample.items()},
            )
        )
    return [MicroBatch(by_index[i]) for i in sorted(by_index)]


def _check_sample(sample: Sample) -> None:
    n = len(sample)
    for f in SAMPLE_TOKEN_FIELDS:
        if np.shape(getattr(sample, f.name)) != (n,):
            raise ValueError(
                f"sample {sample.rollout_id}: {f.name} has shape {np.shape(getattr(sample, f.name))}, "
                f"input_ids has ({n},)"
            )


# -- window.arrow: rollouts and their records ---------------------------------------------------------

# Where each token sits in RolloutTokens.segments: the prompt, then per turn its environment tokens and
# its completion tokens.
_PROMPT, _ENV, _COMPLETION = 0, 1, 2
_SEGMENT = {"env": _ENV, "completion": _COMPLETION}


def rollouts_to_table(rollouts: Sequence[Rollout | RolloutRecord]) -> pa.Table:
    """The observation window: one row per rollout, errored and filtered ones included. Token columns
    are built with one concatenation per array over all rollouts, not per rollout."""
    records = [r.record() for r in rollouts]
    for r in records:
        if r.tokens is not None and r.tokens.input_ids is None:
            raise ValueError(
                f"rollout {r.rollout_id}: its record was stored without its token arrays and never "
                "given them back (BatchBuilder.restore_pending)"
            )
    tokens = _token_columns([r.tokens for r in records])
    columns = [
        tokens[f.name] if f.source == "tokens" else pa.array([getattr(r, f.attr) for r in records], f.arrow_type)
        for f in ROLLOUT_FIELDS
    ]
    return pa.Table.from_arrays(columns, schema=ROLLOUT_RECORD_SCHEMA)


def table_to_records(table: pa.Table, source: str = "<table>") -> list[RolloutRecord]:
    """The inverse of rollouts_to_table: the window's rows as RolloutRecords with their tokens (copies)."""
    check_schema(table.schema, ROLLOUT_RECORD_SCHEMA, source)
    stored = [f for f in ROLLOUT_FIELDS if f.source in ("rollout", "record")]
    values = {f.attr: table.column(f.name).to_pylist() for f in stored}
    values["status"] = [RolloutStatus(v) for v in values["status"]]  # the one enum among them
    records = []
    for i, (prompt, turns) in enumerate(zip(table.column("prompt_ids").to_pylist(), table.column("turns").to_pylist())):
        row = {name: column[i] for name, column in values.items()}
        # A turn's fields are named as Turn's, so the layout is rebuilt by the code that first made it.
        trajectory = Rollout(
            row["group_id"],
            row["env_name"],
            row["attempt"],
            0,
            prompt_ids=prompt or [],
            turns=[Turn(**turn) for turn in turns or []],
        )
        tokens = None if prompt is None else RolloutTokens.from_rollout(trajectory)
        records.append(RolloutRecord(**row, tokens=tokens))
    return records


def _token_columns(traces: Sequence[RolloutTokens | None]) -> dict[str, pa.Array]:
    has = np.array([t is not None for t in traces], dtype=bool)
    missing = pa.array(~has)
    known = [t for t in traces if t is not None]
    segments = _concat([t.segments for t in known])
    kinds = _concat([_kinds(t.num_turns) for t in known])  # one per segment
    token_kind = np.repeat(kinds, segments)
    arrays = {name: _concat([getattr(t, name) for t in known]) for name in SHARED_TOKEN_ARRAYS}

    prompt = pa.ListArray.from_arrays(
        _row_offsets(has, segments[kinds == _PROMPT]),
        pa.array(arrays["input_ids"][token_kind == _PROMPT], pa.int32()),
        mask=missing,
    )
    children = []
    for f in TURN_FIELDS:
        if f.segment is None:  # one value per turn
            children.append(pa.array([v for t in known for v in getattr(t, f.source)], f.arrow_type))
        else:
            code = _SEGMENT[f.segment]
            values = pa.array(arrays[f.source][token_kind == code], f.arrow_type)
            children.append(pa.ListArray.from_arrays(_offsets(segments[kinds == code]), values))
    turns = pa.ListArray.from_arrays(
        _row_offsets(has, np.array([t.num_turns for t in known], dtype=np.int64)),
        pa.StructArray.from_arrays(children, fields=list(TURNS_TYPE.value_type)),
        type=TURNS_TYPE,
        mask=missing,
    )
    return {"prompt_ids": prompt, "turns": turns}


def _kinds(num_turns: int) -> np.ndarray:
    kinds = np.full(1 + 2 * num_turns, _ENV, dtype=np.int8)
    kinds[0], kinds[2::2] = _PROMPT, _COMPLETION
    return kinds


def _concat(parts: Sequence[np.ndarray | Sequence[int]]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)


def _offsets(lengths: np.ndarray) -> pa.Array:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.array(offsets)


def _row_offsets(has: np.ndarray, lengths: np.ndarray) -> pa.Array:
    """List offsets over every row, given the lengths of the rows that have tokens (0 for the others)."""
    every = np.zeros(len(has), dtype=np.int64)
    every[has] = lengths
    return _offsets(every)
