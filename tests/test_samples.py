"""trace_to_samples: exact ids, masks and per-token training data from a rollout's turns."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from beam_rl.samples import samples_from_columns, samples_to_columns, trace_to_samples
from beam_rl.types import Rollout, Turn


def _rollout(turns: list[Turn], **kw) -> Rollout:
    return Rollout(group_id="e0-i3", env_name="echo", attempt=2, group_size=4, prompt_ids=[1, 2, 3], turns=turns, **kw)


def test_multi_turn_layout_masks_and_values():
    rollout = _rollout(
        [
            Turn(completion_ids=[10, 11], logprobs=[-0.1, -0.2], finish_reason="stop"),
            Turn(completion_ids=[12], logprobs=[-0.3], finish_reason="stop", env_ids=[20, 21]),
        ],
        advantage=0.5,
        temperature=0.7,
        reward=1.0,
        policy_version_start=4,
    )
    (sample,) = trace_to_samples(rollout)
    # prompt | turn 0 completion | turn 1 env | turn 1 completion
    np.testing.assert_array_equal(sample.input_ids, [1, 2, 3, 10, 11, 20, 21, 12])
    np.testing.assert_array_equal(sample.loss_mask, [0, 0, 0, 1, 1, 0, 0, 1])
    np.testing.assert_allclose(sample.logprobs, [0, 0, 0, -0.1, -0.2, 0, 0, -0.3], rtol=1e-6)
    np.testing.assert_allclose(sample.advantages, [0, 0, 0, 0.5, 0.5, 0, 0, 0.5])
    np.testing.assert_allclose(sample.temperatures, [0.7] * 8, rtol=1e-6)
    assert sample.input_ids.dtype == np.int32
    assert sample.loss_mask.dtype == np.bool_
    assert {sample.logprobs.dtype, sample.advantages.dtype, sample.temperatures.dtype} == {np.dtype(np.float32)}
    assert (sample.rollout_id, sample.group_id, sample.policy_version, sample.reward) == ("e0-i3/2", "e0-i3", 4, 1.0)
    assert len(sample) == rollout.num_tokens == 8


def test_logprob_count_mismatch_names_the_rollout_and_turn():
    rollout = _rollout([Turn([10], [-0.1]), Turn([11, 12], [-0.2], env_ids=[5])])
    with pytest.raises(ValueError, match=r"rollout e0-i3/2 turn 1: 1 logprobs for 2 completion ids"):
        trace_to_samples(rollout)


@pytest.mark.parametrize("bad", [None, float("nan"), float("-inf")])
def test_missing_or_non_finite_logprob_is_an_error(bad):
    with pytest.raises(ValueError, match="rollout e0-i3/2 turn 0: logprob"):
        trace_to_samples(_rollout([Turn([10, 11], [-0.1, bad])]))


def test_ids_outside_int32_are_an_error():
    with pytest.raises(ValueError, match="rollout e0-i3/2: turn 0 completion_ids"):
        trace_to_samples(_rollout([Turn([2**31], [-0.1])]))
    with pytest.raises(ValueError, match="negative token id -1"):
        trace_to_samples(_rollout([Turn([-1], [-0.1])]))


def test_rollout_without_turns_has_no_sample():
    assert trace_to_samples(_rollout([])) == []


def test_samples_round_trip_through_columns_and_stay_independent():
    samples = [s for n in (1, 4, 2) for s in trace_to_samples(
        _rollout([Turn(completion_ids=list(range(10, 10 + n)), logprobs=[-0.5] * n)], advantage=n, reward=n))]
    back = samples_from_columns(pickle.loads(pickle.dumps(samples_to_columns(samples))))
    assert [(s.rollout_id, s.group_id, s.policy_version, s.reward) for s in back] == \
        [(s.rollout_id, s.group_id, s.policy_version, s.reward) for s in samples]
    for a, b in zip(back, samples, strict=True):
        for name in ("input_ids", "loss_mask", "logprobs", "advantages", "temperatures"):
            got, want = getattr(a, name), getattr(b, name)
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
    back[0].advantages *= 0  # a batch normalisation writes in place: the neighbours keep theirs
    np.testing.assert_array_equal(back[1].advantages, samples[1].advantages)
    assert samples_from_columns(samples_to_columns([])) == []
