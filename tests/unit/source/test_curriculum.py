"""The curriculum (`envs[].curriculum`): prompts whose groups were all solved are not sent again, unsolved
ones wait `unsolved_every` epochs, each epoch's order is shuffled from the run's seed; everything it knows
comes from the committed windows, so a resumed run keeps every decision
(tests/pipeline/test_curriculum_across_a_kill.py)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from beam_rl.config import config_from_dict
from beam_rl.source.curriculum import Curriculum
from beam_rl.source.schedule import EnvSchedule, PromptSchedule


def _rule(**kwargs):
    return config_from_dict({"envs": [{"name": "arithmetic", "curriculum": kwargs}]}).envs[0].curriculum


def _window(groups: list[tuple[int, int, list[float]]]) -> pa.Table:
    """A window of (epoch, index, rewards) groups of env "arithmetic"."""
    rows = [{"group_id": f"arithmetic/e{e}-{i}", "env": "arithmetic", "epoch": e, "index": i, "is_eval": False,
             "status": "ok", "reward": r} for e, i, rewards in groups for r in rewards]
    return pa.Table.from_pylist(rows)


def test_outcomes_and_what_they_decide():
    curriculum = Curriculum({"arithmetic": _rule(easy_threshold=0.9, hard_threshold=0.1, solved_every=2,
                                                 unsolved_every=3)})
    curriculum.observe(_window([(0, 0, [1.0, 0.95]), (0, 1, [0.0, 0.1]), (0, 2, [1.0, 0.0])]))
    assert {k: v.outcome for k, v in curriculum.prompts.items()} == {
        ("arithmetic", 0): "solved", ("arithmetic", 1): "unsolved", ("arithmetic", 2): "mixed"}
    assert [curriculum.skip_reason("arithmetic", e, 0) for e in (0, 1, 2)] == [None, "solved", None]
    assert [curriculum.skip_reason("arithmetic", e, 1) for e in (1, 2, 3)] == ["unsolved", "unsolved", None]
    assert curriculum.skip_reason("arithmetic", 1, 2) is None and curriculum.skip_reason("arithmetic", 1, 3) is None
    assert curriculum.skip_reason("other_env", 1, 0) is None
    # The newest epoch's outcome decides; an errored attempt concludes nothing.
    errored = _window([(2, 0, [1.0, 1.0])]).to_pylist()
    errored[1]["status"] = "errored"
    curriculum.observe(pa.Table.from_pylist(errored))
    assert curriculum.prompts[("arithmetic", 0)].outcome == "mixed"
    assert curriculum.prompts[("arithmetic", 0)].pass_rates == [1.0, 0.5]
    assert curriculum.summary() == {"arithmetic": {"solved": 0, "unsolved": 1, "mixed": 2}}


def test_a_shuffled_schedule_visits_every_row_once_an_epoch_in_an_order_fixed_by_the_seed():
    rows = [{"i": i} for i in range(10)]

    def offsets(seed):
        schedule = PromptSchedule([EnvSchedule("a", rows, 2, 3, shuffle_seed=seed), EnvSchedule("b", rows[:4], 2, 1)])
        return [schedule.offset(p) for p in range(len(schedule))]

    shuffled = offsets(7)
    assert shuffled == offsets(7) and shuffled != offsets(8)
    for epoch in range(3):
        order = [i for env, e, i in shuffled if env == "a" and e == epoch]
        assert sorted(order) == list(range(10)) and order != list(range(10))
    assert [i for env, _, i in shuffled if env == "b"] == [0, 1, 2, 3]  # not shuffled: row order
    assert offsets(None)[:4] == [("a", 0, 0), ("b", 0, 0), ("a", 0, 1), ("b", 0, 1)]


@pytest.mark.parametrize("curriculum", [{"easy_threshold": 1.5}, {"hard_threshold": -0.1},
                                        {"easy_threshold": 0.5, "hard_threshold": 0.5}, {"solved_every": -1},
                                        {"unsolved_every": 0}, {"retire": True}])
def test_bad_curricula_are_named_by_key_at_load(curriculum):
    with pytest.raises(ValueError, match=r"envs\[0\]\.curriculum"):
        config_from_dict({"envs": [{"name": "arithmetic", "curriculum": curriculum}]})
