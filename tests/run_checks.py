"""Checks of a finished run directory shared by the tests that kill and resume runs."""

from __future__ import annotations

import collections

import pyarrow as pa

from beam_rl.rundir import RunDir


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
