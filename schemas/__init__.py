"""Arrow schemas shared by the run-directory writer and the trainer-side reader (the one source of both),
derived from the field declarations in schemas/fields.py. The leaf of the layering: it imports nothing
of beam-rl, so the converters between these files and the domain's types are beam_rl/rundir/arrow.py's."""

from schemas.fields import ROLLOUT_FIELDS, SAMPLE_FIELDS, TOKEN_FIELDS, TURN_FIELDS
from schemas.train_batch import (
    SCHEMA_VERSION,
    SCHEMA_VERSION_KEY,
    SUPPORTED_SCHEMA_VERSIONS,
    TRAIN_BATCH_SCHEMA,
    SchemaError,
    check_schema,
    check_schema_version,
)
from schemas.window import ROLLOUT_RECORD_SCHEMA

__all__ = [
    "ROLLOUT_FIELDS",
    "ROLLOUT_RECORD_SCHEMA",
    "SAMPLE_FIELDS",
    "SCHEMA_VERSION",
    "SCHEMA_VERSION_KEY",
    "SUPPORTED_SCHEMA_VERSIONS",
    "TOKEN_FIELDS",
    "TRAIN_BATCH_SCHEMA",
    "TURN_FIELDS",
    "SchemaError",
    "check_schema",
    "check_schema_version",
]
