"""CompleteGroups on Prism: whole groups pass straight through, groups sent in parts are collected
in keyed state; either way every group leaves exactly once, whole, ordered by attempt."""

from __future__ import annotations

import json

import apache_beam as beam

from beam_rl.types import Rollout
from runners.options import pipeline_options
from transforms.groups import CompleteGroups


def _rollouts(group_id: str, attempts: list[int], size: int) -> list[Rollout]:
    return [Rollout(group_id=group_id, env_name="e", attempt=a, group_size=size) for a in attempts]


def test_whole_groups_and_groups_in_parts_each_leave_once_whole_and_ordered(tmp_path):
    parts = [
        _rollouts("whole-a", [2, 0, 1, 3], 4),
        _rollouts("split", [3], 4),
        _rollouts("whole-b", [1, 0], 2),
        _rollouts("split", [0, 2], 4),
        _rollouts("split", [1], 4),
    ]

    out = tmp_path / "released.jsonl"

    def record(released):
        group_id, group = released
        with open(out, "a") as f:  # LOOPBACK: the SDK worker runs in this process
            f.write(json.dumps([group_id, [r.attempt for r in group]]) + "\n")

    with beam.Pipeline(options=pipeline_options("direct")) as p:
        # Impulse + FlatMap rather than Create: Prism refuses Create's reshuffle in streaming mode.
        _ = p | beam.Impulse() | beam.FlatMap(lambda _: parts) | CompleteGroups() | beam.Map(record)

    released = sorted(tuple(json.loads(line)) for line in out.read_text().splitlines())
    assert released == [("split", [0, 1, 2, 3]), ("whole-a", [0, 1, 2, 3]), ("whole-b", [0, 1])]
