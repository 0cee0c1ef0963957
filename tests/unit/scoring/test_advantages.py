"""Advantage algorithms against hand-computed values, the registry, and the batch-level whitening."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

from beam_rl.scoring.advantages import ALGORITHMS, get_algorithm, register_algorithm
from beam_rl.types import Rollout, Sample


def _adv(name: str, rewards: list[float], **params) -> np.ndarray:
    return get_algorithm(name, **params).group_advantages(rewards)


def test_grpo_default_is_bessel_std_and_verl_eps():
    # r = [1, 0, 0, 1]: mean 0.5, deviations +-0.5; Bessel var = 4 * 0.25 / 3 = 1/3, std = 0.5773502692
    # A = +-0.5 / (0.5773502692 + 1e-6) = +-0.5 / 0.5773512692 = +-0.8660239
    np.testing.assert_allclose(_adv("grpo", [1, 0, 0, 1]), [0.8660239, -0.8660239, -0.8660239, 0.8660239], rtol=1e-6)
    verl = _adv("grpo", [1, 0, 0, 1], eps=1e-6)
    np.testing.assert_array_equal(verl, _adv("grpo", [1, 0, 0, 1]))


def test_grpo_trl_eps_and_population_std():
    # TRL adds 1e-4: 0.5 / (0.5773502692 + 1e-4) = 0.5 / 0.5774502692 = 0.8658755
    np.testing.assert_allclose(_adv("grpo", [1, 0, 0, 1], eps=1e-4)[0], 0.8658755, rtol=1e-6)
    # Population std of [1, 0, 0, 1] is 0.5: 0.5 / (0.5 + 1e-6) = 0.999998
    np.testing.assert_allclose(_adv("grpo", [1, 0, 0, 1], unbiased_std=False)[0], 0.999998, rtol=1e-9)


def test_grpo_flat_group_and_singleton_are_zero():
    np.testing.assert_array_equal(_adv("grpo", [0.5, 0.5, 0.5]), [0, 0, 0])  # 0 / (0 + eps)
    np.testing.assert_array_equal(_adv("grpo", [3.0]), [0])
    assert _adv("grpo", []).shape == (0,)


def test_dr_grpo_is_mean_centred():
    # mean([3, 1, 2]) = 2
    np.testing.assert_array_equal(_adv("dr_grpo", [3, 1, 2]), [1, -1, 0])


def test_rloo_leave_one_out_baseline():
    # 3 - (1+2)/2 = 1.5; 1 - (3+2)/2 = -1.5; 2 - (3+1)/2 = 0  (= [1, -1, 0] * 3/2)
    np.testing.assert_allclose(_adv("rloo", [3, 1, 2]), [1.5, -1.5, 0], atol=1e-12)
    np.testing.assert_array_equal(_adv("rloo", [7]), [0])


def test_maxrl_divides_by_mean_and_zeroes_non_positive_means():
    # mean 0.5: (r - 0.5) / 0.5
    np.testing.assert_allclose(_adv("maxrl", [1, 0, 0, 1]), [1, -1, -1, 1])
    # mean 0.1: (0.2-0.1)/0.1 = 1, 0, (0-0.1)/0.1 = -1
    np.testing.assert_allclose(_adv("maxrl", [0.2, 0.1, 0.0]), [1, 0, -1], atol=1e-12)
    for rewards in ([0, 0], [-1, 1], [-2, -1]):  # means 0, 0, -1.5
        np.testing.assert_array_equal(_adv("maxrl", rewards), [0, 0])


def test_reinforce_pp_group_step_is_mean_centred():
    np.testing.assert_array_equal(_adv("reinforce_plus_plus_baseline", [3, 1, 2]), [1, -1, 0])


def _sample(advantage: float, completion: int, context: int = 1) -> Sample:
    n = context + completion
    mask = np.array([False] * context + [True] * completion)
    return Sample(
        input_ids=np.arange(n, dtype=np.int32),
        loss_mask=mask,
        logprobs=np.zeros(n, dtype=np.float32),
        advantages=np.where(mask, advantage, 0.0).astype(np.float32),
        temperatures=np.ones(n, dtype=np.float32),
        rollout_id="g/0",
        group_id="g",
        policy_version=0,
    )


def test_reinforce_pp_whitens_over_the_batch_trainable_tokens():
    a, b = _sample(1.0, completion=2), _sample(-1.0, completion=1, context=3)
    get_algorithm("reinforce_plus_plus_baseline").batch_normalize([a, b])
    # trainable values [1, 1, -1]: mean 1/3, deviations [2/3, 2/3, -4/3]
    # Bessel var = (4/9 + 4/9 + 16/9) / 2 = 4/3, sqrt(4/3 + 1e-8) = 1.1547005
    # (2/3) / 1.1547005 = 0.5773503, (-4/3) / 1.1547005 = -1.1547005; context stays 0
    np.testing.assert_allclose(a.advantages, [0, 0.5773503, 0.5773503], rtol=1e-6)
    np.testing.assert_allclose(b.advantages, [0, 0, 0, -1.1547005], rtol=1e-6)
    assert a.advantages.dtype == np.float32


def test_batch_normalize_is_a_no_op_for_other_algorithms_and_for_single_tokens():
    s = _sample(0.25, completion=2)
    get_algorithm("grpo").batch_normalize([s])
    np.testing.assert_array_equal(s.advantages, [0, 0.25, 0.25])
    one = _sample(3.0, completion=1)
    get_algorithm("reinforce_plus_plus_baseline").batch_normalize([one])
    np.testing.assert_array_equal(one.advantages, [0, 0])  # one token: centred value is 0
    get_algorithm("reinforce_plus_plus_baseline").batch_normalize([])


def _rollouts(rewards: list[float]) -> list[Rollout]:
    return [Rollout("e0-i1", "echo", i, len(rewards), reward=r) for i, r in enumerate(rewards)]


def test_finalize_group_writes_rollout_advantages():
    rollouts = _rollouts([1.0, 0.0, 0.0, 1.0])
    get_algorithm("dr_grpo").finalize_group(rollouts)
    assert [r.advantage for r in rollouts] == [0.5, -0.5, -0.5, 0.5]
    single = _rollouts([1.0])
    get_algorithm("grpo").finalize_group(single)
    assert single[0].advantage == 0.0


def test_finalize_group_rejects_non_finite_rewards():
    with pytest.raises(ValueError, match=r"rollout e0-i1/1: reward nan"):
        get_algorithm("grpo").finalize_group(_rollouts([1.0, math.nan]))


def test_registry_lookup_errors_and_custom_registration():
    assert {"grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "maxrl"} <= set(ALGORITHMS)
    with pytest.raises(ValueError, match="unknown advantage algorithm 'ppo'"):
        get_algorithm("ppo")
    with pytest.raises(ValueError, match=r"takes no parameter \['epsilon'\]"):
        get_algorithm("grpo", epsilon=1e-4)
    with pytest.raises(ValueError, match="whiten_eps"):
        get_algorithm("rloo", whiten_eps=1e-8)
    assert get_algorithm("reinforce_plus_plus_baseline", whiten_eps=1e-6).whiten_eps == 1e-6

    @register_algorithm("test_max_baseline")
    def max_baseline(rewards: np.ndarray, scale: float = 1.0) -> np.ndarray:
        """A = scale * (r - max(r))."""
        return scale * (rewards - rewards.max())

    try:
        np.testing.assert_array_equal(_adv("test_max_baseline", [1, 3], scale=2.0), [-4, 0])
        np.testing.assert_array_equal(max_baseline([5.0]), [0])  # singleton rule holds on direct calls
        with pytest.raises(ValueError, match="already registered"):
            register_algorithm("test_max_baseline")(max_baseline)
    finally:
        ALGORITHMS.pop("test_max_baseline")


def test_algorithm_pickles_and_has_a_parameter_key():
    algorithm = get_algorithm("grpo", eps=1e-4)
    restored = pickle.loads(pickle.dumps(algorithm))
    assert restored == algorithm and restored.key == ("grpo", (("eps", 1e-4),), None)
    assert hash(restored) == hash(algorithm)
    assert get_algorithm("grpo").key != algorithm.key
