"""window.arrow's Arrow schema (one row per rollout seen since the previous step: its outcome, versions,
timeline and tokens), derived from the declarations in schemas/fields.py, and its writer and reader."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from schemas.fields import ROLLOUT_FIELDS, SHARED_TOKEN_ARRAYS, TURN_FIELDS, TURNS_TYPE
from schemas.train_batch import METADATA, check_schema

if TYPE_CHECKING:
    from beam_rl.types import Rollout, RolloutRecord, RolloutTokens

ROLLOUT_RECORD_SCHEMA = pa.schema(
    [pa.field(f.name, f.arrow_type, nullable=f.nullable) for f in ROLLOUT_FIELDS], metadata=METADATA
)

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
            raise ValueError(f"rollout {r.rollout_id}: its record was stored without its token arrays and never "
                             "given them back (BatchBuilder.restore_pending)")
    tokens = _token_columns([r.tokens for r in records])
    columns = [tokens[f.name] if f.source == "tokens" else pa.array([getattr(r, f.attr) for r in records],
                                                                    f.arrow_type)
               for f in ROLLOUT_FIELDS]
    return pa.Table.from_arrays(columns, schema=ROLLOUT_RECORD_SCHEMA)


def table_to_records(table: pa.Table, source: str = "<table>") -> list[RolloutRecord]:
    """The inverse of rollouts_to_table: the window's rows as RolloutRecords with their tokens (copies)."""
    from beam_rl.types import Rollout, RolloutRecord, RolloutStatus, RolloutTokens, Turn  # derived from schemas/

    check_schema(table.schema, ROLLOUT_RECORD_SCHEMA, source)
    stored = [f for f in ROLLOUT_FIELDS if f.source in ("rollout", "record")]
    values = {f.attr: table.column(f.name).to_pylist() for f in stored}
    values["status"] = [RolloutStatus(v) for v in values["status"]]  # the one enum among them
    records = []
    for i, (prompt, turns) in enumerate(zip(table.column("prompt_ids").to_pylist(),
                                            table.column("turns").to_pylist())):
        row = {name: column[i] for name, column in values.items()}
        # A turn's fields are named as Turn's, so the layout is rebuilt by the code that first made it.
        trajectory = Rollout(row["group_id"], row["env_name"], row["attempt"], 0, prompt_ids=prompt or [],
                             turns=[Turn(**turn) for turn in turns or []])
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

    prompt = pa.ListArray.from_arrays(_row_offsets(has, segments[kinds == _PROMPT]),
                                      pa.array(arrays["input_ids"][token_kind == _PROMPT], pa.int32()), mask=missing)
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
        pa.StructArray.from_arrays(children, fields=list(TURNS_TYPE.value_type)), type=TURNS_TYPE, mask=missing)
    return {"prompt_ids": prompt, "turns": turns}


def _kinds(num_turns: int) -> np.ndarray:
    kinds = np.full(1 + 2 * num_turns, _ENV, dtype=np.int8)
    kinds[0], kinds[2::2] = _PROMPT, _COMPLETION
    return kinds


def _concat(parts: list[np.ndarray]) -> np.ndarray:
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
