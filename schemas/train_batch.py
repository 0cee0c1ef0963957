"""The rank files' Arrow schema (one row per sample, one record batch per micro-batch), derived from the
declarations in schemas/fields.py, and the schema version every run-directory Arrow file carries."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from schemas.fields import SAMPLE_FIELDS, SAMPLE_TOKEN_FIELDS, TOKEN_FIELDS

if TYPE_CHECKING:
    from beam_rl.types import MicroBatch, Sample

# 2: per-token policy_versions in the rank files; the rollouts' tokens and timeline in window.arrow.
# 3: rewards as float64 in both (version 2 rounded them to float32, so replay could not match the run).
SCHEMA_VERSION = 3
SCHEMA_VERSION_KEY = b"beam_rl.schema_version"
SUPPORTED_SCHEMA_VERSIONS = frozenset({2, 3})

# Columns whose type an older supported version declared otherwise: {version: {column: type}}.
_OLDER_TYPES: dict[int, dict[str, pa.DataType]] = {2: {"reward": pa.float32()}}

METADATA = {SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode()}

# One row per sample: its per-sample columns, then its per-token ones (list<...>). File contract: a rank
# file holds one record batch per micro-batch, in order, so a trainer can fetch micro-batch i with
# `get_batch(i)` without reading the rest.
TRAIN_BATCH_SCHEMA = pa.schema(
    [pa.field(f.name, f.arrow_type, nullable=False) for f in SAMPLE_FIELDS]
    + [pa.field(f.name, pa.list_(f.arrow_type), nullable=False) for f in TOKEN_FIELDS],
    metadata=METADATA,
)


class SchemaError(ValueError):
    """A file whose schema this version of beam-rl cannot read."""


def check_schema_version(schema: pa.Schema, source: str = "<schema>") -> int:
    """The schema's version; raises SchemaError when it is missing or not one this code reads."""
    raw = (schema.metadata or {}).get(SCHEMA_VERSION_KEY)
    if raw is None:
        key = SCHEMA_VERSION_KEY.decode()
        raise SchemaError(f"{source}: no {key} in the Arrow schema metadata; not a beam-rl file")
    try:
        version = int(raw)
    except ValueError:
        raise SchemaError(f"{source}: schema version {raw.decode(errors='replace')!r} is not an integer") from None
    if version not in SUPPORTED_SCHEMA_VERSIONS:
        older = version < min(SUPPORTED_SCHEMA_VERSIONS)
        remedy = ("written by an older beam-rl: read it with the beam-rl that wrote it" if older
                  else "written by a newer beam-rl: upgrade this one")
        raise SchemaError(f"{source}: schema version {version} is not supported "
                          f"(this beam-rl reads {sorted(SUPPORTED_SCHEMA_VERSIONS)}); {remedy}")
    return version


def check_schema(schema: pa.Schema, expected: pa.Schema, source: str = "<schema>") -> None:
    """Version check plus column check, so a file of the wrong kind fails with the missing column named.
    A file of an older supported version may hold a column with the type that version declared."""
    older = _OLDER_TYPES.get(check_schema_version(schema, source), {})
    for field in expected:
        if field.name not in schema.names:
            raise SchemaError(f"{source}: missing column {field.name!r}")
        actual = schema.field(field.name).type
        wanted = older.get(field.name, field.type)
        if actual != wanted:
            raise SchemaError(f"{source}: column {field.name!r} is {actual}, expected {wanted}")


def in_version(table: pa.Table, version: int) -> pa.Table:
    """`table` (of the current version) as a writer of supported `version` laid it out: the columns that
    version typed otherwise cast to its types (float64 to float32 rounds as that writer did), its version
    in the metadata. Replay compares an old run's files with what it wrote."""
    if version == SCHEMA_VERSION:
        return table
    if version not in SUPPORTED_SCHEMA_VERSIONS:
        raise SchemaError(f"schema version {version} is not supported (this beam-rl reads "
                          f"{sorted(SUPPORTED_SCHEMA_VERSIONS)})")
    schema = pa.schema([field.with_type(_OLDER_TYPES.get(version, {}).get(field.name, field.type))
                        for field in table.schema], metadata={SCHEMA_VERSION_KEY: str(version).encode()})
    return table.cast(schema)


def micro_batch_to_record_batch(index: int, micro_batch: MicroBatch) -> pa.RecordBatch:
    """One micro-batch as one record batch (a row per sample), built with one concatenate per column."""
    samples = micro_batch.samples
    for s in samples:
        _check_sample(s)
    lengths = np.fromiter((len(s) for s in samples), dtype=np.int64, count=len(samples))
    offsets = np.zeros(len(samples) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    list_offsets = pa.array(offsets)
    # Positions restart at 0 on every sample: global index minus the start offset of its sample.
    written = {
        "micro_batch": np.full(len(samples), index, dtype=np.int32),
        "seq_len": lengths.astype(np.int32),
        "position_ids": np.arange(offsets[-1], dtype=np.int32) - np.repeat(offsets[:-1], lengths),
    }
    columns = []
    for f in SAMPLE_FIELDS:
        values = written[f.name] if f.written else [getattr(s, f.name) for s in samples]
        columns.append(pa.array(values, f.arrow_type))
    for f in TOKEN_FIELDS:
        if f.written:
            flat = written[f.name]
        else:  # as the declared dtype first: a mask given as ints must still land as 0/1
            parts = [np.asarray(getattr(s, f.name), dtype=f.dtype) for s in samples]
            flat = np.concatenate(parts) if parts else np.empty(0, f.dtype)
        if f.dtype == np.bool_:
            flat = flat.view(np.uint8)
        columns.append(pa.ListArray.from_arrays(list_offsets, pa.array(flat, f.arrow_type)))
    return pa.RecordBatch.from_arrays(columns, schema=TRAIN_BATCH_SCHEMA)


def samples_to_table(micro_batches: Sequence[MicroBatch]) -> pa.Table:
    """All micro-batches of one rank as a table whose chunks are the micro-batches, in order."""
    batches = [micro_batch_to_record_batch(i, mb) for i, mb in enumerate(micro_batches)]
    return pa.Table.from_batches(batches, schema=TRAIN_BATCH_SCHEMA)


def table_to_micro_batches(table: pa.Table, source: str = "<table>") -> list[MicroBatch]:
    """The inverse of samples_to_table: rows grouped by their micro_batch column, in index order."""
    from beam_rl.types import MicroBatch, Sample  # at call time: beam_rl.types derives Sample from schemas/

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
        by_index.setdefault(int(mb_index[row]), []).append(Sample(
            **{name: values[start:end] for name, values in flat.items()},
            **{name: values[row] for name, values in per_sample.items()},
        ))
    return [MicroBatch(by_index[i]) for i in sorted(by_index)]


def _check_sample(sample: Sample) -> None:
    n = len(sample)
    for f in SAMPLE_TOKEN_FIELDS:
        if np.shape(getattr(sample, f.name)) != (n,):
            raise ValueError(f"sample {sample.rollout_id}: {f.name} has shape {np.shape(getattr(sample, f.name))}, "
                             f"input_ids has ({n},)")
