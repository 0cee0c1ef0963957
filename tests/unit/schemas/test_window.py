"""window.arrow: every rollout of a step with its outcome, versions, timeline and tokens, read back
zero-copy with pyarrow or as RolloutRecords."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from beam_rl.rundir.arrow import rollouts_to_table, table_to_records
from beam_rl.scoring.samples import without_token_arrays
from beam_rl.types import Rollout, RolloutStatus, Turn
from schemas import ROLLOUT_RECORD_SCHEMA, SchemaError


def _multi_turn() -> Rollout:
    return Rollout("e0-i3", "guess_number", 0, 2, prompt_ids=[1, 2], reward=1.0, advantage=0.75, epoch=0, index=3,
                   turns=[Turn([4, 5, 6], [-0.1, -0.2, -0.3], "stop", policy_versions=[4, 4, 5]),
                          Turn([7], [-0.5], "length", env_ids=[9, 8], policy_versions=[5])],
                   policy_version_start=4, policy_version_end=5, server="http://s0", t_admitted=9.5, t_sent=10.0,
                   t_finished=12.5, t_scored=13.0, filtered="overlong", dispatch_worker="h:1", score_worker="h:2")


def _failed() -> Rollout:
    failed = Rollout("e0-i3", "guess_number", 1, 2, prompt_ids=[1, 2], epoch=0, index=3, t_sent=10.0, t_finished=70.0)
    failed.capture_error(TimeoutError("no answer in 60 s"))
    return failed


def test_a_row_per_rollout_with_its_outcome_versions_timeline_and_tokens():
    ok, failed = _multi_turn(), _failed()
    rows = rollouts_to_table([ok, failed]).to_pylist()
    assert rows[0]["rollout_id"] == "e0-i3/0" and rows[0]["status"] == "ok" and rows[0]["env"] == "guess_number"
    assert (rows[0]["num_turns"], rows[0]["completion_tokens"], rows[0]["truncated"]) == (2, 4, True)
    assert (rows[0]["filtered"], rows[0]["server"], rows[0]["index"]) == ("overlong", "http://s0", 3)
    assert (rows[0]["policy_version_start"], rows[0]["policy_version_end"]) == (4, 5)
    assert (rows[0]["token_version_min"], rows[0]["token_version_max"]) == (4, 5)
    assert (rows[0]["dispatch_worker"], rows[0]["score_worker"]) == ("h:1", "h:2")
    assert [rows[0][t] for t in ("t_admitted", "t_sent", "t_first_token", "t_finished", "t_scored", "t_packed",
                                 "t_committed")] == [9.5, 10.0, None, 12.5, 13.0, None, None]
    assert rows[0]["prompt_ids"] == [1, 2]
    first, second = rows[0]["turns"]
    assert (first["env_ids"], first["completion_ids"], first["policy_versions"], first["finish_reason"]) == (
        [], [4, 5, 6], [4, 4, 5], "stop")
    assert first["logprobs"] == pytest.approx([-0.1, -0.2, -0.3])
    assert (second["env_ids"], second["completion_ids"], second["finish_reason"]) == ([9, 8], [7], "length")
    # An errored rollout keeps its row: no turns, its prompt, the error, no token versions.
    assert rows[1]["status"] == RolloutStatus.ERROR.value and rows[1]["filtered"] is None
    assert rows[1]["errors"] == ["TimeoutError: no answer in 60 s"] and rows[1]["server"] is None
    assert rows[1]["turns"] == [] and rows[1]["prompt_ids"] == [1, 2]
    assert rows[1]["token_version_min"] is None and rows[1]["t_admitted"] is None
    assert rollouts_to_table([]).schema == ROLLOUT_RECORD_SCHEMA


def test_unknown_token_versions_are_minus_one_and_leave_the_range_null():
    rollout = Rollout("g", "e", 0, 1, prompt_ids=[1], turns=[Turn([2, 3], [-0.1, -0.2])])
    (row,) = rollouts_to_table([rollout]).to_pylist()
    assert row["turns"][0]["policy_versions"] == [-1, -1]
    assert (row["token_version_min"], row["token_version_max"]) == (None, None)


def test_the_token_columns_read_zero_copy_with_pyarrow():
    table = rollouts_to_table([_multi_turn(), _failed(), _multi_turn()])
    turns = table.column("turns").combine_chunks()  # list<struct>: one list per rollout, one struct per turn
    completion = pc.list_flatten(turns).field("completion_ids")  # list<int32> per turn, every rollout's
    ids = completion.values.to_numpy(zero_copy_only=True)
    assert ids.tolist() == [4, 5, 6, 7, 4, 5, 6, 7]
    np.testing.assert_array_equal(turns.value_lengths().to_numpy(zero_copy_only=False), [2, 0, 2])
    versions = pc.list_flatten(turns).field("policy_versions").values.to_numpy(zero_copy_only=True)
    assert versions.tolist() == [4, 4, 5, 5, 4, 4, 5, 5] and versions.dtype == np.int32


def test_records_round_trip_through_the_table():
    rollouts = [_multi_turn(), _failed()]
    back = table_to_records(rollouts_to_table(rollouts))
    assert back == [r.record() for r in rollouts]
    assert back[0].status is RolloutStatus.OK and back[0].tokens.input_ids.tolist() == [1, 2, 4, 5, 6, 9, 8, 7]
    np.testing.assert_array_equal(back[0].tokens.loss_mask(), [0, 0, 1, 1, 1, 0, 0, 1])


def test_a_rollout_whose_tokens_cannot_be_read_keeps_its_row_and_says_why():
    bad = Rollout("g", "e", 0, 1, prompt_ids=[1], turns=[Turn([2**31], [-0.1])], filtered="gibberish")
    record = bad.record()
    assert record.tokens is None and record.errors == [
        "BadTokens: rollout g/0: turn 0 completion_ids are not int32 token ids (Python integer 2147483648 out of "
        "bounds for int32)"]
    (row,) = rollouts_to_table([record]).to_pylist()
    assert row["prompt_ids"] is None and row["turns"] is None and row["filtered"] == "gibberish"
    assert table_to_records(rollouts_to_table([record]))[0].tokens is None


def test_a_window_of_another_schema_is_refused_naming_it():
    table = rollouts_to_table([_failed()])
    with pytest.raises(SchemaError, match="w.arrow: missing column 'turns'"):
        table_to_records(table.drop_columns(["turns"]), "w.arrow")
    old = pa.table({"rollout_id": ["g/0"]}).replace_schema_metadata({"beam_rl.schema_version": "1"})
    with pytest.raises(SchemaError, match="w.arrow: schema version 1 is not supported"):
        table_to_records(old, "w.arrow")


def test_a_record_stored_without_its_token_arrays_is_not_written_as_if_it_had_none():
    record = _multi_turn().record()
    (stored,) = without_token_arrays([record], {record.rollout_id}).values()
    with pytest.raises(ValueError, match="rollout e0-i3/0: its record was stored without its token arrays"):
        rollouts_to_table([stored])
