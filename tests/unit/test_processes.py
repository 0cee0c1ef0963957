"""The job's supervisor: parts stopped newest first, even when one stop fails; children whose parent is
SIGKILLed end too; no log handle left open in the parent; a failed child is named."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from beam_rl.processes import ChildFailedError, Supervisor

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_parts_stop_newest_first_and_every_part_stops_when_one_fails(tmp_path):
    stopped: list[tuple[str, int | None]] = []

    def cancel_rollout_job() -> None:
        stopped.append(("rollout job", trainer.exit_code()))  # the trainer has ended by now
        raise RuntimeError("cancel failed")

    @contextlib.contextmanager
    def servers():
        yield ["http://127.0.0.1:1"]
        stopped.append(("servers", trainer.exit_code()))

    supervisor = Supervisor(stop_timeout_s=5)
    assert supervisor.enter("servers", servers()) == ["http://127.0.0.1:1"]
    supervisor.add("rollout job", cancel_rollout_job)
    trainer = supervisor.start("trainer", SLEEP, tmp_path / "trainer.log")
    assert trainer.exit_code() is None
    with pytest.raises(RuntimeError, match="cancel failed"):
        supervisor.stop()
    assert stopped == [("rollout job", -signal.SIGTERM), ("servers", -signal.SIGTERM)]
    supervisor.stop()  # nothing left: a second stop does nothing
    assert len(stopped) == 2


def test_the_error_that_ended_the_block_is_not_replaced_by_a_failing_stop():
    def failing() -> None:
        raise RuntimeError("cancel failed")

    with pytest.raises(KeyboardInterrupt), Supervisor() as supervisor:
        supervisor.add("rollout job", failing)
        raise KeyboardInterrupt


def test_a_child_writes_its_log_and_the_parent_keeps_no_handle_to_it(tmp_path):
    log = tmp_path / "logs" / "child.log"
    with Supervisor() as supervisor:
        child = supervisor.start("echo", [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"], log)
        child.process.wait(timeout=30)
        open_files = {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                      if os.path.exists(f"/proc/self/fd/{fd}")}
        assert str(log) not in open_files
    assert log.read_text().split() == ["out", "err"]
    assert child.exit_code() == 0


def test_a_failed_child_is_named(tmp_path):
    with Supervisor() as supervisor:
        supervisor.add("servers", lambda: None)
        assert supervisor.failed() is None
        child = supervisor.start("trainer", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "trainer.log")
        child.process.wait(timeout=30)
        assert supervisor.failed() is child and child.exit_code() == 3
        with pytest.raises(ChildFailedError, match=f"the trainer exited with status 3; see {tmp_path}/trainer.log"):
            supervisor.raise_if_failed()


def test_children_end_when_their_parent_is_killed(tmp_path):
    # A parent that starts a child through the supervisor, prints its pid, and is then SIGKILLed: no
    # `finally`, no atexit runs, and the child must still go.
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from beam_rl.processes import ChildFailedError, Supervisor
        child = Supervisor().start("trainer", {SLEEP!r}, Path({str(tmp_path / 'child.log')!r}))
        print(child.process.pid, flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    child_pid = int(parent.stdout.readline())
    assert _alive(child_pid)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child_pid)
