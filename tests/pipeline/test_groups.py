"""CompleteGroups on Prism: rollouts arrive in parts (one by one, or a whole group at once), in any
order and interleaved across groups, and every group leaves exactly once, whole, ordered by attempt; a
shard's end of input passes through on its way to the packer."""

from __future__ import annotations

import json

import apache_beam as beam

from beam_rl.source import EndOfInput
from beam_rl.types import Rollout
from runners.options import pipeline_options
from transforms.coders import GroupPart
from transforms.groups import CompleteGroups


def _rollouts(group_id: str, attempts: list[int], size: int) -> list[Rollout]:
    return [Rollout(group_id=group_id, env_name="e", attempt=a, group_size=size) for a in attempts]


def test_rollouts_in_any_order_leave_as_whole_groups_once_and_ordered_and_the_end_of_input_passes(tmp_path):
    arrivals = [
        *_rollouts("a", [2, 0], 4), *_rollouts("split", [3], 4), *_rollouts("b", [1, 0], 2),
        *_rollouts("a", [1, 3], 4), *_rollouts("split", [0, 2], 4), *_rollouts("split", [1], 4),
        *_rollouts("again", [0], 1),
    ]
    whole = _rollouts("whole", [1, 2, 0], 3)
    out = tmp_path / "released.jsonl"

    def record(released):
        key, value = released
        line = [key, value.groups] if isinstance(value, EndOfInput) else [key, [r.attempt for r in value]]
        with open(out, "a") as f:  # LOOPBACK: the SDK worker runs in this process
            f.write(json.dumps(line) + "\n")

    with beam.Pipeline(options=pipeline_options("direct")) as p:
        # Impulse + FlatMap rather than Create: Prism refuses Create's reshuffle in streaming mode.
        _ = (p | beam.Impulse()
             | beam.FlatMap(lambda _: [(r.group_id, [r]) for r in arrivals] + [("end/0", EndOfInput(0, 5)),
                                                                                ("whole", whole)])
             .with_output_types(tuple[str, GroupPart])
             | CompleteGroups() | beam.Map(record))

    released = sorted(tuple(json.loads(line)) for line in out.read_text().splitlines())
    assert released == [("a", [0, 1, 2, 3]), ("again", [0]), ("b", [0, 1]), ("end/0", 5), ("split", [0, 1, 2, 3]),
                        ("whole", [0, 1, 2])]
