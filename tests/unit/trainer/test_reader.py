"""The trainer-side reader: waiting for commits, zero-copy reads of the mapped file, torch, version refusal."""

from __future__ import annotations

import gc
import re
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from beam_rl.rundir import CommitRecordError, RunDir, StepCorruptError, StepNotCommittedError
from beam_rl.rundir.arrow import samples_to_table
from beam_rl.trainer.reader import StepReader
from beam_rl.types import MicroBatch, Sample, TrainBatch
from schemas import TOKEN_FIELDS, TRAIN_BATCH_SCHEMA, SchemaError
from schemas.commit_record import FileEntry, checksum
from tests.support.step_damage import FILE_DAMAGE, RECORD_DAMAGE, truncate


def sample(ids, mask, adv, rollout_id, version=1, reward=1.0) -> Sample:
    ids = np.asarray(ids, dtype=np.int32)
    mask = np.asarray(mask, dtype=bool)
    return Sample(
        input_ids=ids,
        loss_mask=mask,
        logprobs=np.where(mask, -0.5, 0.0).astype(np.float32),
        advantages=np.where(mask, adv, 0.0).astype(np.float32),
        temperatures=np.full(len(ids), 0.8, np.float32),
        policy_versions=np.where(mask, version, -1).astype(np.int32),
        rollout_id=rollout_id,
        group_id=rollout_id.split("/")[0],
        policy_version=version,
        reward=reward,
    )


def batch(step: int = 1) -> TrainBatch:
    rank0 = [
        MicroBatch([sample([11, 12, 13], [0, 1, 1], 1.5, "g0/0"), sample([21, 22], [0, 1], -1.5, "g0/1", reward=0.0)]),
        MicroBatch([sample([31, 32, 33, 34], [0, 0, 1, 1], 0.25, "g1/0", version=0)]),
    ]
    rank1 = [MicroBatch([sample([41, 42], [1, 1], -0.25, "g1/1", version=0, reward=0.5)])]
    return TrainBatch(step=step, micro_batches=[rank0, rank1], group_ids=["g0", "g1"], window={})


def test_read_step_gives_exactly_the_written_arrays_per_micro_batch(tmp_path):
    RunDir(tmp_path).write_step(batch())
    mb0, mb1 = StepReader(tmp_path, rank=0).read_step(1)
    np.testing.assert_array_equal(mb0["input_ids"], [11, 12, 13, 21, 22])
    np.testing.assert_array_equal(mb0["position_ids"], [0, 1, 2, 0, 1])
    np.testing.assert_array_equal(mb0["loss_mask"], [False, True, True, False, True])
    np.testing.assert_array_equal(mb0["advantages"], [0.0, 1.5, 1.5, 0.0, -1.5])
    np.testing.assert_array_equal(mb0["logprobs"], [0.0, -0.5, -0.5, 0.0, -0.5])
    np.testing.assert_array_equal(mb0["temperatures"], np.full(5, 0.8, np.float32))
    np.testing.assert_array_equal(mb0["cu_seqlens"], [0, 3, 5])
    np.testing.assert_array_equal(mb0["seq_lens"], [3, 2])
    np.testing.assert_array_equal(mb0["sample_policy_versions"], [1, 1])
    np.testing.assert_array_equal(mb0["policy_versions"], [-1, 1, 1, -1, 1])
    np.testing.assert_array_equal(mb0["rewards"], [1.0, 0.0])
    assert mb0["rollout_ids"] == ["g0/0", "g0/1"] and mb0["group_ids"] == ["g0", "g0"] and mb0["micro_batch"] == 0
    assert (mb0["input_ids"].dtype, mb0["loss_mask"].dtype, mb0["advantages"].dtype) == (np.int32, np.bool_, np.float32)
    np.testing.assert_array_equal(mb1["input_ids"], [31, 32, 33, 34])
    np.testing.assert_array_equal(mb1["position_ids"], [0, 1, 2, 3])
    assert mb1["micro_batch"] == 1 and mb1["rollout_ids"] == ["g1/0"]
    (only,) = StepReader(tmp_path, rank=1).read_step(1)
    np.testing.assert_array_equal(only["input_ids"], [41, 42])
    np.testing.assert_array_equal(only["advantages"], [-0.25, -0.25])


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            ranges.append((start, end))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc to see mappings")
def test_token_arrays_are_read_only_views_into_the_mapped_file(tmp_path):
    run = RunDir(tmp_path)
    run.write_step(batch())
    micro_batches = StepReader(run).read_step(1)
    gc.collect()  # the reader and its file object are gone; the views must keep the mapping alive
    ranges = _mapped_ranges(run.rank_path(1, 0).resolve())
    assert ranges, "rank file is not memory-mapped"
    for name in (f.name for f in TOKEN_FIELDS):
        array = micro_batches[1][name]
        address = array.__array_interface__["data"][0]
        assert any(start <= address < end for start, end in ranges), name
        assert not array.flags.writeable
    np.testing.assert_array_equal(micro_batches[1]["input_ids"], [31, 32, 33, 34])


