"""Checks of a finished run directory shared by the tests that kill and resume runs."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import time

import pyarrow as pa

from beam_rl.rundir import RunDir


def kill_after_step(run: subprocess.Popen, run_dir: RunDir, step: int, timeout_s: float = 180) -> list[int]:
    """SIGKILL the run's process group once `step` steps are committed; returns the steps committed then."""
    deadline = time.monotonic() + timeout_s
    while len(run_dir.committed_steps()) < step:
        assert run.poll() is None and time.monotonic() < deadline, "the run ended before the kill"
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    steps = run_dir.committed_steps()
    print(f"killed after step {steps[-1]}")
    return steps


def assert_each_group_and_offset_once(run_dir: RunDir, steps: list[int]) -> None:
    """Exactly once across the committed `steps`: no group consumed by two steps, no prompt offset
    consumed twice, and each step's rank-0 file holds only groups its commit names."""
    seen_groups: collections.Counter[str] = collections.Counter()
    seen_offsets: collections.Counter[tuple] = collections.Counter()
    for step in steps:
        commit = run_dir.read_commit(step)
        seen_groups.update(commit.window.group_ids)
        seen_offsets.update(commit.offsets)
        table = pa.ipc.open_file(pa.memory_map(str(run_dir.rank_path(step, 0)))).read_all()
        assert set(table.column("group_id").to_pylist()) <= set(commit.group_ids)
    assert max(seen_groups.values()) == 1, "a group was consumed by two steps"
    assert max(seen_offsets.values()) == 1, "a prompt offset was consumed twice"


def assert_rank_files_hold_the_windows_tokens(run_dir: RunDir, ranks: int = 1) -> list[dict]:
    """Every committed step's rank files hold, sample for sample, its window's rollouts: the prompt, then
    each turn's env ids and completion ids, only the completions trained, versions known; every ok rollout
    of the windows is in them once. Returns the windows' rollouts."""
    from beam_rl.trainer.reader import StepReader

    steps = run_dir.committed_steps()
    assert steps == list(range(1, len(steps) + 1)) and steps
    expected: dict[str, tuple[list[int], list[bool]]] = {}
    rollouts = []
    for step in steps:
        for row in run_dir.read_window(step).to_pylist():
            assert row["status"] == "ok", row["errors"]
            ids, mask = list(row["prompt_ids"]), [False] * len(row["prompt_ids"])
            for turn in row["turns"]:
                ids += turn["env_ids"] + turn["completion_ids"]
                mask += [False] * len(turn["env_ids"]) + [True] * len(turn["completion_ids"])
                assert min(turn["policy_versions"]) >= 0
            expected[row["rollout_id"]] = ids, mask
            rollouts.append(row)
    seen: collections.Counter[str] = collections.Counter()
    for step in steps:
        for rank in range(ranks):
            for batch in StepReader(run_dir, rank).read_step(step):
                bounds = batch["cu_seqlens"].tolist()
                for i, rollout_id in enumerate(batch["rollout_ids"]):
                    ids, mask = expected[rollout_id]
                    assert batch["input_ids"][bounds[i]:bounds[i + 1]].tolist() == ids
                    assert batch["loss_mask"][bounds[i]:bounds[i + 1]].tolist() == mask
                    seen[rollout_id] += 1
    assert set(seen) == set(expected) and max(seen.values()) == 1
    return rollouts
