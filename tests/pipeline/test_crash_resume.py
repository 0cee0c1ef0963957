"""SIGKILL the whole orchestrator (pipeline, servers, trainer) at random moments and resume it from
its run directory: no step lost, none written twice, no group trained in two steps."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from beam_rl.rundir import RunDir
from tests.support.run_checks import assert_each_group_and_offset_once
from tests.support.small_run import write_small_run_config

KILLS = 5
MAX_STEPS = 24  # enough steps that five kills always land before the run ends


def _start(args: list[str], log: Path) -> subprocess.Popen:
    # A session of its own, so one killpg takes the servers, Prism and the trainer down with it.
    return subprocess.Popen([sys.executable, "-m", "beam_rl.cli", "run", *args],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


def _kill_all(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def test_killed_runs_resume_without_losing_or_duplicating_a_step(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    config = write_small_run_config(tmp_path / "crash.toml", run_dir.path, max_steps=MAX_STEPS, epochs=20)
    log = tmp_path / "orchestrator.log"
    rng = random.Random(7)
    kills = 0
    proc = _start([str(config)], log)
    while kills < KILLS:
        before = run_dir.last_committed_step() or 0
        deadline = time.monotonic() + 120
        while (run_dir.last_committed_step() or 0) == before and time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        if proc.poll() is not None:
            break  # finished before we got to kill it again
        time.sleep(rng.uniform(0.0, 1.0))  # somewhere inside the next steps: writing, training, dispatching
        _kill_all(proc)
        kills += 1
        proc = _start(["--resume", str(run_dir.path)], log)
    assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
    assert kills >= 5, f"only {kills} kills before the run finished"

    steps = run_dir.committed_steps()
    assert steps == list(range(1, MAX_STEPS + 1))  # contiguous from 1, none missing or repeated
    assert_each_group_and_offset_once(run_dir, steps)
    assert run_dir.latest_stable_weights()[0] == MAX_STEPS  # the trainer resumed too
    leftovers = [p for p in run_dir.rollouts_dir.rglob("*") if p.name.endswith(".tmp")]
    assert not leftovers
