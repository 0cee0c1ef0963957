"""Prompt datasets from local files: JSONL, Parquet, or a Hugging Face `save_to_disk` directory.

Every row is checked against the environment's row model; a bad row is reported by file, line (JSONL)
or row index (Arrow formats) and field, so a user can fix the file instead of debugging a run.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import AfterValidator, BaseModel, ValidationError
from pydantic_core import PydanticCustomError

BadRows = Literal["fail", "skip"]

# Files written by Hugging Face `datasets` (`Dataset.save_to_disk` / `DatasetDict.save_to_disk`):
# a DatasetDict directory lists its splits here, each split is a Dataset directory whose state file
# names its Arrow shards (IPC *stream* format).
_HF_DICT_FILE = "dataset_dict.json"
_HF_STATE_FILE = "state.json"
_SPLIT_SUFFIXES = (".jsonl", ".parquet")


class DatasetError(ValueError):
    """A dataset that cannot be used; names the file, the line or row, and the field when known."""

    def __init__(
        self,
        path: str | Path,
        message: str,
        *,
        line: int | None = None,
        row: int | None = None,
        field: str | None = None,
    ) -> None:
        self.path = str(path)
        self.line = line  # 1-based line of a JSONL file
        self.row = row  # 0-based row index of a Parquet/Arrow table
        self.field = field
        where = self.path
        if line is not None:
            where += f":{line}"
        elif row is not None:
            where += f": row {row}"
        super().__init__(f"{where}: " + (f"field {field!r}: {message}" if field else message))


def _non_blank(text: str) -> str:
    if not text.strip():
        raise PydanticCustomError("empty_prompt", "empty prompt")
    return text


# A row field that becomes (part of) the prompt: a whitespace-only prompt is a data bug, not a task.
PromptText = Annotated[str, AfterValidator(_non_blank)]


def prompt_fields(row_model: type[BaseModel] | None) -> list[str]:
    """The fields of `row_model` typed PromptText: the ones a prompt is rendered from."""
    if row_model is None:
        return []
    return [
        name
        for name, info in row_model.model_fields.items()
        if any(getattr(m, "func", None) is _non_blank for m in info.metadata)
    ]


@dataclass(frozen=True)
class RowProblem:
    """What a row check (run after the row model) found wrong with a row, e.g. a prompt too long."""

    message: str
    field: str | None = None


# Called with each validated row; None means the row is fine.
RowCheck = Callable[[dict[str, Any]], RowProblem | None]


@dataclass
class LoadedRows:
    """Validated rows in file order, plus the bad rows skipped under `bad_rows="skip"`."""

    rows: list[dict[str, Any]]
    skipped: list[DatasetError] = field(default_factory=list)


def read_dataset(
    path: str | Path,
    row_model: type[BaseModel] | None = None,
    *,
    split: str | None = None,
    bad_rows: BadRows = "fail",
    check: RowCheck | None = None,
) -> LoadedRows:
    """Read and validate every row of a dataset.

    `path` is a `.jsonl`, `.parquet` or `.arrow` file, a Hugging Face `save_to_disk` directory, or a
    directory of splits (`<split>.jsonl` / `<split>.parquet`). `split` picks the split of a directory
    that has several; it is an error on a single file, so train and eval never silently coincide.
    `check` runs on each row that passed `row_model`; a problem it returns makes the row bad, located
    like any other. `bad_rows="fail"` raises the first bad row's DatasetError; "skip" keeps going and
    returns them. Problems with the file itself (missing, unreadable, no rows) always raise.
    """
    if bad_rows not in ("fail", "skip"):
        raise ValueError(f"bad_rows must be 'fail' or 'skip', got {bad_rows!r}")
    source = _resolve(Path(path), split)
    loaded = LoadedRows(rows=[])
    for item in _validated(source, row_model, check):
        if isinstance(item, DatasetError):
            if bad_rows == "fail":
                raise item
            loaded.skipped.append(item)
        else:
            loaded.rows.append(item)
    if not loaded.rows:
        detail = f" ({len(loaded.skipped)} bad rows skipped)" if loaded.skipped else ""
        raise DatasetError(source, f"no rows{detail}")
    return loaded


def load_rows(
    path: str | Path, row_model: type[BaseModel] | None = None, *, split: str | None = None
) -> list[dict[str, Any]]:
    """Every row of a dataset, validated against `row_model`; the first bad row raises DatasetError."""
    return read_dataset(path, row_model, split=split).rows


def _resolve(path: Path, split: str | None) -> Path:
    """The file or Hugging Face dataset directory that holds `split` of `path`."""
    if not path.exists():
        raise DatasetError(path, "no such file or directory")
    if path.is_file():
        if split is not None:
            raise DatasetError(path, f"is a single file, so it has no split {split!r}; pass a directory of splits")
        return path
    if (path / _HF_STATE_FILE).is_file():
        if split is not None:
            raise DatasetError(path, f"is a single Hugging Face dataset without splits; cannot select {split!r}")
        return path
    if split is None:
        raise DatasetError(path, "is a directory: name the split to read")
    if (path / _HF_DICT_FILE).is_file():
        splits = _read_json(path / _HF_DICT_FILE).get("splits", [])
        if split not in splits:
            raise DatasetError(path, f"has no split {split!r} (splits: {splits})")
        return path / split
    candidates = [path / f"{split}{suffix}" for suffix in _SPLIT_SUFFIXES]
    found = [c for c in candidates if c.is_file()]
    if len(found) != 1:
        names = ", ".join(c.name for c in (found or candidates))
        problem = "is ambiguous" if found else "is missing"
        raise DatasetError(path, f"split {split!r} {problem}: expected exactly one of {names}")
    return found[0]


def _validated(
    source: Path, row_model: type[BaseModel] | None, check: RowCheck | None
) -> Iterator[dict[str, Any] | DatasetError]:
    records = _jsonl_records(source) if source.suffix == ".jsonl" and source.is_file() else _table_records(source)
    for where, record in records:
        if isinstance(record, DatasetError):
            yield record
            continue
        if row_model is not None:
            try:
                record = row_model.model_validate(record).model_dump()
            except ValidationError as err:
                yield _row_error(source, where, err)
                continue
        problem = check(record) if check is not None else None
        yield record if problem is None else _located(source, where, problem.message, problem.field)


# A record source yields (location, parsed record or error); location is ("line", n) or ("row", i).
_Where = tuple[str, int]


def _jsonl_records(path: Path) -> Iterator[tuple[_Where, dict[str, Any] | DatasetError]]:
    # Decode line by line so an invalid byte is reported at its line, not as a whole-file failure.
    for number, raw in enumerate(_read_bytes(path).split(b"\n"), start=1):
        where = ("line", number)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            field = _field_with_bad_bytes(raw)
            where_in_line = f"byte {err.start} of the line" + (f" (field {field!r})" if field else "")
            yield where, DatasetError(path, f"invalid UTF-8 at {where_in_line}", line=number)
            continue
        if number == 1:
            text = text.removeprefix("\ufeff")  # a BOM some editors write
        if not text.strip():
            continue  # blank lines (a trailing newline) carry no row
        try:
            record = json.loads(text)
        except json.JSONDecodeError as err:
            yield where, DatasetError(path, f"bad JSON: {err.msg} (column {err.colno})", line=number)
            continue
        if not isinstance(record, dict):
            yield where, DatasetError(path, f"expected a JSON object, got {type(record).__name__}", line=number)
            continue
        yield where, record


def _field_with_bad_bytes(raw: bytes) -> str | None:
    """The top-level field whose value holds the undecodable bytes, when the line is otherwise JSON."""
    try:
        record = json.loads(raw.decode("utf-8", "surrogateescape"))  # bad bytes become lone surrogates
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict):
        return None
    for key, value in record.items():
        if any("\udc80" <= c <= "\udcff" for c in json.dumps([key, value], ensure_ascii=False)):
            return key
    return None


def _table_records(source: Path) -> Iterator[tuple[_Where, dict[str, Any]]]:
    """The rows of a columnar source, numbered from 0 across all its record batches."""
    row = 0
    for path, batches in _record_batches(source):
        try:
            for batch in batches:
                for record in batch.to_pylist():
                    yield ("row", row), record
                    row += 1
        except (pa.ArrowException, OSError) as err:
            raise DatasetError(path, f"unreadable: {err}") from err


def _record_batches(source: Path) -> Iterator[tuple[Path, Iterator[pa.RecordBatch]]]:
    if source.is_dir():
        yield from _hf_shards(source)
    elif source.suffix == ".parquet":
        try:
            yield source, pq.ParquetFile(source).iter_batches()
        except (pa.ArrowException, OSError) as err:
            raise DatasetError(source, f"unreadable Parquet file: {err}") from err
    elif source.suffix == ".arrow":
        yield source, _open_arrow(source)
    else:
        raise DatasetError(source, "unknown dataset format: expected .jsonl, .parquet, .arrow or a directory")


def _hf_shards(directory: Path) -> Iterator[tuple[Path, Iterator[pa.RecordBatch]]]:
    """A `Dataset.save_to_disk` directory: its Arrow shards, in the order state.json lists them."""
    state_path = directory / _HF_STATE_FILE
    shards = [entry.get("filename") for entry in _read_json(state_path).get("_data_files", [])]
    if not shards or not all(isinstance(name, str) for name in shards):
        raise DatasetError(state_path, "lists no Arrow data files ('_data_files')")
    for name in shards:
        shard = directory / name
        if not shard.is_file():
            raise DatasetError(shard, f"missing (listed in {state_path.name})")
        yield shard, _open_arrow(shard)


def _open_arrow(path: Path) -> Iterator[pa.RecordBatch]:
    """The record batches of an Arrow IPC file: stream format (what `datasets` writes) or file format."""
    try:
        return iter(pa.ipc.open_stream(pa.memory_map(str(path))))
    except pa.ArrowInvalid:
        pass
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(path)))
    except (pa.ArrowException, OSError) as err:
        raise DatasetError(path, f"unreadable Arrow file: {err}") from err
    return (reader.get_batch(i) for i in range(reader.num_record_batches))


def _row_error(source: Path, where: _Where, err: ValidationError) -> DatasetError:
    """The first problem of a row, phrased for someone editing the file."""
    problem = err.errors(include_url=False)[0]
    loc = ".".join(str(part) for part in problem["loc"]) or None
    if problem["type"] == "missing":
        message = "missing"
    elif problem["type"] == "empty_prompt":
        message = "empty prompt"
    else:
        message = f"{problem['msg']} (got {problem['input']!r})"
    return _located(source, where, message, loc)


def _located(source: Path, where: _Where, message: str, field: str | None) -> DatasetError:
    kind, number = where
    if kind == "line":
        return DatasetError(source, message, line=number, field=field)
    return DatasetError(source, message, row=number, field=field)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise DatasetError(path, f"unreadable: {err.strerror}") from err


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(_read_bytes(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DatasetError(path, f"bad JSON: {err}") from err
    if not isinstance(value, dict):
        raise DatasetError(path, "expected a JSON object")
    return value
