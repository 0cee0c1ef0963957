"""Turn a scored rollout into flat training samples: exact token ids plus per-token training data.

Works from the ids the server returned, never from text, so what the trainer sees is what was sampled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from beam_rl.types import Rollout, RolloutRecord, RolloutTokens, Sample
from schemas.fields import SAMPLE_TOKEN_FIELDS, SHARED_TOKEN_ARRAYS

_PER_TOKEN = tuple(f.name for f in SAMPLE_TOKEN_FIELDS)
_PER_SAMPLE = tuple(f.name for f in dataclasses.fields(Sample) if f.name not in _PER_TOKEN)


def trace_to_samples(rollout: Rollout) -> list[Sample]:
    """One sample per trajectory: prompt, then each turn's environment tokens and completion tokens.

    The loss mask is True only on completion tokens; logprobs, advantages and policy versions live on
    those tokens and are 0 (versions -1) on context; the temperature is stamped on every token (the
    trainer rescales logits by it everywhere). A rollout with no turns has nothing to train on and
    yields no sample.
    """
    if not rollout.turns:
        return []
    tokens = rollout.tokens()
    _check_finite(tokens, rollout)
    loss_mask = tokens.loss_mask()
    return [
        Sample(
            input_ids=tokens.input_ids,
            loss_mask=loss_mask,
            logprobs=tokens.logprobs,
            advantages=np.where(loss_mask, np.float32(rollout.advantage), np.float32(0.0)).astype(np.float32),
            temperatures=np.full(len(loss_mask), rollout.temperature, dtype=np.float32),
            policy_versions=tokens.policy_versions,
            rollout_id=rollout.rollout_id,
            group_id=rollout.group_id,
            policy_version=rollout.policy_version_start,
            reward=float(rollout.reward),
        )
    ]


def _check_finite(tokens: RolloutTokens, rollout: Rollout) -> None:
    # A None or NaN logprob means the server response was not what we asked for (logprobs=0 unset):
    # training on it would silently poison the importance ratio.
    logprobs = tokens.logprobs
    assert logprobs is not None  # a rollout's own tokens hold their arrays
    bad = np.flatnonzero(~np.isfinite(logprobs))
    if bad.size:
        starts = np.cumsum(tokens.segments)[1::2]  # where each turn's completion starts
        turn = int(np.searchsorted(starts, bad[0], side="right")) - 1
        raise ValueError(
            f"rollout {rollout.rollout_id} turn {turn}: logprob {int(bad[0] - starts[turn])} is {logprobs[bad[0]]}"
        )


def share_sample_tokens(records: Sequence[RolloutRecord], samples: Iterable[Sample]) -> None:
    """Point each record's token arrays at its sample's (the same values), so a clean rollout's tokens
    are held once; a record stored without them (`without_token_arrays`) gets them back."""
    by_id = {s.rollout_id: s for s in samples}
    for record in records:
        tokens = record.tokens
        if tokens is None:
            continue
        sample = by_id.get(record.rollout_id)
        if sample is None:
            continue
        arrays = {name: getattr(sample, name) for name in SHARED_TOKEN_ARRAYS}
        if all(getattr(tokens, name) is array for name, array in arrays.items()):
            continue  # already shared (a record listed twice, or shared when the group was made)
        if len(sample) != tokens.num_tokens:
            raise ValueError(
                f"rollout {record.rollout_id}: its sample has {len(sample)} tokens, its record {tokens.num_tokens}"
            )
        record.tokens = _copy_with(tokens, arrays)


def without_token_arrays(records: Sequence[RolloutRecord], rollout_ids: set[str]) -> dict[int, RolloutRecord]:
    """Copies of the records of `rollout_ids` without their token arrays (keeping where each turn
    starts), keyed by the original's id(): what to store next to what holds those arrays (the samples,
    a pending group)."""
    stripped = {}
    for record in records:
        if id(record) not in stripped and record.tokens is not None and record.rollout_id in rollout_ids:
            tokens = _copy_with(record.tokens, dict.fromkeys(SHARED_TOKEN_ARRAYS))  # None: left out
            stripped[id(record)] = _copy_with(record, {"tokens": tokens})
    return stripped


def _copy_with(value: Any, changes: dict[str, Any]) -> Any:
    """A shallow copy of a dataclass instance with `changes` made: `dataclasses.replace` without running
    `__init__` again, whose checks the values already passed. It was a third of a scored group's
    pickling between stages (two copies per rollout each way)."""
    copy = object.__new__(type(value))
    copy.__dict__.update(value.__dict__, **changes)
    return copy


def samples_to_columns(samples: list[Sample]) -> tuple[Any, ...] | None:
    """Samples as columns, to pickle: one array per per-token field (the samples' arrays end to
    end), their lengths, and their other fields as tuples. As one array per field rather than one per
    field and sample, a group of 8 samples pickled ~2x faster and unpickled ~1.5x faster (bench/history.md)."""
    if not samples:
        return None
    columns = tuple(np.concatenate([getattr(s, name) for s in samples]) for name in _PER_TOKEN)
    scalars = [tuple(getattr(s, name) for name in _PER_SAMPLE) for s in samples]
    return [len(s) for s in samples], scalars, columns


def samples_from_columns(packed: tuple[Any, ...] | None) -> list[Sample]:
    """The samples `samples_to_columns` packed; their arrays are views into the columns."""
    if packed is None:
        return []
    lengths, scalars, columns = packed
    ends = np.cumsum(lengths).tolist()
    return [
        Sample(
            **{name: column[start:end] for name, column in zip(_PER_TOKEN, columns)}, **dict(zip(_PER_SAMPLE, values))
        )
        for start, end, values in zip([0, *ends[:-1]], ends, scalars)
    ]
