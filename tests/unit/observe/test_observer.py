"""The run observer reads only what the run directory gained since its last poll."""

from __future__ import annotations

from beam_rl.observe import RunObserver
from beam_rl.rundir import RunDir
from tests.support.observe_run import commit_step, grow, observe_config, status


def test_a_poll_reads_only_new_commit_records_new_metrics_lines_and_a_changed_status(tmp_path, monkeypatch):
    run = RunDir(tmp_path)
    grow(run, range(1, 21))
    status(run, policy_version=19)
    read_commits: list[int] = []
    listings: list[int] = []
    status_reads: list[int] = []
    read_commit, committed_steps, read_status = RunDir.read_commit, RunDir.committed_steps, RunDir.read_status
    monkeypatch.setattr(RunDir, "read_commit", lambda self, step: read_commits.append(step) or read_commit(self, step))
    monkeypatch.setattr(RunDir, "committed_steps", lambda self: listings.append(1) or committed_steps(self))
    monkeypatch.setattr(RunDir, "read_status", lambda self: status_reads.append(1) or read_status(self))

    observer = RunObserver(run, observe_config())
    observer.poll()
    assert read_commits == list(range(1, 21)) and len(listings) == 1 and len(status_reads) == 1
    assert observer.snapshot.steps_committed == 20 and observer.snapshot.trainer_step == 19

    read_size = run.metrics_path.stat().st_size
    grow(run, range(21, 23))
    # Garbage where the metrics already read were: rereading them would fail.
    data = run.metrics_path.read_bytes()
    run.metrics_path.write_bytes(b"?" * (read_size - 1) + b"\n" + data[read_size:])
    read_commits.clear()
    listings.clear()
    observer.poll()
    assert read_commits == [21, 22] and listings == [] and len(status_reads) == 1  # status.json unchanged
    assert observer.snapshot.steps_committed == 22 and observer.snapshot.trainer_step == 21
    totals = observer.snapshot.totals
    assert totals["groups_packed"] == 22 and totals["rollouts_observed"] == sum(64 + s for s in range(1, 23))

    status(run, policy_version=21)
    observer.poll()
    assert read_commits == [21, 22] and len(status_reads) == 2 and observer.snapshot.status["policy_version"] == 21
    observer.close()


def test_a_step_without_load_samples_of_its_own_shows_the_last_one_before_it(tmp_path):
    run = RunDir(tmp_path)
    grow(run, range(1, 3))
    observer = RunObserver(run, observe_config())
    observer.poll()
    before = observer.snapshot.step["dispatch/permits_in_use"]
    commit_step(run, 3)  # no dispatch sample since step 2
    observer.poll()
    assert observer.snapshot.step["dispatch/permits_in_use"] == before == 12 / 64
    observer.close()
