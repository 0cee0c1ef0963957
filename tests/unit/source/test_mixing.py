"""Environments mixed by target share (`envs[].ratio`): the next group goes to the environment furthest
behind its share of what trained, corrected by how much of each environment's groups trains; every
estimate comes from committed steps, so a killed and resumed run keeps its shares
(tests/pipeline/test_mixing_across_a_kill.py)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from beam_rl.config import ConfigError, config_from_dict
from beam_rl.source.mixing import EnvMix, EnvTarget
from beam_rl.source.schedule import EnvSchedule, PromptSchedule
from schemas.commit_record import CommitRecord

GROUP = 4


def _record(step: int, consumed: dict[str, int]) -> CommitRecord:
    offsets = sorted((env, 0, i) for env, n in consumed.items() for i in range(n))
    return CommitRecord.model_validate({
        "step": step, "schema_version": 3, "committed_at": 0.0, "group_ids": [], "offsets": offsets,
        "counts": {"ranks": 0, "micro_batches": [], "samples": 0, "tokens": 0, "trained_tokens": 0, "groups": 0,
                   "window_rollouts": 0},
        "timings": {}, "files": {"window.arrow": {"bytes": 0, "xxh3_128": "0" * 32}}, "window": {}, "extra": {}})


def _window(latency_s: dict[str, float]) -> pa.Table:
    return pa.Table.from_pylist([{"env": env, "is_eval": False, "t_sent": 10.0, "t_finished": 10.0 + s}
                                 for env, s in latency_s.items() for _ in range(GROUP)])


def test_the_environment_furthest_behind_its_share_goes_next_corrected_by_what_its_groups_train():
    mix = EnvMix([EnvTarget("a", 0.75, GROUP), EnvTarget("b", 0.25, GROUP)])
    assert mix.choose(["a", "b"], {}) == "a"  # nothing trained yet: the first in the config breaks the tie
    # a's groups trained whole (4 samples each), b's one in four: b's acceptance is about a quarter of a's.
    mix.observe(_record(1, {"a": 6, "b": 8}), {"a": 24, "b": 8}, _window({"a": 1.0, "b": 1.0}))
    assert mix.acceptance("a") == 4 and mix.acceptance("b") == 1
    assert mix.shares() == {"a": 0.75, "b": 0.25}
    # On target now; what is on its way decides: a group of a will likely train 4 samples, one of b 1.
    assert mix.choose(["a", "b"], {"a": 1}) == "b"
    assert mix.choose(["a", "b"], {"a": 1, "b": 4}) == "a"
    assert mix.choose(["a"], {"a": 100}) == "a" and mix.choose([], {}) is None
    # An environment whose groups never train is still not drawn to the exclusion of every other.
    stuck = EnvMix([EnvTarget("a", 0.5, GROUP), EnvTarget("b", 0.5, GROUP)])
    for step in range(1, 9):
        stuck.observe(_record(step, {"a": 4, "b": 4}), {"a": 16}, _window({"a": 1.0, "b": 1.0}))
    assert stuck.acceptance("b") == pytest.approx(0.1 * GROUP)


def test_in_flight_caps_follow_littles_law_from_each_environments_share_and_rollout_time():
    mix = EnvMix([EnvTarget("fast", 0.5, GROUP), EnvTarget("slow", 0.5, GROUP)])
    assert mix.caps(64) is None  # no rollout time measured yet: no caps
    mix.observe(_record(1, {"fast": 4, "slow": 4}), {"fast": 16, "slow": 16}, _window({"fast": 1.0, "slow": 3.0}))
    caps = mix.caps(64)
    # Same share and acceptance; slow rollouts take three times as long, so it needs three times the slots.
    assert caps == {"fast": 24, "slow": 72} and mix.caps(4) == {"fast": GROUP, "slow": 5}


def test_what_the_mix_knows_is_a_function_of_the_committed_steps_read_in_any_number_of_calls():
    steps = [(_record(s, {"a": s, "b": 3}), {"a": 2 * s, "b": s}, _window({"a": s, "b": 1.0})) for s in range(1, 12)]
    at_once, in_parts = (EnvMix([EnvTarget("a", 0.6, GROUP), EnvTarget("b", 0.4, GROUP)], by="tokens") for _ in "ab")
    for step in steps:
        at_once.observe(*step)
    for step in steps[:5]:
        in_parts.observe(*step)
    for step in steps[5:]:
        in_parts.observe(*step)
    assert at_once.summary(64) == in_parts.summary(64) and at_once.trained == {"a": 132, "b": 66}


def test_a_schedule_with_a_stream_per_environment_numbers_every_draw_once():
    schedule = PromptSchedule([EnvSchedule("a", [{}] * 3, GROUP, 2), EnvSchedule("b", [{}] * 1, GROUP, 3)],
                              stream_per_env=True)
    assert schedule.stream_lengths == (6, 3) and schedule.stream_envs == ("a", "b") and len(schedule) == 9
    # b's next epoch starts while a is still in its first: each stream is its environment's epochs in turn.
    assert [schedule.offset(schedule.position_of(1, k)) for k in range(3)] == [("b", 0, 0), ("b", 1, 0), ("b", 2, 0)]
    positions = [schedule.position_of(s, k) for s, n in enumerate(schedule.stream_lengths) for k in range(n)]
    assert sorted(schedule.position(schedule.offset(p)) for p in positions) == sorted(positions)


@pytest.mark.parametrize("envs, key", [
    ([{"name": "arithmetic", "ratio": 0}], r"envs\[0\]\.ratio"),
    ([{"name": "arithmetic", "ratio": -1.0}], r"envs\[0\]\.ratio"),
    ([{"name": "a", "kind": "arithmetic", "ratio": 3}, {"name": "b", "kind": "arithmetic"}], r"envs\[1\]\.ratio"),
])
def test_bad_ratios_are_named_by_key_at_load(envs, key):
    with pytest.raises((ConfigError, ValueError), match=key):
        config_from_dict({"envs": envs})
