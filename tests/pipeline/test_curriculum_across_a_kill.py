"""The curriculum through a run on Prism killed (SIGKILL) and resumed: prompts whose groups were all solved are not
sent again, unsolved ones wait `unsolved_every` epochs, and every decision survives the kill (the curriculum on
its own: tests/unit/source/test_curriculum.py)."""

from __future__ import annotations

import collections
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from beam_rl.rundir import RunDir
from tests.support.run_checks import assert_each_group_and_offset_once, kill_after_step

pytestmark = pytest.mark.timeout(600)

ROWS, SOLVABLE, GROUP, EPOCHS = 16, 8, 4, 3
# How long after its commit a source surely sees a step (it reads new commits every 0.25 s).
SEEN_AFTER_S = 1.0


def _dataset(directory: Path) -> Path:
    """ROWS sums, the first SOLVABLE of them with the answer the server always gives (7)."""
    directory.mkdir()
    rows = [{"question": f"{i} + {7 - i}", "answer": "7"} if i < SOLVABLE else {"question": f"{i} + 10",
                                                                                "answer": str(i + 10)}
            for i in range(ROWS)]
    (directory / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def _config(run_dir: Path, dataset: Path) -> dict:
    return {
        "run": {"dir": str(run_dir), "max_steps": 1000},  # to the end of the schedule
        "envs": [{"name": "arithmetic", "group_size": GROUP, "epochs": EPOCHS, "mode": "rollout",
                  "args": {"dataset": str(dataset)}, "curriculum": {"unsolved_every": 2}}],
        "model": {"max_context": 256},
        "batch": {"rollouts_per_step": 8, "seq_len": 256},
        "filters": {"zero_advantage": {"mode": "monitor"}},  # every group is all 1s or all 0s here
        # One group at a time, slowly: most of an epoch is committed before the next one's groups are sent.
        "inference": {"max_tokens": 8, "max_inflight": GROUP},
        "runner": {"name": "direct"},
    }


# The run in a process of its own, to be killed: its server always answers "7", after 0.2 s.
_RUN = """
import json, sys
from beam_rl.config import config_from_dict
from beam_rl.rundir import RunDir
from beam_rl.standin.faults import FaultConfig
from beam_rl.standin.server import EmbeddedServer
from beam_rl.job.rollouts import run_rollouts
config = config_from_dict(json.loads(sys.argv[1]))
RunDir(config.run.dir).write_config(config.model_dump(mode="json"))  # as `beam-rl run` does: inspect reads it
server = EmbeddedServer(mode="instant", served_model_name="tiny", max_num_seqs=16,
                        faults=FaultConfig(replies=[{"text": "7", "latency_s": 0.2}]))
run_rollouts(config, [server.start()], with_trainer=False)
server.stop()
"""


def _run(config: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _RUN, json.dumps(config)], start_new_session=True)


def test_solved_prompts_are_not_sent_again_and_a_run_killed_and_resumed_keeps_every_decision(tmp_path):
    config = _config(tmp_path / "run", _dataset(tmp_path / "data"))
    run_dir = RunDir(tmp_path / "run")
    # The kill lands anywhere in the first two epochs.
    first = kill_after_step(_run(config), run_dir, random.Random().randint(2, 6), timeout_s=120)
    assert _run(config).wait(timeout=300) == 0  # resumed: to the end of the schedule
    steps = run_dir.committed_steps()
    assert steps == list(range(1, len(steps) + 1)) and len(steps) > len(first)
    assert_each_group_and_offset_once(run_dir, steps)

    groups: dict[tuple[int, int], dict] = {}  # (epoch, index) -> its group's rewards, admitted, committed
    for step in steps:
        for r in run_dir.read_window(step).to_pylist():
            g = groups.setdefault((r["epoch"], r["index"]), {"rewards": [], "admitted": r["t_admitted"]})
            g["rewards"].append(r["reward"])
            g["committed"] = r["t_committed"]
            g["admitted"] = min(g["admitted"], r["t_admitted"])
    assert all(len(g["rewards"]) == GROUP for g in groups.values())
    assert {i for (_, i), g in groups.items() if set(g["rewards"]) == {1.0}} == set(range(SOLVABLE))
    # The rule, against what the source could see: once a prompt's solved group is committed, no later
    # epoch's group of it is sent; once an unsolved one is, none in the next epoch.
    for (epoch, index), g in groups.items():
        for earlier in range(epoch):
            before = groups.get((earlier, index))
            if before is None or before["committed"] + SEEN_AFTER_S > g["admitted"]:
                continue
            assert index >= SOLVABLE and epoch - earlier >= 2, (epoch, index, earlier)
    # And it is not vacuous: most later-epoch groups of solved prompts were never sent.
    later_solved = [k for k in groups if k[0] > 0 and k[1] < SOLVABLE]
    assert len(later_solved) <= SOLVABLE // 2, sorted(later_solved)

    skips = [m["curriculum_skip"] for m in map(json.loads, run_dir.metrics_path.read_text().splitlines())
             if "curriculum_skip" in m]
    skipped = {(s["epoch"], s["index"]): s for s in skips}
    assert skipped and not set(skipped) & set(groups)  # a group skipped is never trained
    for (epoch, index), s in skipped.items():
        assert s["reason"] == ("solved" if index < SOLVABLE else "unsolved") and s["outcome_epoch"] < epoch
    # Every group of the schedule was trained or skipped (a skipped one may be decided again after a restore).
    assert len(groups) + len(skipped) == ROWS * EPOCHS
    counted = collections.Counter(s["reason"] for s in skipped.values())
    print(f"curriculum: {len(groups)} groups trained, skipped {dict(counted)} of {ROWS * EPOCHS}")

    shown = subprocess.run([sys.executable, "-m", "beam_rl.cli", "inspect", str(run_dir.path)], capture_output=True,
                           text=True, env={**os.environ, "COLUMNS": "10000"}, check=True).stdout
    # A prompt's outcome is the same every epoch here: the first SOLVABLE are solved, the rest unsolved.
    assert (f"curriculum of arithmetic: {ROWS} prompts trained, newest outcome {SOLVABLE} solved, "
            f"{ROWS - SOLVABLE} unsolved, 0 mixed; groups kept back: {counted['solved']} solved, "
            f"{counted['unsolved']} unsolved") in shown, shown[-2000:]
