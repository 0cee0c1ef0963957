"""Versioned Arrow schemas of the run directory: train-batch rows (one per sample) and rollout records."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from beam_rl.types import MicroBatch, Rollout, Sample

SCHEMA_VERSION = 1
SCHEMA_VERSION_KEY = b"beam_rl.schema_version"
SUPPORTED_SCHEMA_VERSIONS = frozenset({1})

_METADATA = {SCHEMA_VERSION_KEY: str(SCHEMA_VERSION).encode()}

# Per-token columns (list<...>) and their numpy dtype on both sides of the file.
TOKEN_COLUMNS: dict[str, np.dtype] = {
    "input_ids": np.dtype(np.int32),
    "position_ids": np.dtype(np.int32),
    "loss_mask": np.dtype(np.uint8),
    "advantages": np.dtype(np.float32),
    "logprobs": np.dtype(np.float32),
    "temperatures": np.dtype(np.float32),
}

# One row per sample. File contract: a rank file holds one record batch per micro-batch, in order, so a
# trainer can fetch micro-batch i with `get_batch(i)` without reading the rest. `loss_mask` is uint8
# (0/1), not Arrow bool: bools are bit-packed and could not be memory-mapped as a numpy array.
TRAIN_BATCH_SCHEMA = pa.schema(
    [
        pa.field("micro_batch", pa.int32(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("position_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.uint8()), nullable=False),
        pa.field("advantages", pa.list_(pa.float32()), nullable=False),
        pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("temperatures", pa.list_(pa.float32()), nullable=False),
        pa.field("seq_len", pa.int32(), nullable=False),
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("policy_version", pa.int32(), nullable=False),
        pa.field("reward", pa.float32(), nullable=False),
    ],
    metadata=_METADATA,
)

ROLLOUT_RECORD_SCHEMA = pa.schema(
    [
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("env", pa.string(), nullable=False),
        pa.field("epoch", pa.int32(), nullable=False),
        pa.field("index", pa.int64(), nullable=False),
        pa.field("attempt", pa.int32(), nullable=False),
        pa.field("is_eval", pa.bool_(), nullable=False),
        pa.field("status", pa.string(), nullable=False),
        pa.field("reward", pa.float32(), nullable=False),
        pa.field("advantage", pa.float32(), nullable=False),
        pa.field("filtered", pa.string(), nullable=True),  # the filter that flagged it; null = clean
        pa.field("num_turns", pa.int32(), nullable=False),
        pa.field("completion_tokens", pa.int32(), nullable=False),
        pa.field("truncated", pa.bool_(), nullable=False),
        pa.field("policy_version_start", pa.int32(), nullable=False),
        pa.field("policy_version_end", pa.int32(), nullable=False),
        pa.field("server", pa.string(), nullable=True),
        pa.field("errors", pa.list_(pa.string()), nullable=False),
        pa.field("t_start", pa.float64(), nullable=False),
        pa.field("t_end", pa.float64(), nullable=False),
    ],
    metadata=_METADATA,
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
        raise SchemaError(
            f"{source}: schema version {version} is not supported "
            f"(this beam-rl reads {sorted(SUPPORTED_SCHEMA_VERSIONS)}); "
            "upgrade the reader or rewrite the run with a matching beam-rl"
        )
    return version


def check_schema(schema: pa.Schema, expected: pa.Schema, source: str = "<schema>") -> None:
    """Version check plus column check, so a file of the wrong kind fails with the missing column named."""
    check_schema_version(schema, source)
    for field in expected:
        if field.name not in schema.names:
            raise SchemaError(f"{source}: missing column {field.name!r}")
        actual = schema.field(field.name).type
        if actual != field.type:
            raise SchemaError(f"{source}: column {field.name!r} is {actual}, expected {field.type}")


def micro_batch_to_record_batch(index: int, micro_batch: MicroBatch) -> pa.RecordBatch:
    """One micro-batch as one record batch (a row per sample), built with one concatenate per column."""
    samples = micro_batch.samples
    lengths = np.fromiter((len(s) for s in samples), dtype=np.int64, count=len(samples))
    offsets = np.zeros(len(samples) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    for s in samples:
        _check_sample(s)

    def token_column(name: str, dtype: np.dtype, flat: np.ndarray | None = None) -> pa.Array:
        if flat is None:
            # A mask given as ints must still land as 0/1, or the reader's bool view would lie.
            as_dtype = np.bool_ if name == "loss_mask" else dtype
            parts = [np.asarray(getattr(s, name), dtype=as_dtype) for s in samples]
            flat = np.concatenate(parts) if parts else np.empty(0, dtype)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.astype(dtype, copy=False)))

    # Positions restart at 0 on every sample: global index minus the start offset of its sample.
    positions = np.arange(offsets[-1], dtype=np.int32) - np.repeat(offsets[:-1], lengths)
    n = len(samples)
    columns = {
        "micro_batch": pa.array(np.full(n, index, dtype=np.int32)),
        "input_ids": token_column("input_ids", TOKEN_COLUMNS["input_ids"]),
        "position_ids": token_column("position_ids", TOKEN_COLUMNS["position_ids"], positions),
        "loss_mask": token_column("loss_mask", TOKEN_COLUMNS["loss_mask"]),
        "advantages": token_column("advantages", TOKEN_COLUMNS["advantages"]),
        "logprobs": token_column("logprobs", TOKEN_COLUMNS["logprobs"]),
        "temperatures": token_column("temperatures", TOKEN_COLUMNS["temperatures"]),
        "seq_len": pa.array(lengths.astype(np.int32)),
        "rollout_id": pa.array([s.rollout_id for s in samples], pa.string()),
        "group_id": pa.array([s.group_id for s in samples], pa.string()),
        "policy_version": pa.array(np.fromiter((s.policy_version for s in samples), np.int32, n)),
        "reward": pa.array(np.fromiter((s.reward for s in samples), np.float32, n)),
    }
    return pa.RecordBatch.from_arrays(list(columns.values()), schema=TRAIN_BATCH_SCHEMA)


def samples_to_table(micro_batches: Sequence[MicroBatch]) -> pa.Table:
    """All micro-batches of one rank as a table whose chunks are the micro-batches, in order."""
    batches = [micro_batch_to_record_batch(i, mb) for i, mb in enumerate(micro_batches)]
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
    for name, dtype in TOKEN_COLUMNS.items():
        column = table.column(name)
        list_array = column.chunk(0) if column.num_chunks else pa.array([], column.type)
        if not np.array_equal(np.diff(list_array.offsets.to_numpy()), seq_len):
            raise SchemaError(f"{source}: column {name!r} disagrees with seq_len on some row's token count")
        flat[name] = list_array.flatten().to_numpy().astype(dtype, copy=False)
    rollout_ids = table.column("rollout_id").to_pylist()
    group_ids = table.column("group_id").to_pylist()
    versions = table.column("policy_version").to_numpy()
    rewards = table.column("reward").to_numpy()
    by_index: dict[int, list[Sample]] = {}
    for row in np.argsort(mb_index, kind="stable"):
        start, end = offsets[row], offsets[row + 1]
        by_index.setdefault(int(mb_index[row]), []).append(
            Sample(
                input_ids=flat["input_ids"][start:end],
                loss_mask=flat["loss_mask"][start:end].view(np.bool_),
                logprobs=flat["logprobs"][start:end],
                advantages=flat["advantages"][start:end],
                temperatures=flat["temperatures"][start:end],
                rollout_id=rollout_ids[row],
                group_id=group_ids[row],
                policy_version=int(versions[row]),
                reward=float(rewards[row]),
            )
        )
    return [MicroBatch(by_index[i]) for i in sorted(by_index)]


def rollouts_to_table(rollouts: Sequence[Rollout]) -> pa.Table:
    """The observation window: one record per rollout, errored and filtered ones included."""
    columns = {
        "rollout_id": [r.rollout_id for r in rollouts],
        "group_id": [r.group_id for r in rollouts],
        "env": [r.env_name for r in rollouts],
        "epoch": [r.epoch for r in rollouts],
        "index": [r.index for r in rollouts],
        "attempt": [r.attempt for r in rollouts],
        "is_eval": [r.is_eval for r in rollouts],
        "status": [r.status.value for r in rollouts],
        "reward": [r.reward for r in rollouts],
        "advantage": [r.advantage for r in rollouts],
        "filtered": [r.filtered for r in rollouts],
        "num_turns": [r.num_turns for r in rollouts],
        "completion_tokens": [r.completion_tokens for r in rollouts],
        "truncated": [r.truncated for r in rollouts],
        "policy_version_start": [r.policy_version_start for r in rollouts],
        "policy_version_end": [r.policy_version_end for r in rollouts],
        "server": [r.server for r in rollouts],
        "errors": [list(r.errors) for r in rollouts],
        "t_start": [r.t_start for r in rollouts],
        "t_end": [r.t_end for r in rollouts],
    }
    return pa.Table.from_pydict(columns, schema=ROLLOUT_RECORD_SCHEMA)


def _check_sample(sample: Sample) -> None:
    n = len(sample)
    for name in ("loss_mask", "logprobs", "advantages", "temperatures"):
        if np.shape(getattr(sample, name)) != (n,):
            raise ValueError(
                f"sample {sample.rollout_id}: {name} has shape {np.shape(getattr(sample, name))}, input_ids has ({n},)"
            )
