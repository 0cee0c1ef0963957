"""A run directory written by the Beam 2.62 release resumes under this one.

`tests/fixtures/run-beam-2.62/` was made by beam-rl at commit ceb75ca (Apache Beam 2.62.0, Prism 2.62) from
`tests/fixtures/run-beam-2.62.toml`, killed with SIGKILL (its whole process group) while step 3 was being
written: steps 1 and 2 committed, step 3 a rank file and an empty temporary window file, no COMMIT.json; a
stale run.lock of the dead process. Its config.json names the run directory relatively (`run`), so the
copy resumes where it lies. What the run directory holds is the contract, not the runner's state: no
Beam state or Flink savepoint crosses the upgrade (a 2.62 savepoint need not restore under 2.70).
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from beam_rl.rundir import RunDir
from tests.support.run_checks import assert_each_group_and_offset_once
from tests.support.paths import FIXTURES

FIXTURE = FIXTURES / "run-beam-2.62"
MAX_STEPS = 8  # the fixture's config.json


@pytest.mark.timeout(400)
def test_a_run_directory_written_under_beam_2_62_resumes_contiguously(tmp_path):
    shutil.copytree(FIXTURE, tmp_path / "run")
    run_dir = RunDir(tmp_path / "run")
    assert run_dir.committed_steps() == [1, 2]
    before = {p.relative_to(FIXTURE): p.read_bytes() for p in (FIXTURE / "rollouts").rglob("*")
              if p.is_file() and p.parent.name in ("step_1", "step_2")}

    proc = subprocess.run([sys.executable, "-m", "beam_rl.cli", "run", "--resume", "run"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=360)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "steps 1..2 are committed, continuing at 3" in proc.stdout

    steps = run_dir.committed_steps()
    assert steps == list(range(1, MAX_STEPS + 1))  # contiguous: the torn step 3 written again, none twice
    for rel, data in before.items():  # the 2.62 steps are kept as they were
        assert (run_dir.path / rel).read_bytes() == data, rel
    assert_each_group_and_offset_once(run_dir, steps)
    assert not [p for p in run_dir.rollouts_dir.rglob("*") if ".tmp" in p.name]  # the torn file cleaned up
