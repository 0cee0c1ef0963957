"""The rank files' Arrow schema (one row per sample, one record batch per micro-batch), derived from the
declarations in schemas/fields.py, and the schema version every run-directory Arrow file carries. The
writer and reader that turn micro-batches into these files and back are beam_rl/rundir/arrow.py's."""

from __future__ import annotations

import pyarrow as pa

from schemas.fields import SAMPLE_FIELDS, TOKEN_FIELDS

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
        remedy = (
            "written by an older beam-rl: read it with the beam-rl that wrote it"
            if older
            else "written by a newer beam-rl: upgrade this one"
        )
        raise SchemaError(
            f"{source}: schema version {version} is not supported "
            f"(this beam-rl reads {sorted(SUPPORTED_SCHEMA_VERSIONS)}); {remedy}"
        )
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
        raise SchemaError(
            f"schema version {version} is not supported (this beam-rl reads {sorted(SUPPORTED_SCHEMA_VERSIONS)})"
        )
    schema = pa.schema(
        [field.with_type(_OLDER_TYPES.get(version, {}).get(field.name, field.type)) for field in table.schema],
        metadata={SCHEMA_VERSION_KEY: str(version).encode()},
    )
    return table.cast(schema)
