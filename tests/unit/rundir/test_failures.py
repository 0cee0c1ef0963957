"""The typed record of why a run stopped: written by the stage that stops, read back by the command."""

from __future__ import annotations

import json
import os

from beam_rl.rundir import RunDirError
from beam_rl.rundir.failures import FAILURE_FILE, read_failure, record_failure
from beam_rl.source import AllServersDownError


def test_the_latest_failure_is_read_back_with_its_type_and_message(tmp_path):
    assert read_failure(tmp_path) is None
    record_failure(tmp_path, "write", RunDirError("step_4: step 4 is not committed: [Errno 28] No space left"))
    record_failure(tmp_path, "dispatch", AllServersDownError("all 2 inference servers ... unhealthy"))
    failure = read_failure(tmp_path)
    assert (failure.error, failure.stage, failure.message) == (
        "AllServersDownError", "dispatch", "all 2 inference servers ... unhealthy")
    assert str(failure) == "AllServersDownError: all 2 inference servers ... unhealthy"
    assert failure.worker.endswith(f":{os.getpid()}")


def test_a_record_older_than_the_job_is_an_earlier_runs(tmp_path):
    record_failure(tmp_path, "write", RunDirError("disk full"))
    at = read_failure(tmp_path).at
    assert read_failure(tmp_path, since=at) is not None
    assert read_failure(tmp_path, since=at + 1) is None


def test_a_damaged_record_reads_as_none(tmp_path):
    (tmp_path / FAILURE_FILE).write_text(json.dumps({"error": "X"}))
    assert read_failure(tmp_path) is None


def test_a_record_in_a_missing_directory_does_not_hide_the_error(tmp_path):
    record_failure(tmp_path / "gone", "write", RunDirError("disk full"))  # logs, does not raise
    assert read_failure(tmp_path / "gone") is None
