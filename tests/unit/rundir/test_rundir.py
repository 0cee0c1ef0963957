"""The run-directory protocol: atomic commits, never overwriting a step, crash cleanup, weights, metrics."""

from __future__ import annotations

import errno
import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from beam_rl.rundir import steps as steps_module
from beam_rl.config import config_from_dict
from beam_rl.rundir import (
    CommitRecordError,
    MetricsError,
    MetricsTail,
    RunDir,
    RunDirError,
    StepAlreadyCommittedError,
    StepCorruptError,
    StepNotCommittedError,
)
from beam_rl.types import MicroBatch, Rollout, Sample, TrainBatch
from schemas.commit_record import RECORD_VERSION, StepCounts, WindowStats, checksum
from tests.support.paths import REPO


def sample(n: int, trained: int, rollout_id: str, group_id: str) -> Sample:
    mask = np.zeros(n, dtype=bool)
    mask[n - trained:] = True
    return Sample(
        input_ids=np.arange(n, dtype=np.int32) + 10,
        loss_mask=mask,
        logprobs=np.zeros(n, np.float32),
        advantages=mask.astype(np.float32),
        temperatures=np.ones(n, np.float32),
        rollout_id=rollout_id,
        group_id=group_id,
        policy_version=0,
    )


def batch(step: int) -> TrainBatch:
    # rank 0: micro-batches of 5+3 and 4 tokens; rank 1: one of 6. Trained tokens: 2+1+4+3 = 10.
    rank0 = [
        MicroBatch([sample(5, 2, "g0/0", "g0"), sample(3, 1, "g0/1", "g0")]),
        MicroBatch([sample(4, 4, "g1/0", "g1")]),
    ]
    rank1 = [MicroBatch([sample(6, 3, "g1/1", "g1")])]
    return TrainBatch(step=step, micro_batches=[rank0, rank1], group_ids=["g0", "g1"], window={"rollouts": 5})


def test_write_step_commits_rank_files_window_and_record(tmp_path):
    run = RunDir(tmp_path)
    window = [Rollout("g0", "arithmetic", a, 2, epoch=0, index=4) for a in range(2)]
    step_dir = run.write_step(batch(1), {"timings": {"pack_s": 0.5}, "note": "x"},
                              offsets=[("arithmetic", 0, 7), ("arithmetic", 0, 4)], window=window)
    assert step_dir == tmp_path / "rollouts" / "step_1"
    assert sorted(os.listdir(step_dir)) == ["COMMIT.json", "rank_0.arrow", "rank_1.arrow", "window.arrow"]
    commit = run.read_commit(1)
    assert commit.step == 1 and commit.schema_version == 3 and commit.record_version == RECORD_VERSION
    assert commit.group_ids == ["g0", "g1"]
    assert commit.offsets == [("arithmetic", 0, 4), ("arithmetic", 0, 7)]
    assert commit.counts == StepCounts(
        ranks=2, micro_batches=[2, 1], samples=4, tokens=18, trained_tokens=10, groups=2, window_rollouts=2)
    assert commit.timings["pack_s"] == 0.5 and commit.timings["write_s"] >= 0
    assert commit.extra == {"note": "x"} and commit.window == WindowStats(rollouts=5)
    assert set(commit.files) == {"rank_0.arrow", "rank_1.arrow", "window.arrow"}
    for name, entry in commit.files.items():  # each file's size and checksum as it lies on disk
        data = (step_dir / name).read_bytes()
        assert entry.bytes == len(data) and entry.xxh3_128 == checksum(data)
    assert run.read_window(1).column("rollout_id").to_pylist() == ["g0/0", "g0/1"]
    # Each window row learns when its step was committed: as its window was written, before COMMIT.json.
    stamps = set(run.read_window(1).column("t_committed").to_pylist())
    assert len(stamps) == 1 and 0 < stamps.pop() <= commit.committed_at
    # Arrow IPC *file* format (footer, random access), not the stream format.
    with pa.memory_map(str(run.rank_path(1, 0))) as f:
        assert pa.ipc.open_file(f).num_record_batches == 2