def test_copy_gives_writable_arrays_with_the_same_values(tmp_path):
    RunDir(tmp_path).write_step(batch())
    (mb,) = StepReader(tmp_path, rank=1).read_step(1, copy=True)
    assert mb["advantages"].flags.writeable
    mb["advantages"] *= 2
    np.testing.assert_array_equal(mb["advantages"], [-0.5, -0.5])


def test_as_torch_gives_tensors_of_the_same_values_and_dtypes(tmp_path):
    torch = pytest.importorskip("torch")
    RunDir(tmp_path).write_step(batch())
    mb0, _ = StepReader(tmp_path).read_step(1, as_torch=True)
    assert mb0["input_ids"].dtype == torch.int32 and mb0["loss_mask"].dtype == torch.bool
    assert mb0["input_ids"].tolist() == [11, 12, 13, 21, 22]
    assert mb0["advantages"][mb0["loss_mask"]].tolist() == [1.5, 1.5, -1.5]
    assert mb0["cu_seqlens"].tolist() == [0, 3, 5] and mb0["rollout_ids"] == ["g0/0", "g0/1"]
    assert mb0["policy_versions"].dtype == torch.int32 and mb0["policy_versions"].tolist() == [-1, 1, 1, -1, 1]
    assert mb0["sample_policy_versions"].tolist() == [1, 1]


def test_uncommitted_step_and_missing_rank_are_refused(tmp_path):
    run = RunDir(tmp_path)
    with pytest.raises(StepNotCommittedError):
        StepReader(run).read_step(1)
    run.write_step(batch())
    with pytest.raises(ValueError, match="rank 2 requested, step 1 was written for 2 ranks"):
        StepReader(run, rank=2).read_step(1)


def _overwrite_rank_file(run: RunDir, path: Path, schema: pa.Schema, table: pa.Table) -> None:
    """Replace a file of step 1, and its entry in the commit record, as a writer of that file would."""
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        writer.write_table(table.replace_schema_metadata(schema.metadata))
    record, data = run.read_commit(1), path.read_bytes()
    files = {**record.files, path.name: FileEntry(bytes=len(data), xxh3_128=checksum(data))}
    run.commit_path(1).write_bytes(record.model_copy(update={"files": files}).to_json())


def test_unknown_schema_version_is_refused_naming_the_file(tmp_path):
    run = RunDir(tmp_path)
    run.write_step(batch())
    path = run.rank_path(1, 0)
    table = samples_to_table(batch().micro_batches[0])
    _overwrite_rank_file(run, path, TRAIN_BATCH_SCHEMA.with_metadata({"beam_rl.schema_version": "99"}), table)
    with pytest.raises(SchemaError, match=rf"{path}: schema version 99 is not supported"):
        StepReader(run).read_step(1)
    _overwrite_rank_file(run, path, TRAIN_BATCH_SCHEMA.remove_metadata(), table)
    with pytest.raises(SchemaError, match=rf"{path}: no beam_rl.schema_version"):
        StepReader(run).read_step(1)


def test_a_version_1_step_is_refused_naming_the_file(tmp_path):
    """Files written before the per-token policy versions and the window's tokens: a clear error, not a
    missing column deep in the reader."""
    run = RunDir(tmp_path)
    run.write_step(batch())
    path = run.rank_path(1, 0)
    v1 = samples_to_table(batch().micro_batches[0]).drop_columns(["policy_versions"])
    _overwrite_rank_file(run, path, v1.schema.with_metadata({"beam_rl.schema_version": "1"}), v1)
    with pytest.raises(SchemaError, match=rf"^{re.escape(str(path))}: schema version 1 is not supported "
                                          r"\(this beam-rl reads \[2, 3\]\); written by an older beam-rl"):
        StepReader(run).read_step(1)
    window = run.window_path(1)
    old = run.read_window(1).select(["rollout_id", "status"])
    _overwrite_rank_file(run, window, old.schema.with_metadata({"beam_rl.schema_version": "1"}), old)
    with pytest.raises(SchemaError, match=rf"^{re.escape(str(window))}: schema version 1 is not supported"):
        run.read_window(1)


