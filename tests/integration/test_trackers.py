"""The run observer feeds W&B (offline) and TensorBoard: every step of every stream logged once, also
across a resume after a crash at any point, and read back from the trackers' own files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from beam_rl.observe import RunObserver
from beam_rl.observe.tensorboard_tracker import logged_steps as tensorboard_logged
from beam_rl.observe.wandb_history import history_rows, records, run_logs
from beam_rl.observe.wandb_tracker import RUN_ID_FILE
from beam_rl.rundir import RunDir
from tests.support.observe_run import commit_step, grow, observe_config
from tests.support.paths import REPO

BOTH = {"wandb": {"mode": "offline", "project": "beam-rl-test"}, "tensorboard": {"enabled": True}}
WANDB_VARIABLES = ("WANDB_SILENT", "WANDB_ERROR_REPORTING", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR",
                   "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR")


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty HOME (and XDG folders) for the test: W&B must write nothing there. The W&B variables the
    tracker sets are restored afterwards."""
    home = tmp_path / "home"
    home.mkdir()
    for variable, path in (("HOME", home), ("XDG_CONFIG_HOME", home / ".config"), ("XDG_CACHE_HOME", home / ".cache")):
        monkeypatch.setenv(variable, str(path))
    for variable in WANDB_VARIABLES:
        monkeypatch.setenv(variable, "")
    return home


def tensorboard_steps(run: RunDir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag's (step, value) points, as TensorBoard itself loads them from all event files, by step
    as its charts plot them: it reads the files in name order (seconds, host, pid), so a crashed process's file
    and the resumed process's, begun in the same second, load in either order. A step logged twice stays twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(run.path / "tensorboard"), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: sorted(((e.step, e.value) for e in accumulator.Scalars(tag)), key=lambda point: point[0])
            for tag in accumulator.Tags()["scalars"]}


def wandb_rows(run: RunDir) -> list[dict[str, object]]:
    """Every history row of the run's W&B run, over all its segments, values decoded."""
    root = run.path / "wandb"
    run_id = (root / RUN_ID_FILE).read_text()
    return [{key: json.loads(value) for key, value in row.items()} for path in run_logs(root, run_id)
            for row in history_rows(path)]


def stream_steps(rows: list[dict[str, object]], stream: str) -> list[int]:
    return [row[f"{stream}/step"] for row in rows if f"{stream}/step" in row]


def expected_steps(last: int) -> dict[str, list[int]]:
    """What `grow(run, range(1, last + 1))` wrote: steps, trainer records one step behind, eval every 3."""
    return {"rollouts": list(range(1, last + 1)), "trainer": list(range(1, last)),
            "eval": list(range(3, last + 1, 3))}


def check_logged_once(run: RunDir, last: int) -> None:
    expected = expected_steps(last)
    commits = {step: run.read_commit(step) for step in expected["rollouts"]}
    tensorboard = tensorboard_steps(run)
    assert [step for step, _ in tensorboard["reward/mean"]] == expected["rollouts"]
    assert [value for _, value in tensorboard["reward/mean"]] == pytest.approx(
        [commits[s].window.reward_mean for s in expected["rollouts"]])
    assert [step for step, _ in tensorboard["trainer/loss"]] == expected["trainer"]
    assert [value for _, value in tensorboard["trainer/loss"]] == pytest.approx([1 / s for s in expected["trainer"]])
    assert [step for step, _ in tensorboard["eval/arithmetic/pass@1"]] == expected["eval"]
    for stream, steps in expected.items():  # every tag of a stream at each of its steps, once
        assert [step for step, _ in tensorboard[f"{stream}/step"]] == steps

    rows = wandb_rows(run)
    for stream, steps in expected.items():
        assert stream_steps(rows, stream) == steps, stream
    rollouts = [row for row in rows if "rollouts/step" in row]
    assert all(row["step"] == row["rollouts/step"] for row in rollouts)  # the x-axis of every chart
    assert [row["reward/mean"] for row in rollouts] == pytest.approx(
        [commits[s].window.reward_mean for s in expected["rollouts"]])
    assert [row["trainer/loss"] for row in rows if "trainer/step" in row] == pytest.approx(
        [1 / s for s in expected["trainer"]])