def test_the_window_defaults_to_the_batch_rollouts(tmp_path):
    run = RunDir(tmp_path)
    with_rollouts = batch(1)
    with_rollouts.rollouts = [Rollout("g1", "reverse_text", 1, 2, reward=0.25, filtered="zero_advantage")]
    run.write_step(with_rollouts)
    (row,) = run.read_window(1).to_pylist()
    got = (row["rollout_id"], row["env"], row["reward"], row["filtered"])
    assert got == ("g1/1", "reverse_text", 0.25, "zero_advantage")
    run.write_step(batch(2))
    assert run.read_window(2).num_rows == 0 and run.read_commit(2).counts.window_rollouts == 0
    # A window given as a table (a rewrite, a tool) is stamped as it is committed too.
    run.write_step(batch(3), window=run.read_window(1))
    (again,) = run.read_window(3).to_pylist()
    assert again["t_committed"] > row["t_committed"] and {**again, "t_committed": 0} == {**row, "t_committed": 0}


def test_steps_are_listed_in_numeric_order_and_next_step_follows_the_last(tmp_path):
    run = RunDir(tmp_path)
    assert run.committed_steps() == [] and run.last_committed_step() is None and run.next_step() == 1
    for step in (2, np.int64(10), 1):  # a packer counting steps in numpy is fine
        run.write_step(batch(step))
    assert run.committed_steps() == [1, 2, 10]
    assert run.last_committed_step() == 10 and run.next_step() == 11


def test_consumed_offsets_is_the_union_over_committed_steps(tmp_path):
    run = RunDir(tmp_path)
    run.write_step(batch(1), offsets=[("a", 0, 0), ("a", 0, 1)])
    run.write_step(batch(2), offsets=[("b", 1, 0)])
    assert run.consumed_offsets() == {("a", 0, 0), ("a", 0, 1), ("b", 1, 0)}


def test_a_committed_step_is_never_overwritten(tmp_path):
    run = RunDir(tmp_path)
    run.write_step(batch(1), {"attempt": 1})
    before = {p.name: p.read_bytes() for p in run.step_dir(1).iterdir()}
    with pytest.raises(StepAlreadyCommittedError, match="step 1 is already committed"):
        run.write_step(batch(1), {"attempt": 2})
    assert {p.name: p.read_bytes() for p in run.step_dir(1).iterdir()} == before


def test_uncommitted_step_is_invisible_and_unreadable(tmp_path):
    run = RunDir(tmp_path)
    run.step_dir(3).mkdir(parents=True)
    (run.step_dir(3) / "rank_0.arrow").write_bytes(b"half a file")
    assert run.committed_steps() == [] and not run.is_committed(3)
    with pytest.raises(StepNotCommittedError, match="step 3 is not committed"):
        run.read_commit(3)
    with pytest.raises(StepNotCommittedError):
        run.read_window(3)


def test_failed_write_leaves_no_commit_and_no_temp_file(tmp_path, monkeypatch):
    run = RunDir(tmp_path)
    calls = []
    real = steps_module._write_arrow_file

    def fail_on_second_rank(f, table):
        calls.append(1)
        if len(calls) == 2:
            f.write(b"partial")
            raise OSError("disk full")
        real(f, table)

    monkeypatch.setattr(steps_module, "_write_arrow_file", fail_on_second_rank)
    with pytest.raises(OSError, match="disk full"):
        run.write_step(batch(1))
    assert run.committed_steps() == []
    assert sorted(os.listdir(run.step_dir(1))) == ["rank_0.arrow"]  # the temp of rank 1 was removed
    monkeypatch.setattr(steps_module, "_write_arrow_file", real)
    run.write_step(batch(1))  # the uncommitted leftover does not block a retry
    assert run.committed_steps() == [1]


