"""A run directory's committed steps as one pyarrow dataset, the door polars, duckdb and Hugging Face
`datasets` come in by.

- Only committed steps: each file is checked against its step's commit record (size, and checksum
  unless `verify=False`) and its schema version before it is listed; a step without a record is not.
- The rollouts folder itself is not a dataset: it holds two kinds of Arrow file (rank files and
  windows, with different columns), each step's COMMIT.json, and, until a crashed run is resumed, steps
  without a commit record.
- A snapshot: steps committed after the call are not in it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa

from beam_rl.rundir.steps import StepStore, open_arrow_file
from schemas.commit_record import WINDOW_FILE, CommitRecord, rank_file_name
from schemas.train_batch import TRAIN_BATCH_SCHEMA, check_schema
from schemas.window import ROLLOUT_RECORD_SCHEMA

if TYPE_CHECKING:
    import pyarrow.dataset as ds

# What a dataset of each kind reads: its files' schema, and the columns it adds from where a file lies.
KINDS: dict[str, pa.Schema] = {"window": ROLLOUT_RECORD_SCHEMA, "samples": TRAIN_BATCH_SCHEMA}
_STEP = pa.field("step", pa.int32(), nullable=False)
_RANK = pa.field("rank", pa.int32(), nullable=False)


def committed_dataset(store: StepStore, kind: str = "window", *, verify: bool = True) -> ds.FileSystemDataset:
    """Every committed step's `kind` files as one dataset: "window" (window.arrow, a row per rollout)
    or "samples" (every rank_<R>.arrow, a row per training sample). A `step` column (and, for samples,
    `rank`) comes from where each file lies; older supported schema versions read as the current one."""
    import pyarrow.dataset as ds  # lazily: the orchestrator never builds one
    import pyarrow.fs as fs

    if kind not in KINDS:
        raise ValueError(f"unknown dataset kind {kind!r}; choose one of {', '.join(KINDS)}")
    paths: list[str] = []
    where: list[ds.Expression] = []
    for step in store.committed_steps():
        record = store.read_commit(step)
        for rank, name in _files(kind, record):
            _check_file(store, record, name, KINDS[kind], verify)
            paths.append(str(store.step_dir(step) / name))
            part = ds.field("step") == pa.scalar(step, pa.int32())
            where.append(part if rank is None else part & (ds.field("rank") == pa.scalar(rank, pa.int32())))
    located = [_STEP] if kind == "window" else [_STEP, _RANK]
    schema = pa.schema([*located, *KINDS[kind]], metadata=KINDS[kind].metadata)
    # Memory-mapped: a scan's columns are views of the files' pages, as StepReader's arrays are.
    return ds.FileSystemDataset.from_paths(
        paths, schema=schema, format=ds.IpcFileFormat(), filesystem=fs.LocalFileSystem(use_mmap=True), partitions=where
    )


def _files(kind: str, record: CommitRecord) -> list[tuple[int | None, str]]:
    if kind == "window":
        return [(None, WINDOW_FILE)]
    return [(rank, rank_file_name(rank)) for rank in range(record.counts.ranks)]


def _check_file(store: StepStore, record: CommitRecord, name: str, schema: pa.Schema, verify: bool) -> None:
    """StepCorruptError or SchemaError naming the file, before any reader is handed it."""
    path = store.step_dir(record.step) / name
    data = store.map_committed_file(record, name, verify=verify)
    check_schema(open_arrow_file(record.step, path, data).schema, schema, str(path))
