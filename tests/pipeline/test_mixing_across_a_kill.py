"""Environments mixed by target share through a run on Prism killed (SIGKILL) and resumed: 3 to 1, one filtered
four times as often, trains 75/25 and `beam-rl inspect` shows it (the mix on its own: tests/unit/source/test_mixing.py)."""

from __future__ import annotations

import collections
import json
import os
import random
import subprocess
import sys

import pytest

from beam_rl.rundir import RunDir
from beam_rl.source.mixing import trained_by_env
from bench.learning.mixing import mixed_config
from tests.support.run_checks import assert_each_group_and_offset_once, kill_after_step

pytestmark = pytest.mark.timeout(600)

STEPS = 20


def _run(config: dict) -> subprocess.Popen:
    """The run in a process of its own, to be killed (bench.learning.mixing.run: a server answering 7 and 8 in turn,
    a stand-in trainer publishing weights as each step commits)."""
    code = "import json, sys; from bench.learning.mixing import run; run(json.loads(sys.argv[1]))"
    return subprocess.Popen([sys.executable, "-c", code, json.dumps(config)], start_new_session=True)


@pytest.mark.parametrize("shards", [1, 2])
def test_two_environments_at_3_to_1_one_four_times_as_often_filtered_train_75_25_across_a_kill(tmp_path, shards):
    # a: one group in ten filtered; b: four in ten, four times as often (bench.learning.mixing.FILTERED_OF_10).
    # 32 rollouts a step: a group is 0.6 points of what trains.
    config = mixed_config(tmp_path / "run", tmp_path / "data", STEPS, {"a": 3.0, "b": 1.0}, shards=shards,
                          rollouts_per_step=32)
    run_dir = RunDir(tmp_path / "run")
    kill_after_step(_run(config), run_dir, random.Random().randint(3, 12))
    assert _run(config).wait(timeout=300) == 0
    steps = run_dir.committed_steps()
    assert steps == list(range(1, STEPS + 1))
    assert_each_group_and_offset_once(run_dir, steps)

    trained = {"a": 0, "b": 0}
    consumed = {"a": 0, "b": 0}
    for step in steps:
        record = run_dir.read_commit(step)
        for env, n in trained_by_env(run_dir, record, "samples").items():
            trained[env] += n
        for env, _, _ in record.offsets:
            consumed[env] += 1
    filtered = collections.Counter()
    for step in steps:
        filtered.update(run_dir.read_commit(step).window.filtered)
    share_a = trained["a"] / (trained["a"] + trained["b"])
    print(f"filtered rollouts {dict(filtered)}")
    admitted_b = consumed["b"] / (consumed["a"] + consumed["b"])
    print(f"trained samples {trained} (a: {share_a:.3f} of them), groups consumed {consumed} (b: {admitted_b:.3f})")
    assert abs(share_a - 0.75) <= 0.02
    # The correction at work: b's groups train less, so b took far more than a quarter of the groups.
    assert admitted_b > 0.3

    shown = subprocess.run([sys.executable, "-m", "beam_rl.cli", "inspect", str(run_dir.path)], capture_output=True,
                           text=True, env={**os.environ, "COLUMNS": "10000"}, check=True).stdout
    assert f"mix of a: target 0.750 of trained samples, trained {share_a:.3f} ({trained['a']} samples)" in shown, \
        shown[-2000:]
