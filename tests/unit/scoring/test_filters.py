"""Rollout filters: each detection rule on hand-made rollouts, and monitor vs enforce accounting."""

from __future__ import annotations

import math

import pytest

from beam_rl.scoring.filters import (
    FilterCounts,
    GibberishFilter,
    OverlongFilter,
    RepetitionFilter,
    StaleFilter,
    ZeroAdvantageFilter,
    apply_filters,
    make_filter,
    oldest_policy_version,
)
from beam_rl.types import Rollout, RolloutStatus, Turn


def _rollout(
    attempt: int = 0,
    reward: float = 0.0,
    ids: list[int] | None = None,
    logprobs: list[float] | None = None,
    group_id: str = "e0-i0",
    **kw,
) -> Rollout:
    ids = [5, 6] if ids is None else ids
    logprobs = [-1.0] * len(ids) if logprobs is None else logprobs
    turns = kw.pop("turns", [Turn(ids, logprobs, finish_reason=kw.pop("finish_reason", "stop"))])
    return Rollout(group_id, "echo", attempt, 4, prompt_ids=[1], turns=turns, reward=reward, **kw)


def test_zero_advantage_monitor_counts_without_flagging():
    group = [_rollout(i, reward=1.0) for i in range(3)]
    counts = apply_filters([ZeroAdvantageFilter(mode="monitor")], group)
    assert counts.monitored == {"zero_advantage": 3} and not counts.enforced
    assert [r.filtered for r in group] == [None, None, None]


def test_zero_advantage_enforce_flags_only_flat_groups():
    flat = [_rollout(i, reward=0.5, group_id="e0-i0") for i in range(2)]
    mixed = [_rollout(i, reward=float(i), group_id="e0-i1") for i in range(2)]
    counts = apply_filters([ZeroAdvantageFilter(mode="enforce")], flat + mixed)
    assert counts.enforced == {"zero_advantage": 2}
    assert [r.filtered for r in flat + mixed] == ["zero_advantage", "zero_advantage", None, None]


def test_gibberish_needs_a_rare_id_and_a_surprising_logprob():
    f = GibberishFilter(vocab_size=1000, mode="enforce")
    # id threshold 0.9 * 1000 = 900; logprob threshold -log(1000) - 2 = -6.9078 - 2 = -8.9078
    assert f.detect(_rollout(ids=[3, 950], logprobs=[-0.1, -9.0]))
    assert not f.detect(_rollout(ids=[3, 950], logprobs=[-0.1, -8.5]))  # rare but not surprising
    assert not f.detect(_rollout(ids=[3, 850], logprobs=[-0.1, -12.0]))  # surprising but common
    assert not f.detect(_rollout(ids=[900], logprobs=[-12.0]))  # id must be above the threshold
    second_turn = _rollout(turns=[Turn([3], [-0.1]), Turn([999], [-20.0], env_ids=[7])])
    assert f.detect(second_turn)
    assert GibberishFilter(vocab_size=1000, token_id_frac=0.75, logprob_offset=0.0).detect(
        _rollout(ids=[751], logprobs=[-7.0])  # 751 > 750 and -7.0 < -6.9078
    )


def test_repetition_needs_a_long_enough_streak_of_near_certain_tokens():
    f = RepetitionFilter(window=4)
    certain = -0.001  # exp(-0.001) = 0.999 > 0.99
    assert f.detect(_rollout(ids=[1] * 5, logprobs=[-2.0] + [certain] * 4))
    assert not f.detect(_rollout(ids=[1] * 7, logprobs=[certain] * 3 + [-0.5] + [certain] * 3))
    # exactly p = 0.99 is not "above" it
    assert not f.detect(_rollout(ids=[1] * 4, logprobs=[math.log(0.99)] * 4))
    # a streak does not run through environment tokens
    split = _rollout(turns=[Turn([1, 1], [certain] * 2), Turn([1, 1], [certain] * 2, env_ids=[9])])
    assert not f.detect(split)
    assert RepetitionFilter().window == 1000 and RepetitionFilter().prob_threshold == 0.99
    assert (RepetitionFilter().mode, ZeroAdvantageFilter().mode) == ("monitor", "enforce")


def test_overlong_flags_truncated_rollouts():
    f = OverlongFilter(mode="enforce")
    assert f.detect(_rollout(finish_reason="length"))
    assert not f.detect(_rollout(finish_reason="stop"))


def test_stale_is_always_enforced_and_needs_the_step():
    f = StaleFilter(max_off_policy_steps=1)
    assert f.mode == "enforce"
    # step 5 trains policy 4; oldest allowed start version = 5 - 1 - 1 = 3
    old, ok = _rollout(0, policy_version_start=2), _rollout(1, policy_version_start=3)
    counts = apply_filters([f], [old, ok], step=5)
    assert counts.enforced == {"stale": 1}
    assert (old.filtered, ok.filtered) == ("stale", None)
    with pytest.raises(ValueError, match="needs the step"):
        apply_filters([f], [ok])


