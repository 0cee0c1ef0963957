"""Tests of beam_rl.envs.datasets: JSONL, Parquet and Hugging Face directories, and their error messages."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import BaseModel, ConfigDict

from beam_rl.envs.datasets import DatasetError, PromptText, load_rows, read_dataset


class QARow(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    question: PromptText
    answer: str


def write_lines(path: Path, *lines: str | bytes) -> Path:
    path.write_bytes(b"".join((line if isinstance(line, bytes) else line.encode()) + b"\n" for line in lines))
    return path


def write_hf_dataset(directory: Path, shards: list[list[dict]]) -> None:
    """The layout `datasets.Dataset.save_to_disk` writes (checked against datasets 5.2): Arrow stream shards."""
    directory.mkdir(parents=True)
    names = []
    for i, rows in enumerate(shards):
        name = f"data-{i:05d}-of-{len(shards):05d}.arrow"
        table = pa.Table.from_pylist(rows)
        with pa.OSFile(str(directory / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        names.append(name)
    state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "0", "_split": None}
    (directory / "state.json").write_text(json.dumps(state))
    (directory / "dataset_info.json").write_text("{}")


# --- JSONL -----------------------------------------------------------------------------------------


def test_jsonl_rows_in_file_order_skipping_blank_lines_and_bom(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "qa.jsonl",
        b"\xef\xbb\xbf" + b'{"question": "1 + 1", "answer": "2"}',
        "",
        '{"question": "2 + 3", "answer": "5", "level": 1}',
        "   ",
    )
    assert load_rows(path, QARow) == [
        {"question": "1 + 1", "answer": "2"},
        {"question": "2 + 3", "answer": "5", "level": 1},  # extra fields are kept
    ]


def test_jsonl_without_row_model_returns_raw_objects(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "raw.jsonl", '{"a": 1}', '{"b": [2, 3]}')
    assert load_rows(path) == [{"a": 1}, {"b": [2, 3]}]


@pytest.mark.parametrize(
    ("line", "field", "fragment"),
    [
        ('{"question": "1 + 1", "answer": "2"', None, "bad JSON"),
        ('{"question": "1 + 1"}', "answer", "missing"),
        ('{"question": "1 + 1", "answer": 2}', "answer", "valid string"),
        ('{"question": "   ", "answer": "2"}', "question", "empty prompt"),
        ('["1 + 1", "2"]', None, "expected a JSON object, got list"),
    ],
)
def test_jsonl_bad_row_names_file_line_and_field(tmp_path: Path, line: str, field: str | None, fragment: str) -> None:
    path = write_lines(tmp_path / "qa.jsonl", '{"question": "1 + 1", "answer": "2"}', "", line)
    with pytest.raises(DatasetError) as info:
        load_rows(path, QARow)
    err = info.value
    assert (err.path, err.line, err.field) == (str(path), 3, field)
    assert str(err).startswith(f"{path}:3: ")
    assert fragment in str(err)
    if field:
        assert f"field {field!r}" in str(err)


def test_jsonl_invalid_utf8_names_the_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "qa.jsonl", '{"question": "a", "answer": "1"}', b'{"question": "\xff", "answer": ""}')
    with pytest.raises(DatasetError, match=r"qa\.jsonl:2: invalid UTF-8 at byte 14"):
        load_rows(path, QARow)


def test_skip_mode_keeps_good_rows_and_reports_bad_ones(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "qa.jsonl",
        '{"question": "1 + 1", "answer": "2"}',
        "not json",
        '{"question": "2 + 2"}',
        '{"question": "3 + 3", "answer": "6"}',
    )
    loaded = read_dataset(path, QARow, bad_rows="skip")
    assert [row["answer"] for row in loaded.rows] == ["2", "6"]
    assert [(e.line, e.field) for e in loaded.skipped] == [(2, None), (3, "answer")]


def test_dataset_without_rows_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="no rows"):
        load_rows(write_lines(tmp_path / "empty.jsonl", ""), QARow)
    with pytest.raises(DatasetError, match=r"no rows \(1 bad rows skipped\)"):
        read_dataset(write_lines(tmp_path / "bad.jsonl", "{}"), QARow, bad_rows="skip")


# --- Parquet and Arrow -----------------------------------------------------------------------------


def test_parquet_rows_and_row_index_in_errors(tmp_path: Path) -> None:
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"question": ["1 + 1", "2 + 2"], "answer": ["2", "4"]}), good)
    assert load_rows(good, QARow) == [{"question": "1 + 1", "answer": "2"}, {"question": "2 + 2", "answer": "4"}]

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"question": ["1 + 1", ""], "answer": ["2", "4"]}), bad)
    with pytest.raises(DatasetError) as info:
        load_rows(bad, QARow)
    assert (info.value.row, info.value.line, info.value.field) == (1, None, "question")
    assert str(info.value) == f"{bad}: row 1: field 'question': empty prompt"


def test_parquet_missing_column_and_wrong_type(tmp_path: Path) -> None:
    no_answer = tmp_path / "no_answer.parquet"
    pq.write_table(pa.table({"question": ["1 + 1"]}), no_answer)
    with pytest.raises(DatasetError, match=r"row 0: field 'answer': missing"):
        load_rows(no_answer, QARow)
    int_answer = tmp_path / "int_answer.parquet"
    pq.write_table(pa.table({"question": ["1 + 1"], "answer": [2]}), int_answer)
    with pytest.raises(DatasetError, match=r"row 0: field 'answer': Input should be a valid string \(got 2\)"):
        load_rows(int_answer, QARow)


def test_corrupt_parquet_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.parquet"
    path.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DatasetError, match=r"corrupt\.parquet: unreadable Parquet file"):
        load_rows(path)


def test_hugging_face_dataset_directory_reads_shards_in_order(tmp_path: Path) -> None:
    write_hf_dataset(
        tmp_path / "ds",
        [[{"question": "a", "answer": "1"}, {"question": "b", "answer": "2"}], [{"question": "c", "answer": "3"}]],
    )
    assert [row["question"] for row in load_rows(tmp_path / "ds", QARow)] == ["a", "b", "c"]


def test_hugging_face_dataset_dict_selects_split(tmp_path: Path) -> None:
    root = tmp_path / "dd"
    write_hf_dataset(root / "train", [[{"question": "a", "answer": "1"}]])
    write_hf_dataset(root / "eval", [[{"question": "z", "answer": "9"}, {"question": "", "answer": "0"}]])
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "eval"]}))
    assert load_rows(root, QARow, split="train") == [{"question": "a", "answer": "1"}]
    with pytest.raises(DatasetError) as info:
        load_rows(root, QARow, split="eval")
    assert (info.value.path, info.value.row, info.value.field) == (str(root / "eval"), 1, "question")
    with pytest.raises(DatasetError, match=r"has no split 'test' \(splits: \['train', 'eval'\]\)"):
        load_rows(root, QARow, split="test")


def test_hugging_face_dataset_with_missing_shard(tmp_path: Path) -> None:
    write_hf_dataset(tmp_path / "ds", [[{"question": "a", "answer": "1"}]])
    (tmp_path / "ds" / "data-00000-of-00001.arrow").unlink()
    with pytest.raises(DatasetError, match=r"data-00000-of-00001\.arrow: missing \(listed in state\.json\)"):
        load_rows(tmp_path / "ds")


def test_arrow_ipc_file_format(tmp_path: Path) -> None:
    path = tmp_path / "rows.arrow"
    table = pa.table({"question": ["q"], "answer": ["1"]})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    assert load_rows(path, QARow) == [{"question": "q", "answer": "1"}]


# --- Locating a split ------------------------------------------------------------------------------


def test_directory_of_split_files(tmp_path: Path) -> None:
    write_lines(tmp_path / "train.jsonl", '{"question": "t", "answer": "1"}')
    pq.write_table(pa.table({"question": ["e"], "answer": ["2"]}), tmp_path / "eval.parquet")
    assert load_rows(tmp_path, QARow, split="train") == [{"question": "t", "answer": "1"}]
    assert load_rows(tmp_path, QARow, split="eval") == [{"question": "e", "answer": "2"}]
    with pytest.raises(DatasetError, match=r"split 'test' is missing: expected exactly one of test\.jsonl, test\.parq"):
        load_rows(tmp_path, QARow, split="test")
    with pytest.raises(DatasetError, match="is a directory: name the split"):
        load_rows(tmp_path, QARow)
    pq.write_table(pa.table({"question": ["t"], "answer": ["1"]}), tmp_path / "train.parquet")
    with pytest.raises(DatasetError, match=r"split 'train' is ambiguous"):
        load_rows(tmp_path, QARow, split="train")


def test_split_of_a_single_file_is_refused(tmp_path: Path) -> None:
    # A file has no splits: reading it for "eval" would silently evaluate on the training rows.
    path = write_lines(tmp_path / "qa.jsonl", '{"question": "q", "answer": "1"}')
    with pytest.raises(DatasetError, match="is a single file"):
        load_rows(path, QARow, split="eval")


def test_missing_path_and_unknown_format(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"nope\.jsonl: no such file or directory"):
        load_rows(tmp_path / "nope.jsonl")
    path = tmp_path / "rows.csv"
    path.write_text("question,answer\nq,1\n")
    with pytest.raises(DatasetError, match=r"rows\.csv: unknown dataset format"):
        load_rows(path)