def test_a_version_2_step_with_float32_rewards_is_still_read(tmp_path):
    """Version 3 records rewards as float64 (0.1 stays 0.1); files of version 2 held float32 rewards and
    are read as they are, every other column alike."""
    run = RunDir(tmp_path)
    run.write_step(TrainBatch(step=1, micro_batches=[[MicroBatch([sample([1, 2], [0, 1], 1.0, "g/0", reward=0.1)])]],
                              group_ids=["g"], window={}))
    [mb] = StepReader(run).read_step(1, copy=True)  # the file is rewritten below
    assert mb["rewards"].dtype == np.float64 and mb["rewards"][0] == 0.1
    path = run.rank_path(1, 0)
    table = pa.ipc.open_file(pa.py_buffer(path.read_bytes())).read_all()  # not mapped: the file is rewritten
    v2 = table.set_column(table.schema.get_field_index("reward"), "reward", table.column("reward").cast(pa.float32()))
    _overwrite_rank_file(run, path, v2.schema.with_metadata({"beam_rl.schema_version": "2"}), v2)
    [old] = StepReader(run).read_step(1)
    assert old["rewards"].dtype == np.float32 and old["rewards"][0] == np.float32(0.1)
    np.testing.assert_array_equal(old["input_ids"], mb["input_ids"])
    window = run.window_path(1)
    table = pa.ipc.open_file(pa.py_buffer(window.read_bytes())).read_all()
    assert table.schema.field("reward").type == pa.float64()
    float32 = table.schema.field("reward").with_type(pa.float32())
    v2 = table.set_column(table.schema.get_field_index("reward"), float32, table.column("reward").cast(pa.float32()))
    _overwrite_rank_file(run, window, v2.schema.with_metadata({"beam_rl.schema_version": "2"}), v2)
    assert run.read_window(1).num_rows == table.num_rows
    wrong = table.set_column(table.schema.get_field_index("reward"), float32, table.column("reward").cast(pa.float32()))
    _overwrite_rank_file(run, window, wrong.schema.with_metadata({"beam_rl.schema_version": "3"}), wrong)
    with pytest.raises(SchemaError, match=r"column 'reward' is float, expected double"):
        run.read_window(1)


def test_a_record_batch_mixing_micro_batches_is_refused(tmp_path):
    run = RunDir(tmp_path)
    run.write_step(batch())
    merged = samples_to_table(batch().micro_batches[0]).combine_chunks()  # one record batch, two micro-batches
    _overwrite_rank_file(run, run.rank_path(1, 0), TRAIN_BATCH_SCHEMA, merged)
    with pytest.raises(SchemaError, match=r"mixes micro-batches \[0, 1\]"):
        StepReader(run).read_step(1)


def test_wait_for_step_times_out_cleanly(tmp_path):
    with pytest.raises(TimeoutError, match="step 1 not committed within 0.05 s"):
        StepReader(tmp_path).wait_for_step(1, timeout_s=0.05, poll_s=0.01)


def test_wait_for_step_returns_when_another_thread_commits(tmp_path):
    run = RunDir(tmp_path)
    reader = StepReader(run)

    def commit_later():
        time.sleep(0.1)
        run.write_step(batch(1), {"by": "writer thread"})

    writer = threading.Thread(target=commit_later)
    writer.start()
    try:
        commit = reader.wait_for_step(1, timeout_s=30, poll_s=0.01)
    finally:
        writer.join()
    assert commit.step == 1 and commit.extra == {"by": "writer thread"}
    assert [mb["micro_batch"] for mb in reader.read_step(1)] == [0, 1]


def test_iter_steps_yields_each_step_in_order_and_waits_for_the_next(tmp_path):
    run = RunDir(tmp_path)
    run.write_step(batch(1))
    steps = StepReader(run, rank=1).iter_steps(1, end=3, timeout_s=30)
    step, (mb,) = next(steps)
    assert step == 1 and mb["rollout_ids"] == ["g1/1"]
    threading.Timer(0.05, run.write_step, args=(batch(2),)).start()
    step, _ = next(steps)
    assert step == 2
    with pytest.raises(StopIteration):
        next(steps)


