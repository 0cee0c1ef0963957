"""Arrow schemas shared by the run-directory writer and the trainer-side reader (the one source of both),
derived from the field declarations in schemas/fields.py."""

from schemas.fields import ROLLOUT_FIELDS, SAMPLE_FIELDS, TOKEN_FIELDS, TURN_FIELDS
from schemas.train_batch import (
    SCHEMA_VERSION,
    SCHEMA_VERSION_KEY,
    SUPPORTED_SCHEMA_VERSIONS,
    TRAIN_BATCH_SCHEMA,
    SchemaError,
    check_schema,
    check_schema_version,
    micro_batch_to_record_batch,
    samples_to_table,
    table_to_micro_batches,
)
from schemas.window import ROLLOUT_RECORD_SCHEMA, rollouts_to_table, table_to_records

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
    "micro_batch_to_record_batch",
    "rollouts_to_table",
    "samples_to_table",
    "table_to_micro_batches",
    "table_to_records",
]
