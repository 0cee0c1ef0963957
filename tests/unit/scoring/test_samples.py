"""trace_to_samples: exact ids, masks and per-token training data from a rollout's turns."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from beam_rl.scoring.samples import (
    samples_from_columns,
    samples_to_columns,
    share_sample_tokens,
    trace_to_samples,
    without_token_arrays,
)
from beam_rl.types import Rollout, Turn
from schemas.fields import SAMPLE_TOKEN_FIELDS


def _rollout(turns: list[Turn], **kw) -> Rollout:
    return Rollout(group_id="e0-i3", env_name="echo", attempt=2, group_size=4, prompt_ids=[1, 2, 3], turns=turns, **kw)


def test_multi_turn_layout_masks_and_values():
    rollout = _rollout(
        [
            Turn(completion_ids=[10, 11], logprobs=[-0.1, -0.2], finish_reason="stop", policy_versions=[4, 5]),
            Turn(completion_ids=[12], logprobs=[-0.3], finish_reason="stop", env_ids=[20, 21]),  # versions unknown
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
    np.testing.assert_array_equal(sample.policy_versions, [-1, -1, -1, 4, 5, -1, -1, -1])
    assert sample.input_ids.dtype == np.int32 and sample.policy_versions.dtype == np.int32
    assert sample.loss_mask.dtype == np.bool_
    assert {sample.logprobs.dtype, sample.advantages.dtype, sample.temperatures.dtype} == {np.dtype(np.float32)}
    assert (sample.rollout_id, sample.group_id, sample.policy_version, sample.reward) == ("e0-i3/2", "e0-i3", 4, 1.0)
    assert len(sample) == rollout.num_tokens == 8


def test_logprob_count_mismatch_names_the_rollout_and_turn():
    rollout = _rollout([Turn([10], [-0.1]), Turn([11, 12], [-0.2], env_ids=[5])])
    with pytest.raises(ValueError, match=r"rollout e0-i3/2 turn 1: 1 logprobs for 2 completion ids"):
        trace_to_samples(rollout)


def test_policy_version_count_mismatch_names_the_rollout_and_turn():
    rollout = _rollout([Turn([10, 11], [-0.1, -0.2], policy_versions=[3])])
    with pytest.raises(ValueError, match=r"rollout e0-i3/2 turn 0: 1 policy versions for 2 completion ids"):
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
        for name in (f.name for f in SAMPLE_TOKEN_FIELDS):
            got, want = getattr(a, name), getattr(b, name)
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
    back[0].advantages *= 0  # a batch normalisation writes in place: the neighbours keep theirs
    np.testing.assert_array_equal(back[1].advantages, samples[1].advantages)
    assert samples_from_columns(samples_to_columns([])) == []


def test_a_record_and_its_sample_share_token_arrays_and_a_record_stored_without_them_gets_them_back():
    rollout = _rollout([Turn([10, 11], [-0.1, -0.2], "stop", policy_versions=[1, 1])], advantage=1.0)
    (sample,) = trace_to_samples(rollout)
    record = rollout.record()
    for name in ("input_ids", "logprobs", "policy_versions"):  # the rollout's tokens, converted once
        assert getattr(record.tokens, name) is getattr(sample, name)
    stored = without_token_arrays([record], {sample.rollout_id})[id(record)]
    assert stored.tokens.input_ids is None and record.tokens.input_ids is not None  # a copy; the original keeps them
    back = pickle.loads(pickle.dumps(stored))
    assert len(pickle.dumps(stored)) < len(pickle.dumps(record)) - 5 * 4  # 5 tokens x (ids + versions) at least
    share_sample_tokens([back], [sample])
    assert back == record and back.tokens.input_ids is sample.input_ids
    (other,) = samples_from_columns(samples_to_columns([sample]))  # equal values in other arrays
    share_sample_tokens([record], [other])
    assert record.tokens.input_ids is other.input_ids
    assert without_token_arrays([record], {"another/0"}) == {}


def test_a_sample_of_another_length_is_not_taken_for_a_records_tokens():
    rollout = _rollout([Turn([10, 11], [-0.1, -0.2])])
    (other,) = trace_to_samples(_rollout([Turn([10], [-0.1])]))
    with pytest.raises(ValueError, match="rollout e0-i3/2: its sample has 4 tokens, its record 5"):
        share_sample_tokens([rollout.record()], [other])
