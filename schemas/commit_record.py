"""The commit record (COMMIT.json): the versioned contract that a step exists and what it holds, the JSON
counterpart of the Arrow schemas in train_batch.py."""

from __future__ import annotations

import builtins
from typing import Any, Literal

import xxhash
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, ValidationError, model_validator

from schemas.train_batch import SchemaError

# Bump on any change to the fields below: a reader refuses a record newer than it knows, so a field it
# would silently drop can never be lost.
RECORD_VERSION = 1
SUPPORTED_RECORD_VERSIONS = frozenset({1})

WINDOW_FILE = "window.arrow"

Offset = tuple[str, int, int]  # (env, epoch, index): one prompt of one epoch, the unit the source resumes by

# No coercion, no unknown keys, and only finite floats: JSON has no NaN, pydantic would write it as null.
_STRICT = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)


def rank_file_name(rank: int) -> str:
    return f"rank_{rank}.arrow"


class CommitRecordError(SchemaError):
    """A COMMIT.json this beam-rl cannot read: unreadable, not JSON, not a valid commit record, or written
    with a newer record_version. The message starts with the file's path."""


def checksum(data: bytes | memoryview | Any) -> str:
    """XXH3-128 (seed 0) of a bytes-like object (bytes, memoryview, pyarrow Buffer), as 32 hex digits in
    xxHash's canonical big-endian order."""
    return xxhash.xxh3_128(data).hexdigest()


def new_checksum() -> xxhash.xxh3_128:
    """The same checksum, fed piecewise (`update(data)`, then `hexdigest()`) while a file is written."""
    return xxhash.xxh3_128()


class FileEntry(BaseModel):
    """One file of a committed step: its size in bytes and its XXH3-128 checksum.

    XXH3-128, not sha256: the checksum guards against torn and bit-flipped files, not against an attacker,
    and sha256 costs about as much as the write it guards. Hashing 64 MiB took 52-127 ms with sha256
    (hashlib, SHA-NI) and 7-21 ms with XXH3-128, next to 72-144 ms to write and fsync the same bytes
    (bench/cost/verify_cost.py, eight runs on a shared 2-core machine): sha256 would add 50-130% to writing
    a step's files, and as much again to every verified read of them; XXH3-128 adds 9-16%.
    """

    model_config = _STRICT

    bytes: NonNegativeInt
    xxh3_128: str = Field(pattern=r"^[0-9a-f]{32}$")

    def mismatch(self, data: builtins.bytes | memoryview | Any, verify_checksum: bool = True) -> str | None:
        """What is wrong with `data` as this file (a torn or a corrupt copy), or None if it matches.
        The size is always compared; the checksum only with `verify_checksum`."""
        size = memoryview(data).nbytes
        if size != self.bytes:
            return f"{size} bytes, the commit record says {self.bytes} (truncated or overwritten)"
        if not verify_checksum:
            return None
        digest = checksum(data)
        if digest != self.xxh3_128:
            return f"xxh3_128 checksum {digest}, the commit record says {self.xxh3_128} (corrupt)"
        return None


class StepCounts(BaseModel):
    """How much the step holds, counted by the writer."""

    model_config = _STRICT

    ranks: NonNegativeInt  # data-parallel ranks: rank_0.arrow .. rank_<ranks-1>.arrow
    micro_batches: list[NonNegativeInt]  # per rank
    samples: NonNegativeInt
    tokens: NonNegativeInt
    trained_tokens: NonNegativeInt  # loss_mask set
    groups: NonNegativeInt
    window_rollouts: NonNegativeInt  # rows of window.arrow


