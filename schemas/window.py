"""window.arrow's Arrow schema (one row per rollout seen since the previous step: its outcome, versions,
timeline and tokens), derived from the declarations in schemas/fields.py. Its writer and reader, from
and to the domain's rollouts, are beam_rl/rundir/arrow.py's."""

from __future__ import annotations

import pyarrow as pa

from schemas.fields import ROLLOUT_FIELDS
from schemas.train_batch import METADATA

ROLLOUT_RECORD_SCHEMA = pa.schema(
    [pa.field(f.name, f.arrow_type, nullable=f.nullable) for f in ROLLOUT_FIELDS], metadata=METADATA
)
