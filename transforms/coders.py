"""The coder of beam-rl's domain values between stages: pickle, with a size estimate that does not encode.

Beam's Python SDK measures the byte size of output elements for its PCollection metrics by encoding
a sample of them, and it restarts that sample (whose first 10 elements are always measured) at every
call of a splittable DoFn. The dispatch source checkpoints every fraction of a second, so with the
fallback coder most groups were pickled several times over only to be measured: 5.3 pickles per
scored group and ~10% of the worker's CPU (bench/history.md). Here the estimate is computed from the
value's token counts instead.

Values are registered by type; a PCollection gets this coder when its type hint names one of them
(`PackerItem` stands for the union of what the packer takes, which Beam would give its fallback).
`GroupPart` is a group's rollouts as one value, pickled in one call: Beam would code `list[Rollout]`
one rollout at a time (a part of 8 rollouts of 256 tokens: 45 us a rollout there and back, 33 as one
pickle, which also writes the strings the rollouts share once).
"""

from __future__ import annotations

import pickle
from typing import Any

import apache_beam as beam

from beam_rl.packing.batches import InputExhausted
from beam_rl.rundir.step_parts import FileToWrite
from beam_rl.scoring.group import ScoredGroup
from beam_rl.source import EndOfInput
from beam_rl.types import Rollout, RolloutRecord, Sample, TrainBatch
from schemas.fields import SAMPLE_TOKEN_FIELDS, SHARED_TOKEN_ARRAYS

_ROLLOUT_BYTES = 600  # a pickled Rollout's fields other than its tokens, roughly
_PICKLED_TOKEN_BYTES = 16  # a token of a pickled Rollout: its id, logprob and policy version in Python lists
_RECORD_BYTES = 850  # a pickled RolloutRecord's fields other than its token arrays (their segments included)


class PackerItem:
    """Type hint for the packer's input elements: a `ScoredGroup` or the `EndOfInput` marker."""


class GroupPart:
    """Type hint for what leaves Dispatch for CompleteGroups and Score: some rollouts of one group (a
    `list[Rollout]`, coded as one value), or a shard's `EndOfInput` on its way to the packer."""


class PackerOutput:
    """Type hint for the packer's output elements: a `TrainBatch` or the `InputExhausted` marker."""


class CommitItem:
    """Type hint for what crosses WriteTrainBatches' stages: a file to write, a step's plan, a file written,
    or `InputExhausted`."""


def _sample_bytes(sample: Sample) -> int:
    return sum(getattr(sample, f.name).nbytes for f in SAMPLE_TOKEN_FIELDS)


def _record_bytes(record: RolloutRecord) -> int:
    """A record's fields plus the token arrays it holds itself (a clean one's are its sample's)."""
    arrays = [getattr(record.tokens, name, None) for name in SHARED_TOKEN_ARRAYS] if record.tokens else []
    return _RECORD_BYTES + sum(a.nbytes for a in arrays if a is not None)


def _unshared_bytes(records: list[RolloutRecord], samples: list[Sample]) -> int:
    trained = {s.rollout_id for s in samples}
    return sum(_RECORD_BYTES if r.rollout_id in trained else _record_bytes(r) for r in records)


def estimated_bytes(value: Any) -> int:
    """About the pickled size of a domain value, without pickling it."""
    if isinstance(value, ScoredGroup):
        return sum(map(_sample_bytes, value.samples)) + _unshared_bytes(value.rollouts, value.samples)
    if isinstance(value, Rollout):
        return _ROLLOUT_BYTES + _PICKLED_TOKEN_BYTES * value.num_tokens
    if isinstance(value, RolloutRecord):
        return _record_bytes(value)
    if isinstance(value, list):  # a GroupPart
        return sum(map(estimated_bytes, value))
    if isinstance(value, TrainBatch):
        samples = [s for rank in value.micro_batches for micro in rank for s in micro.samples]
        return sum(map(_sample_bytes, samples)) + _unshared_bytes(value.rollouts, samples)
    if isinstance(value, FileToWrite):
        samples = [s for micro in value.micro_batches for s in micro.samples]
        return sum(map(_sample_bytes, samples)) + sum(map(_record_bytes, value.window))
    return _RECORD_BYTES


class DomainCoder(beam.coders.Coder):
    def encode(self, value: Any) -> bytes:
        return pickle.dumps(value, pickle.HIGHEST_PROTOCOL)

    def decode(self, encoded: bytes) -> Any:
        return pickle.loads(encoded)

    def estimate_size(self, value: Any) -> int:
        return estimated_bytes(value)

    def is_deterministic(self) -> bool:
        return False

    def to_type_hint(self):
        return Any


for _type in (
    Rollout,
    RolloutRecord,
    ScoredGroup,
    TrainBatch,
    EndOfInput,
    InputExhausted,
    GroupPart,
    FileToWrite,
    PackerItem,
    PackerOutput,
    CommitItem,
):
    beam.coders.registry.register_coder(_type, DomainCoder)
