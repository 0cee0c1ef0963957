"""Ctrl-C on the main job: it stops cleanly (pipeline cancelled, servers and trainer gone, committed
steps whole) and `--resume` finishes the run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from beam_rl.rundir import RunDir
from tests.support.small_run import write_small_run_config


def _session_alive(session: int) -> list[int]:
    """Processes still in the job's session (its servers, trainer, Prism)."""
    alive = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == session:
                    alive.append(int(entry))
            except (ProcessLookupError, PermissionError):
                pass
    return alive


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_stops_everything_and_resume_finishes(tmp_path, signum):
    run_dir = RunDir(tmp_path / "run")
    config = write_small_run_config(tmp_path / "run.toml", run_dir.path, max_steps=6, epochs=10)
    proc = subprocess.Popen([sys.executable, "-m", "beam_rl.cli", "run", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while not run_dir.committed_steps() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert run_dir.committed_steps(), "no step committed before the interrupt"
    if signum == signal.SIGINT:
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends the whole foreground group
    else:
        proc.send_signal(signal.SIGTERM)  # what a process manager sends the command alone
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, output.decode(errors="replace")[-2000:]
    assert f"interrupted ({signum.name}): committed steps are kept".encode() in output
    assert b"Traceback" not in output, output.decode(errors="replace")[-4000:]  # Beam's account: beam.log
    time.sleep(1.0)
    assert _session_alive(proc.pid) == []  # no server, trainer or runner left behind
    committed = run_dir.committed_steps()
    assert committed == list(range(1, len(committed) + 1))

    resumed = subprocess.run([sys.executable, "-m", "beam_rl.cli", "run", "--resume", str(run_dir.path)],
                             capture_output=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout.decode(errors="replace")[-2000:]
    assert run_dir.committed_steps() == list(range(1, 7))