class WindowStats(BaseModel):
    """Statistics of the observation window (every rollout since the previous step), as the packer
    computed them (beam_rl/packing/batches.py); window.arrow holds the rollouts themselves.

    A typed model, not a free dict: every stat a reader may look up is declared here, and a new one
    needs a new record_version. Every field defaults to "nothing observed" because writers that compute
    no stats (benchmarks, tests, a trainer's own tools) commit none. The maps keyed by rollout status or
    filter name stay dicts: filters are a registry, so their names are open-ended.
    """

    model_config = _STRICT

    step: int | None = None
    rollouts: NonNegativeInt = 0
    status: dict[str, NonNegativeInt] = {}  # RolloutStatus value -> rollouts
    errored: NonNegativeInt = 0
    filtered: dict[str, NonNegativeInt] = {}  # filter name -> rollouts it kept from training
    flagged: dict[Literal["monitored", "enforced"], dict[str, NonNegativeInt]] = {}
    trained_rollouts: NonNegativeInt = 0
    reward_mean: float | None = None  # over ok rollouts
    completion_tokens_mean: float | None = None
    policy_version_min: int | None = None
    policy_version_max: int | None = None
    staleness_max: int | None = None  # (step - 1) - the oldest token's policy version in the window
    samples: NonNegativeInt = 0
    tokens: NonNegativeInt = 0
    micro_batches: list[NonNegativeInt] = []  # per rank
    group_ids: list[str] = []  # every group seen in the window, trained or not
    # Generated tokens by what became of them (goodput, beam_rl/packing/goodput.py): trained, stale, server_failure,
    # cancelled, errored, reward_error, filtered/<filter>; each counted once, in the step that decided it.
    tokens_by_fate: dict[str, NonNegativeInt] = {}


class CommitRecord(BaseModel):
    """COMMIT.json of rollouts/step_<step>/, written last: the step exists once it does.

    `files` lists every file the step commits (each rank's file and window.arrow) with its size and
    checksum; a reader verifies a file against it before trusting it. Files in the step directory that
    are not listed are not part of the step. `schema_version` is the Arrow files' schema version,
    `record_version` this record's own.
    """

    model_config = _STRICT

    record_version: int = RECORD_VERSION
    step: NonNegativeInt
    schema_version: int
    committed_at: float  # Unix time
    group_ids: list[str]  # the groups trained on, in packing order
    offsets: list[Offset]  # the prompts consumed, sorted: a resumed source skips exactly these
    counts: StepCounts
    timings: dict[str, float]  # seconds; write_s always, others as the caller measured them
    files: dict[str, FileEntry]
    window: WindowStats
    extra: dict[str, Any]  # the caller's own keys, JSON values (a NaN or an infinity is written as null)

    @model_validator(mode="after")
    def _lists_every_file_it_counts(self) -> CommitRecord:
        expected = {rank_file_name(rank) for rank in range(self.counts.ranks)} | {WINDOW_FILE}
        if set(self.files) != expected:
            raise ValueError(
                f"files {sorted(self.files)} are not the {self.counts.ranks} rank files and "
                f"{WINDOW_FILE} (expected {sorted(expected)})"
            )
        if len(self.counts.micro_batches) != self.counts.ranks:
            raise ValueError(
                f"counts.micro_batches has {len(self.counts.micro_batches)} entries for {self.counts.ranks} ranks"
            )
        return self

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_json(cls, data: bytes, source: str) -> CommitRecord:
        """Parse COMMIT.json's bytes; CommitRecordError naming `source` on anything it cannot read."""
        try:
            version = _Versioned.model_validate_json(data).record_version
        except ValidationError as err:
            if [e["type"] for e in err.errors()] == ["missing"]:
                raise CommitRecordError(
                    f"{source}: no record_version: not a commit record, or one written before commit records "
                    f"were versioned; this beam-rl reads {sorted(SUPPORTED_RECORD_VERSIONS)}"
                ) from None
            raise CommitRecordError(f"{source}: not a commit record: {first_error(err)}") from None
        if version not in SUPPORTED_RECORD_VERSIONS:
            newer = " (newer than this beam-rl: upgrade it)" if version > max(SUPPORTED_RECORD_VERSIONS) else ""
            raise CommitRecordError(
                f"{source}: record_version {version} is not supported{newer}; "
                f"this beam-rl reads {sorted(SUPPORTED_RECORD_VERSIONS)}"
            )
        try:
            return cls.model_validate_json(data)
        except ValidationError as err:
            raise CommitRecordError(f"{source}: invalid commit record: {first_error(err)}") from None


class _Versioned(BaseModel):
    """Only the version, read before the rest so a newer record fails on its version, not on a field."""

    model_config = ConfigDict(strict=True, extra="ignore")

    record_version: int


def first_error(err: ValidationError) -> str:
    """A pydantic error in one line: where (dotted) and what, and how many more there are."""
    first = err.errors(include_url=False)[0]
    where = ".".join(str(part) for part in first["loc"])
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{where + ': ' if where else ''}{first['msg']}{more}"
