"""Packing: FFD micro-batches, samples balanced across ranks, and the batch cut."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from beam_rl.packing.packer import BatchCutter, pack_for_ranks, pack_micro_batches
from beam_rl.types import MicroBatch, Rollout, Sample, Turn


def _sample(n: int, name: str, completion: int = 1) -> Sample:
    mask = np.arange(n) >= n - completion
    return Sample(
        input_ids=np.arange(100, 100 + n, dtype=np.int32),
        loss_mask=mask,
        logprobs=np.where(mask, -0.5, 0.0).astype(np.float32),
        advantages=np.where(mask, 1.5, 0.0).astype(np.float32),
        temperatures=np.full(n, 0.8, dtype=np.float32),
        rollout_id=name,
        group_id="g",
        policy_version=0,
    )


def _lengths(mbs: list[MicroBatch]) -> list[list[int]]:
    return [[len(s) for s in mb.samples] for mb in mbs]


def test_ffd_on_a_hand_example():
    samples = [_sample(n, f"r{n}") for n in (3, 6, 2, 5, 4)]
    # decreasing: 6 -> bin0 (room 4); 5 -> bin1 (room 5); 4 -> bin0 (room 0); 3 -> bin1 (room 2); 2 -> bin1 (room 0)
    assert _lengths(pack_micro_batches(samples, seq_len=10)) == [[6, 4], [5, 3, 2]]
    # 5 -> bin0 (room 3); 4 -> bin1 (room 4); 3 -> the first with room: bin0
    assert _lengths(pack_micro_batches([_sample(n, f"r{n}") for n in (5, 4, 3)], seq_len=8)) == [[5, 3], [4]]


def test_sample_longer_than_seq_len_is_an_error():
    with pytest.raises(ValueError, match="rollout long has 11 tokens, more than seq_len=10"):
        pack_micro_batches([_sample(4, "short"), _sample(11, "long")], seq_len=10)


def test_random_packing_loses_and_duplicates_nothing_and_respects_seq_len():
    rng = np.random.default_rng(0)
    samples = [_sample(int(n), f"r{i}") for i, n in enumerate(rng.integers(1, 65, size=300))]
    mbs = pack_micro_batches(samples, seq_len=64)
    assert all(mb.num_tokens <= 64 for mb in mbs)
    assert Counter(s.rollout_id for mb in mbs for s in mb.samples) == Counter(s.rollout_id for s in samples)
    assert sum(mb.num_tokens for mb in mbs) == sum(len(s) for s in samples)
    # FFD stays close to the lower bound ceil(total / seq_len) on random sizes
    assert len(mbs) <= np.ceil(sum(len(s) for s in samples) / 64) * 1.1


def test_pack_for_ranks_balances_within_one_sample():
    rng = np.random.default_rng(1)
    samples = [_sample(int(n), f"r{i}") for i, n in enumerate(rng.integers(1, 200, size=257))]
    ranks = pack_for_ranks(samples, seq_len=256, ranks=4)
    totals = [sum(mb.num_tokens for mb in rank) for rank in ranks]
    assert max(totals) - min(totals) <= max(len(s) for s in samples)
    assert all(mb.num_tokens <= 256 for rank in ranks for mb in rank)
    seen = Counter(s.rollout_id for rank in ranks for mb in rank for s in mb.samples)
    assert seen == Counter(s.rollout_id for s in samples)
    assert pack_for_ranks([_sample(3, "a")], seq_len=8, ranks=2)[1] == []


def _group(size: int, tokens: int) -> list[Rollout]:
    # 1 prompt token + (tokens - 1) completion tokens each
    return [Rollout("g", "echo", i, size, prompt_ids=[1], turns=[Turn([2] * (tokens - 1), [-1.0] * (tokens - 1))])
            for i in range(size)]


def test_batch_cutter_by_rollouts_and_by_tokens():
    by_count = BatchCutter(rollouts_per_step=5)
    assert by_count.cut([_group(3, 4)]) == 0
    assert by_count.cut([_group(3, 4), _group(3, 4), _group(3, 4)]) == 2  # 3 < 5, 6 >= 5
    by_tokens = BatchCutter(token_budget=20)
    assert by_tokens.cut([_group(2, 4), _group(2, 4)]) == 0  # 16 tokens
    assert by_tokens.cut([_group(2, 4), _group(2, 4), _group(1, 4)]) == 3  # 20 tokens
    both = BatchCutter(rollouts_per_step=100, token_budget=8)
    assert both.is_full(num_rollouts=2, num_tokens=8) and not both.is_full(99, 7)
    with pytest.raises(ValueError, match="needs rollouts_per_step or token_budget"):
        BatchCutter()
    with pytest.raises(ValueError, match="rollouts_per_step must be >= 1"):
        BatchCutter(rollouts_per_step=0)
