"""Turn a scored rollout into flat training samples: exact token ids plus per-token training data.

Works from the ids the server returned, never from text, so what the trainer sees is what was sampled.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from beam_rl.types import Rollout, Sample

_PER_TOKEN = ("input_ids", "loss_mask", "logprobs", "advantages", "temperatures")
_PER_SAMPLE = tuple(f.name for f in dataclasses.fields(Sample) if f.name not in _PER_TOKEN)


def trace_to_samples(rollout: Rollout) -> list[Sample]:
    """One sample per trajectory: prompt, then each turn's environment tokens and completion tokens.

    The loss mask is True only on completion tokens; logprobs and advantages live on those tokens
    and are 0 on context; the temperature is stamped on every token (the trainer rescales logits
    by it everywhere). A rollout with no turns has nothing to train on and yields no sample.
    """
    if not rollout.turns:
        return []
    ids: list[np.ndarray] = [_as_ids(rollout.prompt_ids, rollout, "prompt_ids")]
    mask: list[np.ndarray] = [np.zeros(len(rollout.prompt_ids), dtype=bool)]
    logprobs: list[np.ndarray] = [np.zeros(len(rollout.prompt_ids), dtype=np.float32)]
    for i, turn in enumerate(rollout.turns):
        if len(turn.logprobs) != len(turn.completion_ids):
            raise ValueError(
                f"rollout {rollout.rollout_id} turn {i}: {len(turn.logprobs)} logprobs "
                f"for {len(turn.completion_ids)} completion ids"
            )
        turn_logprobs = _as_logprobs(turn.logprobs, rollout, i)
        ids += [_as_ids(turn.env_ids, rollout, f"turn {i} env_ids"),
                _as_ids(turn.completion_ids, rollout, f"turn {i} completion_ids")]
        mask += [np.zeros(len(turn.env_ids), dtype=bool), np.ones(len(turn.completion_ids), dtype=bool)]
        logprobs += [np.zeros(len(turn.env_ids), dtype=np.float32), turn_logprobs]

    loss_mask = np.concatenate(mask)
    num_tokens = loss_mask.shape[0]
    return [
        Sample(
            input_ids=np.concatenate(ids),
            loss_mask=loss_mask,
            logprobs=np.concatenate(logprobs),
            advantages=np.where(loss_mask, np.float32(rollout.advantage), np.float32(0.0)).astype(np.float32),
            temperatures=np.full(num_tokens, rollout.temperature, dtype=np.float32),
            rollout_id=rollout.rollout_id,
            group_id=rollout.group_id,
            policy_version=rollout.policy_version_start,
            reward=float(rollout.reward),
        )
    ]


def _as_ids(ids: list[int], rollout: Rollout, what: str) -> np.ndarray:
    # numpy raises OverflowError on ids outside int32; rename it so the bad rollout is findable.
    try:
        arr = np.asarray(ids, dtype=np.int32).reshape(-1)
    except (OverflowError, TypeError, ValueError) as exc:
        raise ValueError(f"rollout {rollout.rollout_id}: {what} are not int32 token ids ({exc})") from exc
    if arr.size and arr.min() < 0:
        raise ValueError(f"rollout {rollout.rollout_id}: {what} holds a negative token id {int(arr.min())}")
    return arr


def _as_logprobs(logprobs: list[float], rollout: Rollout, turn: int) -> np.ndarray:
    # A None or NaN logprob means the server response was not what we asked for (logprobs=0 unset):
    # training on it would silently poison the importance ratio.
    try:
        arr = np.asarray(logprobs, dtype=np.float32).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"rollout {rollout.rollout_id} turn {turn}: logprobs are not numbers ({exc})") from exc
    if not np.isfinite(arr).all():
        bad = int(np.flatnonzero(~np.isfinite(arr))[0])
        raise ValueError(f"rollout {rollout.rollout_id} turn {turn}: logprob {bad} is {arr[bad]}")
    return arr


def samples_to_columns(samples: list[Sample]) -> tuple[Any, ...] | None:
    """Samples as columns, to pickle: one array per per-token field (the samples' arrays end to
    end), their lengths, and their other fields as tuples. As 5 arrays rather than 40, a group of 8
    samples pickles ~2x faster and unpickles ~1.5x faster (bench/README.md)."""
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
    return [Sample(**{name: column[start:end] for name, column in zip(_PER_TOKEN, columns)},
                   **dict(zip(_PER_SAMPLE, values)))
            for start, end, values in zip([0, *ends[:-1]], ends, scalars)]