def test_every_step_of_every_stream_goes_to_both_trackers_once_as_the_run_grows(tmp_path, home):
    run = RunDir(tmp_path / "run")
    grow(run, range(1, 5))
    samples = {}

    def sample_rows(step: int) -> list[dict[str, object]]:
        samples[step] = [{"prompt": f"{step} + 1 =", "completion": str(step + 1), "reward": 1.0},
                         {"prompt": f"{step} + 2 =", "completion": "?", "reward": 0.0, "turns": 2}]
        return samples[step]

    with RunObserver(run, observe_config(**BOTH), sample_rows=sample_rows) as observer:
        observer.poll()
        assert {t.name: t.logged for t in observer.trackers} == {
            name: {"rollouts": 4, "trainer": 3, "eval": 3} for name in ("tensorboard", "wandb")}
        observer.poll()  # nothing new: nothing logged again
        grow(run, range(5, 8))
        observer.poll()
    check_logged_once(run, 7)

    # W&B's table of sample rollouts per step, as W&B wrote it to the run's media files.
    rows = [row for row in wandb_rows(run) if row.get("rollouts/samples/_type") == "table-file"]
    assert [row["rollouts/step"] for row in rows] == list(range(1, 8))
    segment = run_logs(run.path / "wandb", (run.path / "wandb" / RUN_ID_FILE).read_text())[0].parent
    for row in rows:
        table = json.loads((segment / "files" / row["rollouts/samples/path"]).read_text())
        assert table["columns"] == ["prompt", "completion", "reward", "turns"]
        assert table["data"] == [[s.get(c) for c in table["columns"]] for s in samples[row["rollouts/step"]]]
    # Offline W&B wrote inside the run directory only.
    assert not list(home.rglob("*"))


CRASHING_OBSERVER = """
import os, signal, sys
from beam_rl.observe import RunObserver
from beam_rl.observe.tensorboard_tracker import TensorBoardTracker
from tests.support.observe_run import grow, observe_config, RunDir

run = RunDir(sys.argv[1])
grow(run, range(int(sys.argv[2]), int(sys.argv[3]) + 1))
if sys.argv[4] == "mid_poll":  # killed as it logs step 5: step 4 went to TensorBoard and W&B, 5 to neither
    log = TensorBoardTracker.log
    def log_or_die(self, stream, step, *args):
        if (stream, step) == ("rollouts", 5):
            os.kill(os.getpid(), signal.SIGKILL)
        log(self, stream, step, *args)
    TensorBoardTracker.log = log_or_die
observer = RunObserver(run, observe_config(**{BOTH!r}))
observer.poll()
os.kill(os.getpid(), signal.SIGKILL)  # logged, and nothing closed: W&B's buffered rows are lost
"""


def crash_observer(run: RunDir, first: int, last: int, when: str, home: Path) -> None:
    """Grow the run by steps first..last and follow it in a process that is killed mid-run."""
    script = CRASHING_OBSERVER.replace("{BOTH!r}", repr(BOTH))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script), str(run.path), str(first), str(last), when],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr


@pytest.mark.parametrize("when", ["after_poll", "mid_poll"])
def test_a_resumed_run_continues_the_same_runs_and_logs_each_step_once_after_a_crash(tmp_path, home, when):
    run = RunDir(tmp_path / "run")
    grow(run, range(1, 4))
    with RunObserver(run, observe_config(**BOTH)) as observer:
        observer.poll()
    run_id = (run.path / "wandb" / RUN_ID_FILE).read_text()

    crash_observer(run, 4, 6, when, home)
    # What each tracker kept of the crashed process: TensorBoard what its writer thread got to write
    # (after a whole poll: all of it); W&B, whose transaction log is written 32 KiB at a time, none of it.
    tensorboard = [s for s, _ in tensorboard_steps(run)["rollouts/step"]]
    assert tensorboard == [1, 2, 3, 4, 5, 6] if when == "after_poll" else tensorboard in ([1, 2, 3], [1, 2, 3, 4])
    assert stream_steps(wandb_rows(run), "rollouts") == [1, 2, 3]

    grow(run, range(7, 9))
    with RunObserver(run, observe_config(**BOTH)) as observer:
        observer.poll()
        assert observer.trackers[1].run.id == run_id
    check_logged_once(run, 8)
    # One W&B run in three segments (one per process), all under the persisted id.
    segments = sorted(p.name for p in (run.path / "wandb").iterdir() if p.name.startswith("offline-run-"))
    assert len(segments) == 3 and all(name.endswith(f"-{run_id}") for name in segments)
    assert not list(home.rglob("*"))