def test_extra_that_json_cannot_hold_fails_before_any_file_is_written(tmp_path):
    run = RunDir(tmp_path)
    with pytest.raises(TypeError, match="object is not JSON serialisable"):
        run.write_step(batch(1), {"bad": object()})
    assert not run.step_dir(1).exists()


def test_killed_writer_leaves_an_uncommitted_step_that_clean_uncommitted_removes(tmp_path):
    # A real crash: a child process writes step 1, then dies (os._exit, no cleanup) while committing step 2.
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(REPO)!r})
        from tests.unit.rundir.test_rundir import batch
        from beam_rl import rundir
        run = rundir.RunDir({str(tmp_path)!r})
        run.write_step(batch(1))
        real_replace = os.replace
        def crash_on_commit(src, dst):
            if str(dst).endswith("COMMIT.json"):
                os._exit(3)
            real_replace(src, dst)
        os.replace = crash_on_commit
        run.write_step(batch(2))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    run = RunDir(tmp_path)
    assert run.committed_steps() == [1] and run.next_step() == 2
    leftovers = sorted(os.listdir(run.step_dir(2)))
    assert leftovers[:1] and leftovers[0].startswith(".COMMIT.json.tmp-")  # complete, but never renamed
    assert "COMMIT.json" not in leftovers
    (run.step_dir(1) / ".rank_0.arrow.tmp-0123").write_bytes(b"stray")
    removed = run.clean_uncommitted()
    assert set(removed) == {run.step_dir(2), run.step_dir(1) / ".rank_0.arrow.tmp-0123"}
    assert not run.step_dir(2).exists() and run.committed_steps() == [1]
    assert sorted(os.listdir(run.step_dir(1))) == ["COMMIT.json", "rank_0.arrow", "rank_1.arrow", "window.arrow"]
    run.write_step(batch(2))
    assert run.committed_steps() == [1, 2]


def test_config_is_written_whole_and_loads_back(tmp_path):
    run = RunDir(tmp_path / "run")
    cfg = config_from_dict({"envs": [{"name": "arithmetic", "group_size": 4}], "run": {"dir": str(tmp_path / "run")}})
    run.write_config(cfg.model_dump(mode="json"))
    assert config_from_dict(run.read_config(), source=str(run.config_path)) == cfg
    assert [p.name for p in run.path.iterdir()] == ["config.json"]


def test_metrics_lines_append_and_numpy_values_are_plain_json(tmp_path):
    run = RunDir(tmp_path)
    run.append_metrics({"step": 1, "reward": np.float32(0.5), "lengths": np.array([3, 4])})
    run.append_metrics({"step": 2})
    assert run.read_metrics() == [{"step": 1, "reward": 0.5, "lengths": [3, 4]}, {"step": 2}]


