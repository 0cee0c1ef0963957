"""Scoring a complete group, synchronous and Beam-free: the article's process_group.

`score_group` drops the errored, computes advantages, stamps the temperature, applies the pre-batch
filters and turns the clean rollouts into samples; the packing stage (beam_rl/packing/batches.py) cuts
the `ScoredGroup`s it returns into train batches.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from beam_rl.scoring.advantages import AdvantageAlgorithm
from beam_rl.scoring.filters import FilterCounts, RolloutFilter, apply_filters
from beam_rl.scoring.samples import (
    samples_from_columns,
    samples_to_columns,
    share_sample_tokens,
    trace_to_samples,
    without_token_arrays,
)
from beam_rl.types import Rollout, RolloutRecord, Sample

# The flag of a group left with fewer scored rollouts than its env's reward.min_scored (one has no baseline).
TOO_FEW_SCORED = "too_few_scored"


@dataclass
class ScoredGroup:
    """One complete group after scoring: every rollout (to measure), the clean ones and their samples
    (to train). Rollouts are records from here on: their tokens as numpy arrays, those of a clean
    rollout shared with its sample, so a scored group is cheap to send between stages and to keep in
    the packer's state."""

    group_id: str
    algorithm: AdvantageAlgorithm
    rollouts: list[RolloutRecord]  # all of the group, errored, cancelled and filtered included
    clean: list[RolloutRecord]  # ok and not filtered, in arrival order
    samples: list[Sample]  # trace_to_samples of the clean rollouts
    counts: FilterCounts = field(default_factory=FilterCounts)

    def __post_init__(self) -> None:
        share_sample_tokens([*self.rollouts, *self.clean], self.samples)

    # Pickled between pipeline stages and into the packer's state: the samples go as columns, and the
    # records without the token arrays their samples hold.
    def __getstate__(self) -> dict[str, Any]:
        stripped = without_token_arrays([*self.rollouts, *self.clean], {s.rollout_id for s in self.samples})
        return {
            **self.__dict__,
            "samples": samples_to_columns(self.samples),
            "rollouts": [stripped.get(id(r), r) for r in self.rollouts],
            "clean": [stripped.get(id(r), r) for r in self.clean],
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, samples=samples_from_columns(state["samples"]))
        share_sample_tokens([*self.rollouts, *self.clean], self.samples)


def score_group(
    rollouts: Sequence[Rollout],
    algorithm: AdvantageAlgorithm,
    pre_filters: Sequence[RolloutFilter],
    temperature: float,
    min_scored: int = 1,
) -> ScoredGroup:
    """Drop errored, cancelled and reward_error rollouts, score the survivors, stamp the temperature,
    filter, tokenize the clean. With fewer than `min_scored` survivors the group is not trained: they are
    flagged TOO_FEW_SCORED (an enforced count) and get no advantage."""
    if not rollouts:
        raise ValueError("score_group needs at least one rollout")
    group_ids = {r.group_id for r in rollouts}
    if len(group_ids) != 1:
        raise ValueError(f"score_group got rollouts of several groups: {sorted(group_ids)}")
    # A reward_error is not ok: the baseline is taken over the rollouts whose rewards are known.
    survivors = [r for r in rollouts if r.ok]
    for r in survivors:
        r.temperature = temperature
    if len(survivors) < min_scored:
        for r in survivors:
            r.filtered = TOO_FEW_SCORED
        counts = FilterCounts(enforced=Counter({TOO_FEW_SCORED: len(survivors)} if survivors else {}))
    else:
        # Advantages use every survivor's reward, including those a filter is about to flag.
        algorithm.finalize_group(survivors)
        counts = apply_filters(pre_filters, survivors)
    clean = [r for r in survivors if r.filtered is None]
    samples = [s for r in clean for s in trace_to_samples(r)]
    records = {id(r): r.record() for r in rollouts}
    return ScoredGroup(
        group_ids.pop(), algorithm, [records[id(r)] for r in rollouts], [records[id(r)] for r in clean], samples, counts
    )


@dataclass(frozen=True)
class GroupScoring:
    """How a run scores each group (built from its config by the wiring): per environment its advantage
    algorithm and the fewest scored rollouts that train, the pre-batch filters and the sampling temperature.
    The Score step and replay hold one each."""

    algorithms: Mapping[str, AdvantageAlgorithm]
    pre_filters: Sequence[RolloutFilter]
    temperature: float
    min_scored: Mapping[str, int]

    def score(self, rollouts: Sequence[Rollout]) -> ScoredGroup:
        """`score_group` with the group's environment's rules (all of a group's rollouts share one)."""
        env = rollouts[0].env_name
        return score_group(
            rollouts, self.algorithms[env], self.pre_filters, self.temperature, min_scored=self.min_scored[env]
        )
