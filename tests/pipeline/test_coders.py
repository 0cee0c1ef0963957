"""DomainCoder: what flows between stages round-trips, and Beam's size sampling never pickles it."""

from __future__ import annotations

import pickle

import apache_beam as beam
import numpy as np
import pytest
from apache_beam.typehints.native_type_compatibility import convert_to_beam_type

from beam_rl.scoring.advantages import AdvantageAlgorithm
from beam_rl.scoring.group import ScoredGroup, score_group
from beam_rl.source import EndOfInput
from beam_rl.types import Rollout, Turn
from runners.options import pipeline_options
from transforms import coders
from transforms.coders import DomainCoder, PackerItem


def _group(group_id: str = "g0", size: int = 4) -> ScoredGroup:
    rollouts = [
        Rollout(group_id=group_id, env_name="e", attempt=i, group_size=size, prompt_ids=[1, 2, 3],
                turns=[Turn(completion_ids=[4 + i] * (5 + i), logprobs=[-0.5] * (5 + i), finish_reason="stop")],
                reward=float(i % 2))
        for i in range(size)
    ]
    return score_group(rollouts, AdvantageAlgorithm("grpo"), [], temperature=1.0)


def test_the_registry_gives_domain_values_the_domain_coder():
    registry = beam.coders.registry
    for hint in (Rollout, ScoredGroup, EndOfInput, PackerItem):
        assert isinstance(registry.get_coder(hint), DomainCoder)
    # Type hints are converted so when a transform declares them (with_output_types).
    listed = registry.get_coder(convert_to_beam_type(list[Rollout]))
    assert isinstance(listed, beam.coders.ListCoder) and isinstance(listed.value_coder(), DomainCoder)


def test_a_scored_group_round_trips():
    group = _group()
    back = DomainCoder().decode(DomainCoder().encode(group))
    assert back.group_id == group.group_id and back.counts == group.counts
    assert [r.rollout_id for r in back.clean] == [r.rollout_id for r in group.clean]
    for a, b in zip(back.samples, group.samples, strict=True):
        for name in ("input_ids", "loss_mask", "logprobs", "advantages", "temperatures"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


@pytest.mark.parametrize("make", [_group, lambda: _group().samples and Rollout(
    group_id="g", env_name="e", attempt=0, group_size=1, prompt_ids=list(range(50)),
    turns=[Turn(list(range(200)), [-1.0] * 200)])])
def test_the_size_estimate_is_near_the_encoded_size_without_encoding(monkeypatch, make):
    value = make()
    encoded = len(DomainCoder().encode(value))
    monkeypatch.setattr(coders, "pickle", None)  # any pickling now fails
    estimate = DomainCoder().estimate_size(value)
    assert encoded / 2 <= estimate <= encoded * 2


def test_beam_measures_element_sizes_without_pickling_them(monkeypatch, tmp_path):
    """Prism fuses these stages: nothing is encoded to move between them, and the SDK's size
    sampling (the first elements of each PCollection are always measured) must not pickle either."""
    dumped: list[type] = []
    real_dumps = pickle.dumps

    class CountingPickle:
        HIGHEST_PROTOCOL = pickle.HIGHEST_PROTOCOL
        loads = staticmethod(pickle.loads)

        @staticmethod
        def dumps(value, protocol=None):
            dumped.append(type(value))
            return real_dumps(value, protocol)

    monkeypatch.setattr(coders, "pickle", CountingPickle)  # LOOPBACK: the worker runs in this process
    groups = [_group(f"g{i}") for i in range(12)]
    out = tmp_path / "seen.txt"

    def record(group: ScoredGroup) -> None:
        with open(out, "a") as f:
            f.write(group.group_id + "\n")

    with beam.Pipeline(options=pipeline_options("direct")) as p:
        _ = (p | beam.Impulse()
             | beam.FlatMap(lambda _: groups).with_output_types(ScoredGroup)
             | "Again" >> beam.Map(lambda g: g).with_output_types(ScoredGroup)
             | beam.Map(record))
    assert sorted(out.read_text().split()) == sorted(g.group_id for g in groups)
    assert ScoredGroup not in dumped


def test_a_group_part_is_one_pickle_and_round_trips_exactly():
    rollouts = [
        Rollout(group_id="g", env_name="e", attempt=i, group_size=2, prompt_ids=[1, 2], reward=0.1 * (i + 1),
                turns=[Turn(completion_ids=[3, 2**40], logprobs=[-0.1, -1e-300], policy_versions=[0, 1])])
        for i in range(2)
    ]
    coder = beam.coders.registry.get_coder(convert_to_beam_type(tuple[str, coders.GroupPart]))
    back = coder.decode(coder.encode(("g", rollouts)))
    # The part is one value (one pickle for the group), and nothing is rounded on the way: a reward of
    # 0.1 or 0.2, which float32 does not hold, and logprobs and ids beyond float32 and int32, come back as sent.
    assert isinstance(coder.coders()[1], DomainCoder)
    assert back == ("g", rollouts)
    assert [r.reward for r in back[1]] == [0.1, 0.2] and back[1][0].turns[0].logprobs == [-0.1, -1e-300]
    end = EndOfInput(shard=3, groups=17)
    assert coder.decode(coder.encode(("end_of_input/3", end))) == ("end_of_input/3", end)
    assert coders.estimated_bytes(rollouts) == sum(map(coders.estimated_bytes, rollouts))
