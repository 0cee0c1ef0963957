"""Batch packing: when a batch is full, and how its samples become micro-batches per trainer rank.

Samples are never split and never padded: a micro-batch is samples laid end to end (the Arrow writer,
beam_rl/rundir/arrow.py, restarts position ids at 0 for each, so attention stays within a sample).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from beam_rl.types import MicroBatch, Rollout, RolloutRecord, Sample


def pack_micro_batches(samples: Sequence[Sample], seq_len: int) -> list[MicroBatch]:
    """First-fit-decreasing: longest sample first, into the first micro-batch with room for it."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    sizes = [len(s) for s in samples]
    for s, size in zip(samples, sizes):
        if size == 0:
            raise ValueError(f"sample of rollout {s.rollout_id} has no tokens")
        if size > seq_len:
            raise ValueError(
                f"sample of rollout {s.rollout_id} has {size} tokens, more than seq_len={seq_len}: "
                f"raise seq_len or lower the prompt/completion token limits"
            )
    order = sorted(range(len(samples)), key=lambda i: -sizes[i])
    room: list[int] = []  # free tokens per open micro-batch (a list: numpy's per-call cost is most of a scan)
    bins: list[list[Sample]] = []
    for i in order:
        need = sizes[i]
        b = next((b for b, free in enumerate(room) if free >= need), len(bins))
        if b == len(bins):
            bins.append([])
            room.append(seq_len)
        bins[b].append(samples[i])
        room[b] -= need
    return [MicroBatch(b) for b in bins]


def pack_for_ranks(samples: Sequence[Sample], seq_len: int, ranks: int) -> list[list[MicroBatch]]:
    """Balance samples across ranks greedily by tokens, then pack each rank's samples with FFD.

    Balancing whole samples (not micro-batches) keeps rank totals within one sample's tokens of
    each other; ranks may end up with different numbers of micro-batches.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    return [pack_micro_batches(rank_samples, seq_len) for rank_samples in _lpt(samples, ranks)]


@dataclass(frozen=True)
class BatchCutter:
    """When a batch is full: at `rollouts_per_step` clean rollouts or `token_budget` tokens, whichever first.

    Batches are cut on whole groups, so a batch holds at least the target and overshoots it by
    less than one group.
    """

    rollouts_per_step: int | None = None
    token_budget: int | None = None

    def __post_init__(self) -> None:
        if self.rollouts_per_step is None and self.token_budget is None:
            raise ValueError("BatchCutter needs rollouts_per_step or token_budget")
        for name in ("rollouts_per_step", "token_budget"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"BatchCutter: {name} must be >= 1, got {value}")

    def is_full(self, num_rollouts: int, num_tokens: int) -> bool:
        return (self.rollouts_per_step is not None and num_rollouts >= self.rollouts_per_step) or (
            self.token_budget is not None and num_tokens >= self.token_budget
        )

    def cut(self, groups: Sequence[Sequence[Rollout | RolloutRecord]]) -> int:
        """How many leading groups of clean rollouts make a full batch; 0 while not full."""
        num_rollouts = num_tokens = 0
        for taken, group in enumerate(groups, start=1):
            num_rollouts += len(group)
            if self.token_budget is not None:  # counting tokens is most of a cut's cost: only when they decide
                num_tokens += sum(r.num_tokens for r in group)
            if self.is_full(num_rollouts, num_tokens):
                return taken
        return 0


def _lpt(samples: Sequence[Sample], bins: int) -> list[list[Sample]]:
    """Longest-processing-time split of samples into `bins` lists with near-equal token totals."""
    return [[samples[i] for i in b] for b in _lpt_indices([len(s) for s in samples], bins)]


def _lpt_indices(sizes: Sequence[int], bins: int) -> list[list[int]]:
    # Each item goes to the lightest bin; ties go to the bin with fewer items, then the lower index,
    # so empty bins fill first and the result is deterministic.
    heap = [(0, 0, b) for b in range(bins)]
    out: list[list[int]] = [[] for _ in range(bins)]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        load, count, b = heapq.heappop(heap)
        out[b].append(i)
        heapq.heappush(heap, (load + sizes[i], count + 1, b))
    return out
