"""The trainer's maths: the clipped surrogate by hand, and packed-row logprobs against per-sample ones."""

from __future__ import annotations

import math

import pytest
import torch

from beam_rl.model.tiny import load_tiny_model, tiny_model_dir
from beam_rl.trainer.policy_loss import (
    PolicyLossStats,
    check_packed_attention,
    clipped_policy_loss,
    sampled_token_logprobs,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_tiny_model(tiny_model_dir(0, cache_dir=tmp_path_factory.mktemp("cache")))


def _loss_inputs():
    # ratios 1.5, 0.5, 1.1, 0.5 on trainable tokens; the 5th token is context with absurd values.
    logp_old = torch.tensor([-1.0, -2.0, -0.5, -1.0, 0.0])
    logp_new = logp_old + torch.log(torch.tensor([1.5, 0.5, 1.1, 0.5, 1e6]))
    advantages = torch.tensor([1.0, -1.0, 2.0, 1.0, 100.0])
    mask = torch.tensor([True, True, True, True, False])
    return logp_new.requires_grad_(), logp_old, advantages, mask


def test_clipped_loss_matches_the_hand_computed_surrogate_and_normalises_by_the_step_tokens():
    logp_new, logp_old, advantages, mask = _loss_inputs()
    # Per token min(r*A, clip(r, 0.8, 1.2)*A):
    #   r=1.5 A=+1: min(1.5, 1.2) = 1.2   (clipped)     r=0.5 A=-1: min(-0.5, -0.8) = -0.8 (clipped)
    #   r=1.1 A=+2: min(2.2, 2.2) = 2.2                  r=0.5 A=+1: min(0.5, 0.8) = 0.5
    # loss = -(1.2 - 0.8 + 2.2 + 0.5) / N, with N = 8 trainable tokens in the whole step.
    loss, stats = clipped_policy_loss(
        logp_new, logp_old, advantages, mask, clip_eps_low=0.2, clip_eps_high=0.2, num_tokens=8
    )
    assert loss.item() == pytest.approx(-3.1 / 8, abs=1e-6)
    loss.backward()
    # d loss / d logp_new = -A * r / N where the unclipped term is active, 0 where the clip is.
    expected_grad = torch.tensor([0.0, 0.0, -2.0 * 1.1 / 8, -1.0 * 0.5 / 8, 0.0])
    torch.testing.assert_close(logp_new.grad, expected_grad, atol=1e-6, rtol=0)
    assert stats.tokens == 4 and stats.clipped == 2
    summary = stats.summary()
    assert summary["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 0.5) / 4, abs=1e-6)
    assert (summary["ratio_min"], summary["ratio_max"]) == (pytest.approx(0.5), pytest.approx(1.5))
    assert summary["clip_fraction"] == 0.5
    k3 = sum(r - 1 - math.log(r) for r in (1.5, 0.5, 1.1, 0.5)) / 4
    assert summary["mismatch_kl"] == pytest.approx(k3, abs=1e-6)


def test_clip_higher_widens_only_the_upper_bound():
    logp_new, logp_old, advantages, mask = _loss_inputs()
    # eps_high 0.6 lets r=1.5 through unclipped: 1.5 - 0.8 + 2.2 + 0.5 = 3.4.
    loss, stats = clipped_policy_loss(
        logp_new, logp_old, advantages, mask, clip_eps_low=0.2, clip_eps_high=0.6, num_tokens=4
    )
    assert loss.item() == pytest.approx(-3.4 / 4, abs=1e-6) and stats.clipped == 1


def test_stats_add_across_micro_batches():
    a = PolicyLossStats(tokens=2, ratio_sum=2.5, ratio_min=0.9, ratio_max=1.6, clipped=1, mismatch_kl_sum=0.1)
    b = PolicyLossStats(tokens=3, ratio_sum=3.0, ratio_min=0.7, ratio_max=1.1, clipped=0, mismatch_kl_sum=0.2)
    total = PolicyLossStats() + a + b
    assert total.summary() == pytest.approx(
        {"ratio_mean": 5.5 / 5, "ratio_min": 0.7, "ratio_max": 1.6, "clip_fraction": 0.2, "mismatch_kl": 0.3 / 5}
    )


def test_loss_refuses_a_step_without_trainable_tokens():
    logp_new, logp_old, advantages, mask = _loss_inputs()
    with pytest.raises(ValueError, match="num_tokens must be positive"):
        clipped_policy_loss(logp_new, logp_old, advantages, mask, clip_eps_low=0.2, clip_eps_high=0.2, num_tokens=0)


def _alone_logprobs(model, ids: list[int], temperature: float) -> torch.Tensor:
    """Independent reference: one sample, a plain forward, log-softmax of logits / T at t-1 for token t."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    logp = torch.log_softmax(logits[:-1] / temperature, dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return torch.cat([torch.zeros(1), logp])


def test_packed_row_logprobs_equal_each_sample_run_alone_with_its_temperature(model):
    first, second, third = [5, 17, 230, 41, 9, 300], [77, 8, 150], [401, 3, 3, 62]
    ids = torch.tensor(first + second + third, dtype=torch.int32)
    positions = torch.tensor(list(range(6)) + list(range(3)) + list(range(4)), dtype=torch.int32)
    temps = torch.tensor([0.7] * 6 + [1.0] * 3 + [1.3] * 4)
    with torch.no_grad():
        packed = sampled_token_logprobs(model, ids, positions, temps)
    expected = torch.cat([_alone_logprobs(model, first, 0.7), _alone_logprobs(model, second, 1.0),
                          _alone_logprobs(model, third, 1.3)])
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=0)
    assert packed[[0, 6, 9]].tolist() == [0.0, 0.0, 0.0]  # first token of each sample: nothing to predict it from
    # Temperature matters: at T=1 the first sample's logprobs differ.
    assert not torch.allclose(expected[1:6], _alone_logprobs(model, first, 1.0)[1:], atol=1e-3)


def test_greedy_temperature_scores_with_unscaled_logits(model):
    ids = [5, 17, 230, 41]
    with torch.no_grad():
        greedy = sampled_token_logprobs(model, torch.tensor(ids), torch.arange(4), torch.zeros(4))
    torch.testing.assert_close(greedy, _alone_logprobs(model, ids, 1.0), atol=1e-5, rtol=0)


def test_packed_attention_check_passes_for_the_tiny_qwen2_and_rejects_a_model_that_ignores_positions(model):
    check_packed_attention(model)

    class IgnoresPositions(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def get_input_embeddings(self):
            return self.inner.get_input_embeddings()

        def forward(self, input_ids, position_ids=None, use_cache=None):
            return self.inner(input_ids=input_ids)  # one causal sequence: samples see each other

    with pytest.raises(RuntimeError, match="lets packed samples attend to each other"):
        check_packed_attention(IgnoresPositions(model))