def test_records_torn_by_a_crash_end_reading_and_their_steps_are_logged_again(tmp_path, home):
    run = RunDir(tmp_path / "run")
    grow(run, range(1, 5))
    with RunObserver(run, observe_config(**BOTH)) as observer:
        observer.poll()
    # Tear the last record of each tracker's file, as a crash mid-write would.
    (events,) = (run.path / "tensorboard").glob("events.out.tfevents.*")
    events.write_bytes(events.read_bytes()[:-5])
    (log,) = run_logs(run.path / "wandb", (run.path / "wandb" / RUN_ID_FILE).read_text())
    data = log.read_bytes()
    last_row = [raw for raw in records(log) if b"eval/step" in raw][-1]
    log.write_bytes(data[:data.rfind(last_row) + len(last_row) // 2])
    # The last rows written were the eval round after step 3 (a poll logs commits, trainer, then evals).
    assert stream_steps(wandb_rows(run), "eval") == []
    assert tensorboard_logged(run.path / "tensorboard") == {"rollouts": 4, "trainer": 3, "eval": 0}

    with RunObserver(run, observe_config(**BOTH)) as observer:
        observer.poll()
    check_logged_once(run, 4)


def test_a_damaged_transaction_log_is_read_up_to_the_damage(tmp_path, home):
    run = RunDir(tmp_path / "run")
    grow(run, range(1, 4))
    with RunObserver(run, observe_config(wandb={"mode": "offline"})) as observer:
        observer.poll()
    (log,) = run_logs(run.path / "wandb", (run.path / "wandb" / RUN_ID_FILE).read_text())
    first_rows = [row for row in history_rows(log)]
    data = bytearray(log.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped bit fails that record's CRC-32
    log.write_bytes(bytes(data))
    assert 0 < len(list(history_rows(log))) < len(first_rows)
    log.write_bytes(b"not a log")
    with pytest.raises(ValueError, match="not a W&B transaction log"):
        list(records(log))


def test_without_trackers_the_observer_never_imports_them(tmp_path):
    run = RunDir(tmp_path / "run")
    commit_step(run, 1)
    script = textwrap.dedent("""
        import sys
        from beam_rl.observe import RunObserver
        from tests.support.observe_run import observe_config, RunDir
        observer = RunObserver(RunDir(sys.argv[1]), observe_config())
        observer.poll()
        assert observer.snapshot.steps_committed == 1 and observer.trackers == []
        observer.close()
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("wandb", "tensorboard", "torch")))
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", script, str(run.path)], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


NETWORK_AUDIT = """
import atexit, socket, sys
calls = []
# Registered first, so it runs last: W&B's own exit handlers may still send.
atexit.register(lambda: print([call for call in calls if call[1] not in ("127.0.0.1", "::1", "localhost")]))

from beam_rl.observe import RunObserver
from tests.support.observe_run import observe_config, RunDir

def audit(event, args):
    if event in ("socket.connect", "socket.sendto") and isinstance(args[1], tuple):
        calls.append((event, args[1][0]))
    elif event in ("socket.getaddrinfo", "socket.gethostbyname"):
        calls.append((event, args[0]))

sys.addaudithook(audit)
observer = RunObserver(RunDir(sys.argv[1]), observe_config(wandb={"mode": "offline"}))
observer.poll()
observer.close()
"""


def test_offline_wandb_makes_no_network_call(tmp_path, home):
    """W&B's own telemetry probes its servers even offline unless its error reporting is off."""
    run = RunDir(tmp_path / "run")
    grow(run, range(1, 3))
    env = {key: value for key, value in os.environ.items() if not key.startswith("WANDB_")}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run([sys.executable, "-c", NETWORK_AUDIT, str(run.path)], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
    assert not list(home.rglob("*"))


def test_a_failing_tracker_is_closed_the_run_goes_on_and_a_resumed_run_catches_it_up(tmp_path, home, monkeypatch,
                                                                                     caplog):
    run = RunDir(tmp_path / "run")
    grow(run, range(1, 5))
    from beam_rl.observe.tensorboard_tracker import TensorBoardTracker

    log = TensorBoardTracker.log

    def fail_at_step_3(self, stream, step, *args):
        if step == 3:
            raise OSError("No space left on device")
        log(self, stream, step, *args)

    monkeypatch.setattr(TensorBoardTracker, "log", fail_at_step_3)
    with RunObserver(run, observe_config(**BOTH)) as observer:
        observer.poll()
        assert [t.name for t in observer.trackers] == ["wandb"]
        grow(run, range(5, 7))
        observer.poll()
        assert observer.snapshot.steps_committed == 6
    assert "tensorboard failed logging rollouts step 3" in caplog.text
    assert [s for s, _ in tensorboard_steps(run)["rollouts/step"]] == [1, 2]
    assert stream_steps(wandb_rows(run), "rollouts") == list(range(1, 7))

    monkeypatch.setattr(TensorBoardTracker, "log", log)
    with RunObserver(run, observe_config(**BOTH)) as observer:
        observer.poll()
    check_logged_once(run, 6)
