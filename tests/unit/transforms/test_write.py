"""WriteTrainBatches' stages driven by hand, in the orders a runner may deliver their parts: a step's
files are written apart (keyed by step and rank), its commit record comes once every file is in."""

from __future__ import annotations

from beam_rl.packing.batches import InputExhausted
from beam_rl.rundir import RunDir
from beam_rl.rundir.step_parts import WINDOW_PART
from tests.support.step_writer import InProcessWriter
from tests.unit.rundir.test_rundir import batch


def _files_by_part(writer: InProcessWriter, step: int):
    files, (plan,) = writer.split(batch(step))
    return {key[1]: (key, value) for key, value in files}, plan


def test_a_commit_record_never_appears_before_every_file_of_its_step_is_written(tmp_path):
    run, writer = RunDir(tmp_path), InProcessWriter(str(tmp_path))
    files, plan = _files_by_part(writer, 1)
    assert sorted(files) == [WINDOW_PART, 0, 1]  # two ranks and the window, each keyed (step, part)
    assert writer.deliver(plan) == []
    for part in (0, WINDOW_PART):  # rank 1's write is held back
        (written,) = writer.write(files[part])
        assert writer.deliver(written) == []
        assert not run.commit_path(1).exists() and not run.is_committed(1)
    assert not run.rank_path(1, 1).exists()
    (held,) = writer.write(files[1])  # released
    assert writer.deliver(held) == [1]
    record = run.read_commit(1)
    assert sorted(record.files) == ["rank_0.arrow", "rank_1.arrow", "window.arrow"]
    assert run.verify_step(record) == []  # every file it names is there, whole, with its checksum
    assert record.counts.micro_batches == [2, 1] and record.counts.trained_tokens == 10
    assert writer.parts.items == []  # the committer forgets a committed step


def test_a_duplicated_rank_write_is_harmless_before_and_after_the_commit(tmp_path):
    run, writer = RunDir(tmp_path), InProcessWriter(str(tmp_path))
    files, plan = _files_by_part(writer, 1)
    (first,) = writer.write(files[0])
    (again,) = writer.write(files[0])  # a retried or duplicated write of the same rank
    assert again == first  # the same bytes, the same checksum
    assert writer.deliver(plan) + writer.deliver(first) + writer.deliver(again) == []  # counted once
    (window,) = writer.write(files[WINDOW_PART])
    (rank1,) = writer.write(files[1])
    assert writer.deliver(window) + writer.deliver(rank1) == [1]
    committed = run.rank_path(1, 0).read_bytes()
    assert writer.write(files[0]) == []  # a step committed already is not written again
    assert writer.deliver(first) == [] and writer.deliver(plan) == []  # nor committed again
    assert run.rank_path(1, 0).read_bytes() == committed and run.verify_step(run.read_commit(1)) == []


def test_steps_commit_in_order_whatever_order_their_files_come_in(tmp_path):
    run, writer = RunDir(tmp_path), InProcessWriter(str(tmp_path))
    step1, plan1 = _files_by_part(writer, 1)
    step2, plan2 = _files_by_part(writer, 2)
    assert writer.deliver(plan1) + writer.deliver(plan2) == []
    for keyed in step2.values():
        assert writer.deliver(*writer.write(keyed)) == []  # step 2 complete, step 1 not yet
    assert run.committed_steps() == []
    assert writer.deliver(("commit", InputExhausted(last_step=2))) == []
    assert not run.input_exhausted_path.exists()  # the end of input waits for its last step
    committed = [step for keyed in step1.values() for step in writer.deliver(*writer.write(keyed))]
    assert committed == [1, 2] and run.committed_steps() == [1, 2]
    assert run.input_last_step() == 2


def test_a_file_crosses_to_its_writer_by_columns_and_is_written_byte_for_byte_the_same(tmp_path):
    import pickle

    import pyarrow as pa

    from beam_rl.rundir.step_parts import files_to_write
    from beam_rl.types import Rollout, Turn

    step = batch(1)

    def turns():
        return [Turn([4, 5], [-0.5, -0.25], "stop", policy_versions=[0, 1]), Turn([6], [-1.0], "length", env_ids=[9])]

    step.rollouts = [Rollout(f"g{i}", "reverse_text", 0, i, prompt_ids=[1, 2, 3][i:], turns=turns()[i:]) for i in range(3)]
    step.rollouts[1].turns[0].completion_ids = [-1]  # tokens that cannot be read: a record without them
    here, there = RunDir(tmp_path / "here"), RunDir(tmp_path / "there")
    for files in files_to_write(step):
        crossed = pickle.loads(pickle.dumps(files))
        if files.part == WINDOW_PART:
            assert [r.tokens is None for r in crossed.window] == [False, True, False]
            here.write_window(1, files.window), there.write_window(1, crossed.window)
            tables = [pa.ipc.open_file(str(run.window_path(1))).read_all().drop_columns(["t_committed"])
                      for run in (here, there)]
            assert tables[0].equals(tables[1]) and tables[0].num_rows == 3
        else:
            assert here.write_rank(1, files.part, files.micro_batches) == there.write_rank(
                1, files.part, crossed.micro_batches)
            assert here.rank_path(1, files.part).read_bytes() == there.rank_path(1, files.part).read_bytes()


def test_a_committer_restored_from_before_a_commit_forgets_that_step_and_commits_the_next(tmp_path):
    """Flink restores the committer's state from a checkpoint, and the run directory keeps the steps
    committed since: their parts are dropped (a replayed plan must hold the same groups), never committed twice."""
    import copy

    run, writer = RunDir(tmp_path), InProcessWriter(str(tmp_path))
    step1, plan1 = _files_by_part(writer, 1)
    writer.deliver(plan1)
    *early, last = step1.values()
    for keyed in early:
        writer.deliver(*writer.write(keyed))
    checkpoint = copy.deepcopy(writer.parts)  # step 1's plan and all its files but one
    assert writer.deliver(*writer.write(last)) == [1]
    writer.parts = checkpoint  # the restore; step 1 stays committed in the run directory
    step2, plan2 = _files_by_part(writer, 2)
    committed = [step for keyed in step2.values() for step in writer.deliver(*writer.write(keyed))]
    assert writer.deliver(plan2) + committed == [2] and run.committed_steps() == [1, 2]
    assert writer.parts.items == []