def test_staleness_is_the_oldest_tokens_not_the_start_versions():
    f = StaleFilter(max_off_policy_steps=1)
    # Sent under version 2, but it waited through an update (or continued under new weights): its tokens
    # are versions 3 and 4, inside the bound of step 5 (oldest allowed 3).
    younger = _rollout(0, policy_version_start=2)
    younger.turns[0].policy_versions = [3] * (len(younger.turns[0].completion_ids) - 1) + [4]
    # Its start version was 3, but an unknown version among its tokens is judged by the start.
    unknown = _rollout(1, policy_version_start=3)
    unknown.turns[0].policy_versions = [-1] * len(unknown.turns[0].completion_ids)
    # A token of version 2 makes it stale, whatever its start says.
    older = _rollout(2, policy_version_start=3)
    older.turns[0].policy_versions = [2] + [3] * (len(older.turns[0].completion_ids) - 1)
    assert [oldest_policy_version(r) for r in (younger, unknown, older)] == [3, 3, 2]
    assert oldest_policy_version(older.record()) == 2  # the same from the record's arrays
    apply_filters([f], [younger, unknown, older], step=5)
    assert [r.filtered for r in (younger, unknown, older)] == [None, None, "stale"]


@pytest.mark.parametrize("versions, oldest", [
    ([[4, 5], [6], [7, 7]], 4),  # each turn's own versions: the lowest of all
    ([[6, 6], [3], [7, 7]], 3),  # the oldest in a middle turn, after the environment's tokens
    ([[6, 6], [], [7]], 2),  # a turn whose versions are unknown: judged by the start
    ([[6, -1], [6], [7]], 2),  # one unknown token
])
def test_a_multi_turn_records_oldest_token_is_its_rollouts(versions: list[list[int]], oldest: int) -> None:
    """The record reads its completion tokens' versions turn by turn from its arrays, past the prompt and
    the environment's tokens (whose versions are unknown), as the rollout does from its turns."""
    turns = [Turn([9] * max(len(v), 1), [-1.0] * max(len(v), 1), "stop", env_ids=[8] * 3 * i, policy_versions=v)
             for i, v in enumerate(versions)]
    rollout = _rollout(0, policy_version_start=2, turns=turns)
    rollout.prompt_ids = [1, 1, 1, 1]
    assert oldest_policy_version(rollout) == oldest_policy_version(rollout.record()) == oldest


def test_off_mode_is_skipped_and_errored_rollouts_are_not_inspected():
    truncated = _rollout(finish_reason="length")
    assert apply_filters([OverlongFilter(mode="off")], [truncated]) == FilterCounts()
    errored = _rollout(finish_reason="length", status=RolloutStatus.ERROR)
    assert apply_filters([OverlongFilter(mode="enforce")], [errored]) == FilterCounts()
    assert errored.filtered is None


def test_each_rule_counts_and_the_first_enforced_reason_sticks():
    r = _rollout(ids=[999], logprobs=[-20.0], finish_reason="length")
    filters = [GibberishFilter(vocab_size=1000, mode="enforce"), OverlongFilter(mode="enforce"),
               RepetitionFilter(window=1, prob_threshold=0.5, mode="monitor")]
    counts = apply_filters(filters, [r])
    assert counts.enforced == {"gibberish": 1, "overlong": 1}
    assert counts.monitored == {}  # exp(-20) is not above 0.5
    assert r.filtered == "gibberish"
    total = counts + FilterCounts(monitored={"repetition": 2}, enforced={"overlong": 1})
    assert total.as_dict() == {"monitored": {"repetition": 2}, "enforced": {"gibberish": 1, "overlong": 2}}


def test_make_filter_and_validation():
    assert make_filter("gibberish", vocab_size=50, mode="enforce") == GibberishFilter(vocab_size=50, mode="enforce")
    with pytest.raises(ValueError, match="unknown filter 'junk'"):
        make_filter("junk")
    with pytest.raises(ValueError, match="mode 'strict'"):
        make_filter("overlong", mode="strict")
    with pytest.raises(ValueError, match="filter stale"):
        make_filter("stale", max_off_policy_steps=1, mode="monitor")
    with pytest.raises(ValueError, match="token_id_frac"):
        GibberishFilter(vocab_size=50, token_id_frac=1.5)
    with pytest.raises(ValueError, match="rollout e0-i0/0 turn 0: 1 logprobs for 2"):
        GibberishFilter(vocab_size=50).detect(_rollout(ids=[1, 2], logprobs=[-1.0]))
