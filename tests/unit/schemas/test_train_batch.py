"""The rank files' versioned Arrow schema: sample rows per micro-batch, and version checks."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from beam_rl.rundir.arrow import samples_to_table, table_to_micro_batches
from beam_rl.types import MicroBatch, Sample
from schemas import (
    ROLLOUT_RECORD_SCHEMA,
    SCHEMA_VERSION,
    TRAIN_BATCH_SCHEMA,
    SchemaError,
    check_schema,
    check_schema_version,
)
from schemas.fields import SAMPLE_TOKEN_FIELDS


def sample(ids, mask, rollout_id, *, adv=0.5, logprob=-0.25, temp=0.7, group="e0-i0", version=3, reward=1.0,
           token_versions=None):
    n = len(ids)
    return Sample(
        policy_versions=token_versions,
        input_ids=np.asarray(ids, dtype=np.int64),  # int64 on purpose: the writer narrows to int32
        loss_mask=np.asarray(mask, dtype=bool),
        logprobs=np.where(mask, logprob, 0.0).astype(np.float32),
        advantages=np.where(mask, adv, 0.0).astype(np.float32),
        temperatures=np.full(n, temp, dtype=np.float32),
        rollout_id=rollout_id,
        group_id=group,
        policy_version=version,
        reward=reward,
    )


def two_micro_batches() -> list[MicroBatch]:
    return [
        MicroBatch([sample([5, 6, 7], [0, 1, 1], "e0-i0/0"), sample([8, 9], [0, 1], "e0-i0/1", adv=-0.5, reward=0.0)]),
        MicroBatch([sample([1, 2, 3, 4], [0, 0, 1, 1], "e0-i1/0", group="e0-i1", version=2, reward=0.25,
                           token_versions=np.array([-1, -1, 2, 3]))]),
    ]


def test_schema_carries_its_version():
    assert SCHEMA_VERSION == 3
    assert TRAIN_BATCH_SCHEMA.metadata == {b"beam_rl.schema_version": b"3"}
    assert ROLLOUT_RECORD_SCHEMA.metadata == {b"beam_rl.schema_version": b"3"}
    assert TRAIN_BATCH_SCHEMA.field("reward").type == ROLLOUT_RECORD_SCHEMA.field("reward").type == pa.float64()
    assert TRAIN_BATCH_SCHEMA.field("loss_mask").type == pa.list_(pa.uint8())
    assert TRAIN_BATCH_SCHEMA.field("policy_versions").type == pa.list_(pa.int32())


def test_one_row_per_sample_with_positions_restarting_per_sample():
    table = samples_to_table(two_micro_batches())
    assert table.schema == TRAIN_BATCH_SCHEMA and table.schema.metadata == TRAIN_BATCH_SCHEMA.metadata
    rows = table.to_pydict()
    assert rows["micro_batch"] == [0, 0, 1]
    assert rows["input_ids"] == [[5, 6, 7], [8, 9], [1, 2, 3, 4]]
    assert rows["position_ids"] == [[0, 1, 2], [0, 1], [0, 1, 2, 3]]
    assert rows["loss_mask"] == [[0, 1, 1], [0, 1], [0, 0, 1, 1]]
    assert rows["advantages"] == [[0.0, 0.5, 0.5], [0.0, -0.5], [0.0, 0.0, 0.5, 0.5]]
    assert rows["logprobs"] == [[0.0, -0.25, -0.25], [0.0, -0.25], [0.0, 0.0, -0.25, -0.25]]
    assert rows["seq_len"] == [3, 2, 4]
    assert rows["rollout_id"] == ["e0-i0/0", "e0-i0/1", "e0-i1/0"]
    assert rows["group_id"] == ["e0-i0", "e0-i0", "e0-i1"]
    assert rows["policy_version"] == [3, 3, 2]
    assert rows["policy_versions"] == [[-1, -1, -1], [-1, -1], [-1, -1, 2, 3]]  # not given: -1, unknown
    assert rows["reward"] == [1.0, 0.0, 0.25]
    # The file contract: one record batch per micro-batch.
    assert [b.num_rows for b in table.to_batches()] == [2, 1]


def test_a_mask_given_as_ints_is_stored_as_zero_or_one():
    s = sample([1, 2, 3], [0, 1, 1], "r")
    s.loss_mask = np.array([0, 2, 7])
    assert samples_to_table([MicroBatch([s])]).column("loss_mask").to_pylist() == [[0, 1, 1]]


def test_round_trip_gives_back_the_samples():
    written = two_micro_batches()
    read = table_to_micro_batches(samples_to_table(written))
    assert len(read) == 2
    for mb_w, mb_r in zip(written, read):
        assert len(mb_w.samples) == len(mb_r.samples)
        for w, r in zip(mb_w.samples, mb_r.samples):
            for f in SAMPLE_TOKEN_FIELDS:
                np.testing.assert_array_equal(getattr(r, f.name), getattr(w, f.name))
                assert getattr(r, f.name).dtype == f.dtype
            assert (r.rollout_id, r.group_id, r.policy_version, r.reward) == (
                w.rollout_id, w.group_id, w.policy_version, w.reward
            )


def test_rows_out_of_order_are_grouped_by_micro_batch():
    table = samples_to_table(two_micro_batches())
    shuffled = table.take([2, 0, 1])
    read = table_to_micro_batches(shuffled)
    assert [[s.rollout_id for s in mb.samples] for mb in read] == [["e0-i0/0", "e0-i0/1"], ["e0-i1/0"]]


def test_an_empty_rank_is_an_empty_table():
    table = samples_to_table([])
    assert table.num_rows == 0 and table.schema == TRAIN_BATCH_SCHEMA
    assert table_to_micro_batches(table) == []


def test_sample_with_misaligned_arrays_is_refused_by_rollout_id():
    s = sample([1, 2, 3], [0, 1, 1], "e4-i2/5")
    s.advantages = np.zeros(2, dtype=np.float32)
    with pytest.raises(ValueError, match=r"sample e4-i2/5: advantages has shape \(2,\)"):
        samples_to_table([MicroBatch([s])])


def test_seq_len_that_disagrees_with_the_tokens_is_refused():
    table = samples_to_table(two_micro_batches())
    bad = table.set_column(table.schema.get_field_index("seq_len"), TRAIN_BATCH_SCHEMA.field("seq_len"),
                           pa.array([3, 3, 3], pa.int32()))
    with pytest.raises(SchemaError, match="disagrees with seq_len"):
        table_to_micro_batches(bad, source="x.arrow")


def test_missing_or_unknown_schema_version_is_refused():
    assert check_schema_version(TRAIN_BATCH_SCHEMA) == 3
    assert check_schema_version(TRAIN_BATCH_SCHEMA.with_metadata({"beam_rl.schema_version": "2"})) == 2
    with pytest.raises(SchemaError, match=r"f\.arrow: no beam_rl.schema_version"):
        check_schema_version(TRAIN_BATCH_SCHEMA.remove_metadata(), "f.arrow")
    with pytest.raises(SchemaError, match=r"f\.arrow: schema version 1 is not supported \(this beam-rl reads \[2, 3\]\); "
                                          "written by an older beam-rl: read it with the beam-rl that wrote it"):
        check_schema_version(TRAIN_BATCH_SCHEMA.with_metadata({"beam_rl.schema_version": "1"}), "f.arrow")
    with pytest.raises(SchemaError, match=r"f\.arrow: schema version 4 is not supported .*newer beam-rl: upgrade"):
        check_schema_version(TRAIN_BATCH_SCHEMA.with_metadata({"beam_rl.schema_version": "4"}), "f.arrow")
    with pytest.raises(SchemaError, match="'one' is not an integer"):
        check_schema_version(TRAIN_BATCH_SCHEMA.with_metadata({"beam_rl.schema_version": "one"}))


def test_a_file_of_the_wrong_kind_names_the_missing_column():
    with pytest.raises(SchemaError, match="missing column 'micro_batch'"):
        check_schema(ROLLOUT_RECORD_SCHEMA, TRAIN_BATCH_SCHEMA, "window.arrow")