def test_a_torn_last_metrics_line_is_skipped_but_a_torn_middle_line_is_an_error(tmp_path):
    run = RunDir(tmp_path)
    run.append_metrics({"step": 1})
    with run.metrics_path.open("a") as f:
        f.write('{"step": 2, "rew')  # a crash mid-append
    assert run.read_metrics() == [{"step": 1}]
    with run.metrics_path.open("a") as f:
        f.write('\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not valid JSON"):
        run.read_metrics()


def test_a_torn_last_metrics_line_is_dropped_before_the_next_run_appends(tmp_path):
    """A crash mid-append leaves a line without its end; a resumed run drops it first (repair_metrics), so
    its own records do not glue onto it. Lines that are not JSON objects are named, as MetricsError."""
    run = RunDir(tmp_path)
    assert run.repair_metrics() == 0  # no file yet
    run.append_metrics({"step": 1})
    assert run.repair_metrics() == 0
    _append(run, '{"step": 2, "rew')
    assert run.repair_metrics() == len('{"step": 2, "rew')
    run.append_metrics({"step": 3})
    assert run.read_metrics() == [{"step": 1}, {"step": 3}]
    _append(run, '\x00\xff\n[1, 2]\n')
    run.append_metrics({"step": 4})
    with pytest.raises(MetricsError, match=r"metrics.jsonl:3: not valid JSON"):
        run.read_metrics()
    lines = run.metrics_path.read_bytes().splitlines(keepends=True)
    run.metrics_path.write_bytes(b"".join(lines[:2] + lines[3:]))
    with pytest.raises(MetricsError, match=r"metrics.jsonl:3: not valid JSON: a JSON list, not an object"):
        run.read_metrics()


def _append(run: RunDir, text: str) -> None:
    with run.metrics_path.open("a") as f:
        f.write(text)


def test_the_metrics_tail_reads_in_rounds_what_read_metrics_reads_at_once(tmp_path):
    run = RunDir(tmp_path)
    tail = MetricsTail(run.metrics_path)
    assert tail.read_new() == []  # no file yet
    read: list[dict] = []
    rounds = ['{"step": 1}\n', '\n{"step": 2}\n{"step": 3, "rew', 'ard": 0.5}\n', '{"step": 4}', '\n{"step": 5}\n']
    for text in rounds:
        _append(run, text)
        read += tail.read_new()
        assert read == run.read_metrics()
    assert read == [{"step": 1}, {"step": 2}, {"step": 3, "reward": 0.5}, {"step": 4}, {"step": 5}]
    assert tail.offset == run.metrics_path.stat().st_size


def test_the_metrics_tail_skips_a_torn_last_line_and_names_it_once_a_line_follows(tmp_path):
    run = RunDir(tmp_path)
    tail = MetricsTail(run.metrics_path)
    run.append_metrics({"step": 1})
    _append(run, '{"step": 2, "rew')  # a crash mid-append; the restarted writer appends after it
    assert tail.read_new() == [{"step": 1}]
    run.append_metrics({"step": 3})
    assert tail.read_new() == [] and run.read_metrics() == [{"step": 1}]
    run.append_metrics({"step": 4})
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not valid JSON"):
        tail.read_new()


def test_the_metrics_tail_reads_only_new_bytes_and_restarts_on_a_shorter_file(tmp_path):
    run = RunDir(tmp_path)
    tail = MetricsTail(run.metrics_path)
    run.append_metrics({"step": 1, "padding": "x" * 50})
    assert tail.read_new() == [{"step": 1, "padding": "x" * 50}]
    # Garbage where the read lines were: a reader that reread them would fail.
    run.metrics_path.write_bytes(b"?" * (run.metrics_path.stat().st_size - 1) + b"\n")
    run.append_metrics({"step": 2})
    assert tail.read_new() == [{"step": 2}]
    run.metrics_path.write_text('{"step": 1}\n')  # replaced by a shorter file
    assert tail.read_new() == [{"step": 1}]


# -- weights ----------------------------------------------------------------------------------------


def test_published_weights_appear_whole_with_stable_written_last(tmp_path):
    run = RunDir(tmp_path)
    assert run.latest_stable_weights() is None
    with run.publish_weights_dir(1) as tmp:
        assert tmp.parent == run.weights_dir and tmp.name.startswith(".step_1")
        (tmp / "model.safetensors").write_bytes(b"w1")
        assert run.latest_stable_weights() is None
    with run.publish_weights_dir(3) as tmp:
        (tmp / "model.safetensors").write_bytes(b"w3")
    assert run.latest_stable_weights() == (3, tmp_path / "weights" / "step_3")
    assert sorted(os.listdir(run.weights_path(3))) == ["STABLE", "model.safetensors"]
    assert json.loads((run.weights_path(3) / "STABLE").read_text())["step"] == 3
    assert sorted(os.listdir(run.weights_dir)) == ["step_1", "step_3"]  # no temp dir left behind
    assert run.stable_weight_steps() == [1, 3]


def test_a_failed_publish_leaves_nothing(tmp_path):
    run = RunDir(tmp_path)
    with pytest.raises(RuntimeError, match="trainer died"):
        with run.publish_weights_dir(2) as tmp:
            (tmp / "model.safetensors").write_bytes(b"half")
            raise RuntimeError("trainer died")
    assert os.listdir(run.weights_dir) == [] and run.latest_stable_weights() is None


def test_weights_without_stable_are_ignored_and_replaced_and_stable_ones_never(tmp_path):
    run = RunDir(tmp_path)
    run.weights_path(4).mkdir(parents=True)
    (run.weights_path(4) / "model.safetensors").write_bytes(b"partial")
    assert run.latest_stable_weights() is None
    with run.publish_weights_dir(4) as tmp:
        (tmp / "model.safetensors").write_bytes(b"whole")
    assert (run.weights_path(4) / "model.safetensors").read_bytes() == b"whole"
    with pytest.raises(StepAlreadyCommittedError, match="weights of step 4 are already published"):
        with run.publish_weights_dir(4):
            pass


# -- the commit record's checks ----------------------------------------------------------------------------


def test_window_stats_the_commit_record_does_not_know_fail_before_any_file_is_written(tmp_path):
    run = RunDir(tmp_path)
    unknown = batch(1)
    unknown.window = {"rollouts": 5, "a_new_stat": 1.5}
    with pytest.raises(ValueError, match=r"^step 1: window stats: a_new_stat: Extra inputs are not permitted$"):
        run.write_step(unknown)
    with pytest.raises(ValueError, match=r"^step 1: extra timings: pack_s: Input should be a valid number, unable"):
        run.write_step(batch(1), {"timings": {"pack_s": "slow"}})
    not_a_number = batch(1)
    not_a_number.window = {"rollouts": 5, "reward_mean": float("nan")}  # JSON could not hold it
    with pytest.raises(ValueError, match=r"^step 1: window stats: reward_mean: Input should be a finite number$"):
        run.write_step(not_a_number)
    assert not run.step_dir(1).exists()


def test_an_io_error_reading_a_commit_record_is_a_typed_error_naming_it(tmp_path, monkeypatch):
    run = RunDir(tmp_path)
    run.write_step(batch(1))
    real_read_bytes = Path.read_bytes

    def failing_disk(path: Path) -> bytes:
        if path.name == "COMMIT.json":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", failing_disk)
    with pytest.raises(CommitRecordError, match=rf"^{run.commit_path(1)}: unreadable: \[Errno 5\] Input/output error"):
        run.read_commit(1)


def test_a_corrupt_step_error_keeps_its_step_and_file_across_processes(tmp_path):
    err = StepCorruptError(3, tmp_path / "rank_0.arrow", "missing")
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.step, copy.file, copy.what, str(copy)) == (3, err.file, "missing", str(err))
    assert str(err) == f"{tmp_path}/rank_0.arrow: step 3 is corrupt: missing" and isinstance(err, RunDirError)


def test_a_rank_built_at_once_is_written_byte_for_byte_as_its_micro_batches_built_one_by_one():
    import io

    from beam_rl.rundir.arrow import samples_to_table
    from beam_rl.rundir.steps import _write_arrow_file
    from schemas.train_batch import TRAIN_BATCH_SCHEMA

    rank = [*batch(1).micro_batches[0], *batch(1).micro_batches[1]]
    at, index = TRAIN_BATCH_SCHEMA.get_field_index("micro_batch"), TRAIN_BATCH_SCHEMA.field("micro_batch")
    one_by_one = pa.Table.from_batches(
        [samples_to_table([mb]).to_batches()[0].set_column(at, index, pa.array([i] * len(mb.samples), pa.int32()))
         for i, mb in enumerate(rank)], schema=TRAIN_BATCH_SCHEMA)
    files = [io.BytesIO(), io.BytesIO()]
    _write_arrow_file(files[0], samples_to_table(rank))
    _write_arrow_file(files[1], one_by_one)
    assert files[0].getvalue() == files[1].getvalue()
    assert samples_to_table(rank).to_batches()[2].column("position_ids").to_pylist()[0] == [0, 1, 2, 3, 4, 5]