# -- damaged steps: every file is checked against the commit record before it is trusted -----------------


@pytest.mark.parametrize("damage", sorted(FILE_DAMAGE))
def test_a_damaged_rank_file_is_a_typed_error_naming_the_step_and_the_file(tmp_path, damage):
    run = RunDir(tmp_path)
    run.write_step(batch())
    damage_file, says = FILE_DAMAGE[damage]
    path = run.rank_path(1, 0)
    damage_file(path)
    with pytest.raises(StepCorruptError, match=rf"^{re.escape(str(path))}: step 1 is corrupt: {says}$") as info:
        StepReader(run, rank=0).read_step(1)
    assert (info.value.step, info.value.file) == (1, path)
    (mb,) = StepReader(run, rank=1).read_step(1)  # the other rank's file is intact and reads
    np.testing.assert_array_equal(mb["input_ids"], [41, 42])


@pytest.mark.parametrize("damage", sorted(FILE_DAMAGE))
def test_a_damaged_window_file_is_refused_too(tmp_path, damage):
    run = RunDir(tmp_path)
    run.write_step(batch())
    damage_file, says = FILE_DAMAGE[damage]
    damage_file(run.window_path(1))
    with pytest.raises(StepCorruptError, match=rf"window.arrow: step 1 is corrupt: {says}$"):
        run.read_window(1)


def test_without_verify_the_size_is_still_checked(tmp_path):
    run = RunDir(tmp_path)
    run.write_step(batch())
    truncate(run.rank_path(1, 0))
    with pytest.raises(StepCorruptError, match="truncated or overwritten"):
        StepReader(run, verify=False).read_step(1)


def test_a_file_arrow_cannot_parse_is_a_step_corrupt_error_not_a_bare_arrow_error(tmp_path):
    run = RunDir(tmp_path)
    run.write_step(batch())
    path = run.rank_path(1, 0)
    data = bytearray(path.read_bytes())
    data[-6:] = b"NOTARR"  # the footer's Arrow magic, same size: unverified, only parsing can tell
    path.write_bytes(bytes(data))
    with pytest.raises(StepCorruptError, match=rf"{re.escape(str(path))}: step 1 is corrupt: not a readable Arrow IPC"):
        StepReader(run, verify=False).read_step(1)
    with pytest.raises(StepCorruptError, match="xxh3_128 checksum"):  # verified, the checksum catches it first
        StepReader(run).read_step(1)


def test_a_file_the_commit_record_does_not_list_is_ignored_by_readers_and_reported(tmp_path):
    run = RunDir(tmp_path)
    run.write_step(batch())
    before = [mb["input_ids"].tolist() for mb in StepReader(run).read_step(1)]
    stray = [run.step_dir(1) / "notes.txt", run.step_dir(1) / "rank_2.arrow"]
    stray[0].write_text("not part of step 1")
    stray[1].write_bytes(run.rank_path(1, 0).read_bytes())  # e.g. a rank file copied in by hand
    assert [mb["input_ids"].tolist() for mb in StepReader(run).read_step(1)] == before
    with pytest.raises(ValueError, match="rank 2 requested, step 1 was written for 2 ranks"):
        StepReader(run, rank=2).read_step(1)  # a stray rank file does not add a rank
    assert run.verify_step(run.read_commit(1)) == stray


@pytest.mark.parametrize("damage", sorted(RECORD_DAMAGE))
def test_a_damaged_commit_record_is_a_typed_error_naming_the_file(tmp_path, damage):
    run = RunDir(tmp_path)
    run.write_step(batch())
    damage_record, says = RECORD_DAMAGE[damage]
    path = run.commit_path(1)
    damage_record(path)
    reader = StepReader(run)
    for read in (lambda: reader.read_step(1), lambda: reader.wait_for_step(1, timeout_s=1), lambda: run.read_window(1)):
        with pytest.raises(CommitRecordError, match=rf"^{re.escape(str(path))}: {says}"):
            read()


def test_a_commit_record_in_the_wrong_step_directory_is_refused(tmp_path):
    run = RunDir(tmp_path)
    run.write_step(batch(1))
    run.write_step(batch(2))
    run.commit_path(2).write_bytes(run.commit_path(1).read_bytes())
    with pytest.raises(CommitRecordError, match=r"step_2/COMMIT.json: the record is of step 1, not 2"):
        StepReader(run).read_step(2)
