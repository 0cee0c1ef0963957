"""Cutting scored groups into train batches, synchronous and Beam-free: the article's process_batch
plus packing. The packer's state (beam_rl/packing/state.py) keeps a `BatchBuilder` between elements.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from beam_rl.packing import goodput
from beam_rl.packing.packer import BatchCutter, pack_for_ranks
from beam_rl.scoring.advantages import AdvantageAlgorithm
from beam_rl.scoring.filters import FilterCounts, RolloutFilter, apply_filters, oldest_policy_version
from beam_rl.scoring.group import ScoredGroup
from beam_rl.scoring.samples import without_token_arrays
from beam_rl.types import MicroBatch, RolloutRecord, RolloutStatus, Sample, TrainBatch


@dataclass(frozen=True)
class InputExhausted:
    """The packer cut its last batch: every group of the run's input is in a committed step up to
    `last_step` (the writer records the end of the run)."""

    last_step: int


def _oldest_version(group: ScoredGroup) -> float:
    """The policy version of the oldest token a group would train (its deadline: the stale filter judges
    each rollout by it); a group with nothing to train has none."""
    return min((oldest_policy_version(r) for r in group.clean), default=float("inf"))


_ERRORED = (RolloutStatus.ERROR, RolloutStatus.REWARD_ERROR)


class BatchBuilder:
    """Collects scored groups and cuts them, whole, into numbered train batches.

    Every rollout seen since the last batch (errored and filtered too) forms the next batch's
    observation window. A batch whose rollouts the post-batch filters all reject is not emitted
    and does not take a step number; its rollouts stay in the window of the next batch.
    """

    def __init__(
        self,
        cutter: BatchCutter,
        seq_len: int,
        ranks: int,
        post_filters: Sequence[RolloutFilter] = (),
        next_step: int = 1,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if seq_len < 1 or ranks < 1:
            raise ValueError(f"BatchBuilder needs seq_len >= 1 and ranks >= 1, got {seq_len}, {ranks}")
        self.cutter = cutter
        self.seq_len = seq_len
        self.ranks = ranks
        self.post_filters = list(post_filters)
        self.next_step = next_step
        self._clock = clock
        self._pending: list[ScoredGroup] = []  # groups with clean rollouts, waiting for a batch
        self._window: list[RolloutRecord] = []
        self._window_groups: list[str] = []
        self._window_counts = FilterCounts()
        self._cut_fates: Counter[str] = Counter()  # tokens of rollouts cut into a batch not emitted (all flagged)

    @property
    def pending_rollouts(self) -> int:
        return sum(len(g.clean) for g in self._pending)

    @property
    def pending(self) -> list[ScoredGroup]:
        """Groups held until the next batch is cut, in the order they will be cut: those with clean
        rollouts wait to be trained, the others for their records to leave with the window."""
        return list(self._pending)

    def split_pending(self) -> tuple[BatchBuilder, list[ScoredGroup]]:
        """This builder without its pending groups, and those groups, to be stored apart
        (`beam_rl.packing.state.Packer.save`) so that each group is stored once, not rewritten with
        every element; the window keeps the records of pending groups without their token arrays, so
        each token is stored once, with its group."""
        rest = BatchBuilder.__new__(BatchBuilder)
        rest.__dict__.update(self.__dict__, _pending=[], _window=self._window_without_pending_tokens())
        return rest, list(self._pending)

    def restore_pending(self, groups: Sequence[ScoredGroup]) -> None:
        """Undo `split_pending` after both halves were stored separately: the pending groups' records
        are the window's own objects again (so a post-batch filter flag shows in the window), holding
        the token arrays their groups kept."""
        window = {r.rollout_id: r for r in self._window}
        for group in groups:
            for held in group.rollouts:
                record = window.get(held.rollout_id)
                if record is not None and record.tokens is not None and record.tokens.input_ids is None:
                    record.tokens = held.tokens
        self._pending = [
            dataclasses.replace(
                g,
                rollouts=[window.get(r.rollout_id, r) for r in g.rollouts],
                clean=[window.get(r.rollout_id, r) for r in g.clean],
            )
            for g in groups
        ]

    # Pickled whole, it is stored as split_pending's two halves are, and restored the same way.
    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_window": self._window_without_pending_tokens()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({"_cut_fates": Counter(), **state})  # a packer state saved before goodput counts
        self.restore_pending(self._pending)

    def _window_without_pending_tokens(self) -> list[RolloutRecord]:
        stripped = without_token_arrays(self._window, {r.rollout_id for g in self._pending for r in g.rollouts})
        return [stripped.get(id(r), r) for r in self._window]

    def drop_committed(self, consumed: set[tuple[str, int, int]], next_step: int) -> int:
        """Forget the groups a committed step already holds (their prompt offsets are `consumed`)
        and never give out a committed step number again (`next_step`: the run directory's next);
        returns how many groups were dropped. For a packer restored from a checkpoint older than the
        run directory, which is never rolled back."""
        dropped = {r.group_id for r in self._window if r.prompt_offset in consumed}
        dropped |= {g.group_id for g in self._pending if any(r.prompt_offset in consumed for r in g.rollouts)}
        self._pending = [g for g in self._pending if g.group_id not in dropped]
        self._window = [r for r in self._window if r.group_id not in dropped]
        self._window_groups = [g for g in self._window_groups if g not in dropped]
        self.next_step = max(self.next_step, next_step)
        return len(dropped)

    def add(self, group: ScoredGroup) -> list[TrainBatch]:
        """Take one scored group; return the batches it completed (usually none or one)."""
        # The records are shared with the pending group: a post-batch filter flag set on one shows in
        # the window. A group with nothing to train waits too, so that a packer keeps its records'
        # tokens where it keeps every group's (split_pending), until the batch its window leaves with.
        self._window.extend(group.rollouts)
        self._window_groups.append(group.group_id)
        self._window_counts = self._window_counts + group.counts
        self._pending.append(group)
        batches = []
        while taken := self.cutter.cut([g.clean for g in self._pending]):
            cohort, self._pending = self._pending[:taken], self._pending[taken:]
            batch = self._build(cohort)
            if batch is not None:
                batches.append(batch)
                self._pending = [g for g in self._pending if g.clean]  # the others' records left with it
        return batches

    def add_all(self, groups: Sequence[ScoredGroup]) -> list[TrainBatch]:
        """Take groups that arrived together, the one whose oldest token is oldest first: when they
        overfill a batch, those that would go stale waiting for the next one train in this one."""
        batches = []
        for group in sorted(groups, key=_oldest_version):
            batches += self.add(group)
        return batches

    def flush(self) -> TrainBatch | None:
        """A final, partial batch of whatever is pending (end of run). When nothing is trainable but
        rollouts were seen since the last batch, the step still comes, with no samples: its window is
        what commits those groups (and their prompt offsets), so they are neither lost nor redone."""
        cohort, self._pending = self._pending, []
        if not cohort and not self._window:
            return None
        return self._build(cohort, observe_only_ok=True)

    def _build(self, cohort: list[ScoredGroup], observe_only_ok: bool = False) -> TrainBatch | None:
        step = self.next_step
        rollouts = [r for g in cohort for r in g.clean]
        # Goodput: the window's rollouts that can no longer train are counted now, before the post-batch
        # filters flag some of the cohort's (counted with the cohort).
        window_fates = goodput.discarded_fates(self._window) + goodput.unclean_fates(
            self._window, frozenset(f.name for f in self.post_filters)
        )
        self._window_counts = self._window_counts + apply_filters(self.post_filters, rollouts, step=step)
        self._cut_fates += goodput.cut_fates(rollouts)
        kept = {r.rollout_id for r in rollouts if r.filtered is None}
        by_algorithm: dict[Any, tuple[AdvantageAlgorithm, list[Sample]]] = {}
        group_ids = []
        for g in cohort:
            samples = [s for s in g.samples if s.rollout_id in kept]
            if samples:
                group_ids.append(g.group_id)
                by_algorithm.setdefault(g.algorithm.key, (g.algorithm, []))[1].extend(samples)
        if not group_ids and not observe_only_ok:
            return None
        # Batch-level normalisation (REINFORCE++ whitening) is per algorithm: envs may mix them.
        for algorithm, algorithm_samples in by_algorithm.values():
            algorithm.batch_normalize(algorithm_samples)
        samples = [s for _, algorithm_samples in by_algorithm.values() for s in algorithm_samples]
        micro_batches = pack_for_ranks(samples, self.seq_len, self.ranks)
        window = self._window_stats(step, kept, samples, micro_batches)
        window["tokens_by_fate"] = dict(sorted((window_fates + self._cut_fates).items()))
        self.next_step += 1
        observed, packed_at = self._window, self._clock()
        for r in observed:
            r.t_packed = packed_at
        self._window, self._window_groups, self._window_counts = [], [], FilterCounts()
        self._cut_fates = Counter()
        return TrainBatch(step=step, micro_batches=micro_batches, group_ids=group_ids, window=window, rollouts=observed)

    def _window_stats(
        self, step: int, kept: set[str], samples: list[Sample], micro_batches: list[list[MicroBatch]]
    ) -> dict[str, Any]:
        window = self._window
        ok = [r for r in window if r.ok]
        versions = np.array([r.policy_version_start for r in window], dtype=np.int64)
        oldest = np.array([oldest_policy_version(r) for r in window], dtype=np.int64)
        return {
            "step": step,
            "rollouts": len(window),
            "status": {s.value: sum(r.status is s for r in window) for s in RolloutStatus},
            "errored": sum(r.status in _ERRORED for r in window),  # status tells generation from reward errors
            "filtered": dict(Counter(r.filtered for r in window if r.filtered is not None)),
            "flagged": self._window_counts.as_dict(),
            "trained_rollouts": len(kept),
            "reward_mean": float(np.mean([r.reward for r in ok])) if ok else None,
            "completion_tokens_mean": float(np.mean([r.completion_tokens for r in ok])) if ok else None,
            "policy_version_min": int(versions.min()) if versions.size else None,
            "policy_version_max": int(versions.max()) if versions.size else None,
            "staleness_max": int((step - 1) - oldest.min()) if oldest.size else None,  # by the oldest token
            "samples": len(samples),
            "tokens": int(sum(len(s) for s in samples)),
            "micro_batches": [len(rank) for rank in micro_batches],
            "group_ids": list(self._window_groups),
        }
