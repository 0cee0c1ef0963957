"""The commit record's contract (schemas/commit_record.py): typed fields, the version check, the file list."""

from __future__ import annotations

import json

import pytest

from schemas.commit_record import (
    RECORD_VERSION,
    CommitRecord,
    CommitRecordError,
    FileEntry,
    StepCounts,
    WindowStats,
    checksum,
    new_checksum,
)

EMPTY = FileEntry(bytes=0, xxh3_128=checksum(b""))


def record(**changes) -> CommitRecord:
    fields = dict(
        step=4, schema_version=1, committed_at=1700000000.5, group_ids=["e0-i1"], offsets=[("arithmetic", 0, 1)],
        counts=StepCounts(ranks=2, micro_batches=[1, 0], samples=2, tokens=9, trained_tokens=4, groups=1,
                          window_rollouts=2),
        timings={"write_s": 0.01}, files={"rank_0.arrow": EMPTY, "rank_1.arrow": EMPTY, "window.arrow": EMPTY},
        window=WindowStats(rollouts=2, filtered={"gibberish": 1}), extra={"note": [1, "x"]},
    )
    return CommitRecord(**{**fields, **changes})


def test_a_record_round_trips_through_json_with_its_version():
    written = record()
    data = written.to_json()
    assert json.loads(data)["record_version"] == RECORD_VERSION == 1
    assert CommitRecord.from_json(data, "COMMIT.json") == written
    assert json.loads(data)["offsets"] == [["arithmetic", 0, 1]]  # tuples are JSON arrays on disk


def test_the_checksum_is_xxh3_128_in_canonical_hex_and_the_same_fed_piecewise():
    assert checksum(b"") == "99aa06d3014798d86001c324468d497f"  # XXH3-128 of nothing, seed 0
    data = bytes(range(256)) * 1000
    piecewise = new_checksum()
    for start in range(0, len(data), 7000):
        piecewise.update(data[start:start + 7000])
    assert piecewise.hexdigest() == checksum(data) == checksum(memoryview(data))


def test_a_file_entry_names_a_size_or_checksum_mismatch():
    entry = FileEntry(bytes=5, xxh3_128=checksum(b"hello"))
    assert entry.mismatch(b"hello") is None
    assert entry.mismatch(b"hell") == "4 bytes, the commit record says 5 (truncated or overwritten)"
    assert entry.mismatch(b"jello") == (f"xxh3_128 checksum {checksum(b'jello')}, the commit record says "
                                        f"{checksum(b'hello')} (corrupt)")
    assert entry.mismatch(b"jello", verify_checksum=False) is None


@pytest.mark.parametrize("version, says", [
    (2, r"record_version 2 is not supported \(newer than this beam-rl: upgrade it\); this beam-rl reads \[1\]"),
    (0, r"record_version 0 is not supported; this beam-rl reads \[1\]"),
])
def test_a_record_of_another_version_is_refused_before_its_fields_are_read(version, says):
    data = json.dumps({**json.loads(record().to_json()), "record_version": version, "new_field": 1})
    with pytest.raises(CommitRecordError, match=rf"^step_4/COMMIT.json: {says}$"):
        CommitRecord.from_json(data.encode(), "step_4/COMMIT.json")


def test_a_record_without_a_version_is_refused_as_unversioned():
    # What beam-rl wrote before records were versioned: file sizes only, no record_version.
    unversioned = {"step": 1, "schema_version": 1, "committed_at": 1.0, "files": {"rank_0.arrow": 10}}
    says = "no record_version: not a commit record, or one written before commit records were versioned"
    with pytest.raises(CommitRecordError, match=rf"^COMMIT.json: {says}; this beam-rl reads \[1\]$"):
        CommitRecord.from_json(json.dumps(unversioned).encode(), "COMMIT.json")


@pytest.mark.parametrize("change, says", [
    ({"step": "4"}, r"invalid commit record: step: Input should be a valid integer"),  # strict: no coercion
    ({"counts": {"ranks": 2}}, r"invalid commit record: counts.micro_batches: Field required \(and 5 more\)"),
    ({"window": {"rollouts": 2, "a_new_stat": 1}}, r"invalid commit record: window.a_new_stat: Extra inputs"),
    ({"files": {"rank_0.arrow": {"bytes": 0, "xxh3_128": "xyz"}}},
     r"invalid commit record: files.rank_0.arrow.xxh3_128: String should match"),
])
def test_a_record_with_a_wrong_field_is_refused_naming_the_field(change, says):
    data = json.dumps({**json.loads(record().to_json()), **change})
    with pytest.raises(CommitRecordError, match=rf"^COMMIT.json: {says}"):
        CommitRecord.from_json(data.encode(), "COMMIT.json")


def test_the_files_must_be_each_ranks_file_and_the_window():
    with pytest.raises(ValueError, match=r"files \['rank_0.arrow', 'window.arrow'\] are not the 2 rank files"):
        record(files={"rank_0.arrow": EMPTY, "window.arrow": EMPTY})
    with pytest.raises(ValueError, match="counts.micro_batches has 1 entries for 2 ranks"):
        record(counts=StepCounts(ranks=2, micro_batches=[1], samples=0, tokens=0, trained_tokens=0, groups=0,
                                 window_rollouts=0))
