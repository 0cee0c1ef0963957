"""The live progress table's incremental view of a run (`RunTail`): the rows `step_rows` builds, read
from only what the run directory gained since the last refresh."""

from __future__ import annotations

import time

import pytest

from beam_rl.observe.report import RunTail, step_rows
from beam_rl.rundir import RunDir
from beam_rl.types import TrainBatch


def commit(run: RunDir, step: int) -> float:
    run.write_step(TrainBatch(step=step, micro_batches=[], group_ids=[], window={
        "rollouts": 8 + step, "trained_rollouts": step, "reward_mean": step / 10, "errored": step % 2,
        "filtered": {"zero_advantage": step % 3}, "policy_version_min": step - 1, "staleness_max": 1,
        "tokens_by_fate": {"trained": 100 * step, "filtered/zero_advantage": 7 * (step % 3), "stale": step % 2}}))
    return run.read_commit(step).committed_at


def dispatch(run: RunDir, inflight: int, t: float | None = None) -> None:
    servers = [{"url": "http://a:1", "inflight": inflight}, {"url": "http://b:2", "inflight": 1}]
    run.append_metrics({"dispatch": {"t": time.time() if t is None else t, "inflight": inflight + 1,
                                     "max_inflight": 8, "servers": servers}})


def trainer(run: RunDir, step: int, loss: float) -> None:
    run.append_metrics({"trainer": {"step": step, "loss": loss, "wait_s": 0.5}})


@pytest.mark.parametrize("keep", [3, 12])
def test_the_tail_shows_the_last_rows_of_step_rows_as_steps_commit_in_rounds(tmp_path, keep):
    run = RunDir(tmp_path)
    tail = RunTail(run, keep=keep)

    def round_1():
        dispatch(run, 1)
        commit(run, 1)
        dispatch(run, 2)
        dispatch(run, 3)
        commit(run, 2)

    def round_2():
        commit(run, 3)  # no sample since step 2: it shows the last one before
        trainer(run, 1, 0.9)
        trainer(run, 2, 0.8)
        dispatch(run, 4)

    def round_3():
        at_4 = commit(run, 4)
        dispatch(run, 5)
        dispatch(run, 6, t=at_4 - 1e-4)  # taken before step 4's commit, written after it and a later one
        trainer(run, 3, 0.7)
        commit(run, 5)
        run.append_metrics({"eval": {"after_step": 5, "envs": {}}})

    def round_4():
        for step in (6, 7):
            commit(run, step)
        dispatch(run, 6)
        commit(run, 8)
        for step in (4, 5, 6, 7):
            trainer(run, step, 1 / step)
        with run.metrics_path.open("a") as f:
            f.write('{"trainer": {"step": 8, "lo')  # the trainer mid-append

    def round_5():
        with run.metrics_path.open("a") as f:
            f.write('ss": 0.1, "wait_s": 0.2}}\n')
        trainer(run, 7, 0.05)  # a later record of a step wins, as in step_rows
        dispatch(run, 7)

    assert tail.update() == [] and tail.last_eval is None  # an empty run directory
    for write_round in (round_1, round_2, round_3, round_4, round_5):
        write_round()
        assert tail.update() == step_rows(run)[-keep:]
    assert tail.last_eval == {"after_step": 5, "envs": {}}
    rows = tail.update()
    assert [r.step for r in rows] == list(range(9 - len(rows), 9)) and rows[-1].trainer["loss"] == 0.1


def test_an_update_reads_only_new_commit_records_and_new_metrics(tmp_path, monkeypatch):
    run = RunDir(tmp_path)
    for step in range(1, 21):
        dispatch(run, step % 4)
        commit(run, step)
        trainer(run, step, 1 / step)
    read_commits: list[int] = []
    listings: list[int] = []
    read_commit, committed_steps = RunDir.read_commit, RunDir.committed_steps
    monkeypatch.setattr(RunDir, "read_commit", lambda self, step: read_commits.append(step) or read_commit(self, step))
    monkeypatch.setattr(RunDir, "committed_steps", lambda self: listings.append(1) or committed_steps(self))

    tail = RunTail(run, keep=3)
    rows = tail.update()
    assert read_commits == [17, 18, 19, 20] and len(listings) == 1  # the shown steps and the one before
    assert rows == step_rows(run)[-3:]

    read_size = run.metrics_path.stat().st_size
    for step in (21, 22):
        dispatch(run, 1)
        commit(run, step)
        trainer(run, step - 1, 0.5)
    expected = step_rows(run)[-3:]
    # Garbage where the metrics already read were: rereading them would fail.
    data = run.metrics_path.read_bytes()
    run.metrics_path.write_bytes(b"?" * (read_size - 1) + b"\n" + data[read_size:])
    read_commits.clear()
    listings.clear()
    assert tail.update() == expected
    assert read_commits == [21, 22] and listings == []
