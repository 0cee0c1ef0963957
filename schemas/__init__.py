"""Arrow schemas shared by the run-directory writer and the trainer-side reader (the one source of both)."""

from schemas.train_batch import (
    ROLLOUT_RECORD_SCHEMA,
    SCHEMA_VERSION,
    SCHEMA_VERSION_KEY,
    SUPPORTED_SCHEMA_VERSIONS,
    TOKEN_COLUMNS,
    TRAIN_BATCH_SCHEMA,
    SchemaError,
    check_schema,
    check_schema_version,
    micro_batch_to_record_batch,
    rollouts_to_table,
    samples_to_table,
    table_to_micro_batches,
)

__all__ = [
    "ROLLOUT_RECORD_SCHEMA",
    "SCHEMA_VERSION",
    "SCHEMA_VERSION_KEY",
    "SUPPORTED_SCHEMA_VERSIONS",
    "TOKEN_COLUMNS",
    "TRAIN_BATCH_SCHEMA",
    "SchemaError",
    "check_schema",
    "check_schema_version",
    "micro_batch_to_record_batch",
    "rollouts_to_table",
    "samples_to_table",
    "table_to_micro_batches",
]
