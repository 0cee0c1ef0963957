"""A run directory opens in the tools people read data with: pyarrow.dataset, polars and duckdb through
`RunDir.dataset`, as docs/trainer-api.md shows them (Hugging Face `datasets` is not in the project's venv:
tests/ecosystem/test_wheel.py runs its snippet in a fresh install). Only committed steps surface.

The run: tests/fixtures/run-beam-2.62 (steps 1-2 committed by the 2.62 release, schema version 2), resumed
as this beam-rl resumes it: step 3 written by this writer (schema version 3), step 4 caught mid-write."""

from __future__ import annotations

import re
import shutil

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from beam_rl.rundir import RunDir, StepCorruptError
from beam_rl.rundir.arrow import table_to_micro_batches, table_to_records
from beam_rl.types import TrainBatch
from tests.support.read_run import read
from tests.support.step_damage import FILE_DAMAGE
from tests.support.paths import FIXTURES

FIXTURE = FIXTURES / "run-beam-2.62"


@pytest.fixture
def run(tmp_path) -> RunDir:
    run = RunDir(shutil.copytree(FIXTURE, tmp_path / "run"))
    record = run.read_commit(2)
    samples = table_to_micro_batches(pa.ipc.open_file(run.rank_path(2, 0)).read_all())
    window = {**record.window.model_dump(mode="json"), "step": 3}
    run.write_step(TrainBatch(step=3, micro_batches=[samples], group_ids=record.group_ids, window=window,
                              rollouts=table_to_records(run.read_window(2))))
    run.step_dir(4).mkdir()  # mid-write: a rank file renamed into place, no window, no commit record
    shutil.copy(run.rank_path(3, 0), run.rank_path(4, 0))
    assert run.committed_steps() == [1, 2, 3]
    return run


def test_the_documented_readers_read_every_committed_step_and_nothing_else(run):
    records = {step: run.read_commit(step) for step in run.committed_steps()}
    read_by = read(run.path, ["pyarrow", "polars", "duckdb"])

    assert read_by["pyarrow"] == {str(s): r.window.status["ok"] for s, r in records.items()}
    assert read_by["polars"] == {str(s): pytest.approx(r.window.reward_mean, rel=1e-6) for s, r in records.items()}
    assert read_by["duckdb"] == {str(s): r.counts.tokens for s, r in records.items()}


def test_the_dataset_holds_each_committed_file_whole_with_its_step_and_rank(run):
    samples = run.dataset("samples").to_table()
    assert samples.schema.field("reward").type == pa.float64()  # version 2's float32 read as version 3's
    for step in run.committed_steps():
        mine = samples.filter(pc.equal(samples.column("step"), step))
        assert mine.column("rank").to_pylist() == [0] * run.read_commit(step).counts.samples
        written = pa.ipc.open_file(run.rank_path(step, 0)).read_all()
        assert mine.column("input_ids").to_pylist() == written.column("input_ids").to_pylist()
    window = run.dataset("window").to_table(columns=["step", "rollout_id"])
    assert window.column("rollout_id").to_pylist() == [
        rid for step in run.committed_steps() for rid in run.read_window(step).column("rollout_id").to_pylist()]


@pytest.mark.parametrize("damage", ["truncated", "bit-flipped"])
def test_a_damaged_committed_file_fails_the_dataset_naming_it(run, damage):
    how, says = FILE_DAMAGE[damage]
    how(run.window_path(2))
    with pytest.raises(StepCorruptError) as err:
        run.dataset("window")
    assert re.fullmatch(f"{re.escape(str(run.window_path(2)))}: step 2 is corrupt: {says}", str(err.value))
    run.dataset("samples")  # the rank files are whole


def test_an_unknown_kind_names_the_kinds(run):
    with pytest.raises(ValueError, match="unknown dataset kind 'rank'; choose one of window, samples"):
        run.dataset("rank")
