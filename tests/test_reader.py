"""The trainer-side reader: waiting for commits, zero-copy reads of the mapped file, torch, version refusal."""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from beam_rl.reader import StepReader
from beam_rl.rundir import RunDir, StepNotCommittedError
from beam_rl.types import MicroBatch, Sample, TrainBatch
from schemas import TRAIN_BATCH_SCHEMA, SchemaError, samples_to_table
from schemas.commit_record import FileEntry, checksum


def sample(ids, mask, adv, rollout_id, version=1, reward=1.0) -> Sample:
    ids = np.asarray(ids, dtype=np.int32)
    mask = np.asarray(mask, dtype=bool)
    return Sample(
        input_ids=ids,
        loss_mask=mask,
        logprobs=np.where(mask, -0.5, 0.0).astype(np.float32),
        advantages=np.where(mask, adv, 0.0).astype(np.float32),
        temperatures=np.full(len(ids), 0.8, np.float32),
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
    np.testing.assert_array_equal(mb0["policy_versions"], [1, 1])
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
    for name in ("input_ids", "position_ids", "loss_mask", "advantages", "logprobs", "temperatures"):
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


def test_uncommitted_step_and_missing_rank_are_refused(tmp_path):
    run = RunDir(tmp_path)
    with pytest.raises(StepNotCommittedError):
        StepReader(run).read_step(1)
    run.write_step(batch())
    with pytest.raises(ValueError, match="rank 2 requested, step 1 was written for 2 ranks"):
        StepReader(run, rank=2).read_step(1)


def _overwrite_rank_file(run: RunDir, path: Path, schema: pa.Schema, table: pa.Table) -> None:
    """Replace step 1's rank file, and its entry in the commit record, as a writer of that file would."""
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
