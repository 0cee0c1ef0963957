"""Rollout filters: flag junk after scoring so it is measured but never trained on.

Each filter runs "off", "monitor" (count only) or "enforce" (count and set `rollout.filtered`).
Flagged rollouts keep their reward in the group baseline, which is why filters run after scoring.
"""

from __future__ import annotations

import abc
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np

from beam_rl.types import Rollout, RolloutRecord

FilterMode = Literal["off", "monitor", "enforce"]
MODES: tuple[str, ...] = ("off", "monitor", "enforce")


@dataclass
class FilterCounts:
    """How many rollouts each filter flagged, by mode."""

    monitored: Counter[str] = field(default_factory=Counter)
    enforced: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.monitored, self.enforced = Counter(self.monitored), Counter(self.enforced)

    def __add__(self, other: FilterCounts) -> FilterCounts:
        return FilterCounts(self.monitored + other.monitored, self.enforced + other.enforced)

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {"monitored": dict(self.monitored), "enforced": dict(self.enforced)}


@dataclass(kw_only=True)
class RolloutFilter(abc.ABC):
    """A named detection rule; `flags` answers for a list of rollouts at once (group rules need that)."""

    name: ClassVar[str]
    mode: FilterMode = "monitor"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"filter {self.name}: mode {self.mode!r} is not one of {MODES}")

    def flags(self, rollouts: Sequence[Rollout | RolloutRecord], step: int | None) -> list[bool]:
        return [self.detect(r) for r in rollouts]

    def detect(self, rollout: Rollout | RolloutRecord) -> bool:
        raise NotImplementedError(f"filter {self.name} decides per group, not per rollout")


@dataclass(kw_only=True)
class ZeroAdvantageFilter(RolloutFilter):
    """A group whose rewards are all equal has no learning signal: flags every rollout of it.

    Groups are formed by `group_id` among the rollouts given, so it works on one group (pre-batch)
    or on a batch cohort.
    """

    name: ClassVar[str] = "zero_advantage"
    # Enforced by default (as in beam_rl.config): such a group only costs trainer time.
    mode: FilterMode = "enforce"

    def flags(self, rollouts: Sequence[Rollout | RolloutRecord], step: int | None) -> list[bool]:
        rewards: dict[str, list[float]] = defaultdict(list)
        for r in rollouts:
            rewards[r.group_id].append(r.reward)
        flat = {gid: min(rs) == max(rs) for gid, rs in rewards.items()}
        return [flat[r.group_id] for r in rollouts]


@dataclass(kw_only=True)
class GibberishFilter(RolloutFilter):
    """Some sampled token has id > token_id_frac * vocab_size and logprob < -log(vocab_size) - logprob_offset.

    arXiv 2510.02387 section 5.2: rare BPE tokens (late merges, high ids) sampled at high entropy.
    `vocab_size` is the model's output dimension (logits width), since -log(V) is the logprob of a
    uniform draw. logprob_offset 2.0 is prime-rl's default. token_id_frac 0.9 (as in beam_rl.config)
    keeps to the top of the vocabulary; prime-rl's absolute threshold 100_000 is 0.66 of Qwen's
    151,936 ids and 0.78 of a 128k vocabulary, so lower the fraction to match it.
    """

    name: ClassVar[str] = "gibberish"
    vocab_size: int
    token_id_frac: float = 0.9
    logprob_offset: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.vocab_size < 2 or not 0.0 < self.token_id_frac < 1.0:
            raise ValueError(
                f"filter gibberish: need vocab_size >= 2 and 0 < token_id_frac < 1, "
                f"got {self.vocab_size}, {self.token_id_frac}"
            )

    def detect(self, rollout: Rollout | RolloutRecord) -> bool:
        ids, logprobs = _completion_arrays(rollout)
        rare = ids > self.token_id_frac * self.vocab_size
        surprising = logprobs < -math.log(self.vocab_size) - self.logprob_offset
        return bool(np.any(rare & surprising))


@dataclass(kw_only=True)
class RepetitionFilter(RolloutFilter):
    """A run of at least `window` consecutive sampled tokens, each with exp(logprob) > prob_threshold.

    arXiv 2506.13585 section 3.2 (MiniMax-M1 truncates at 3000 such tokens; prime-rl's default is
    3000 too). The default window here is 1000, which also catches loops in shorter generation
    budgets. Runs are counted within one turn: environment tokens break a generation streak.
    """

    name: ClassVar[str] = "repetition"
    window: int = 1000
    prob_threshold: float = 0.99

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1 or not 0.0 < self.prob_threshold < 1.0:
            raise ValueError(
                f"filter repetition: need window >= 1 and 0 < prob_threshold < 1, "
                f"got {self.window}, {self.prob_threshold}"
            )

    def detect(self, rollout: Rollout | RolloutRecord) -> bool:
        threshold = math.log(self.prob_threshold)
        for turn in rollout.turns:
            if len(turn.logprobs) < self.window:
                continue
            certain = np.asarray(turn.logprobs, dtype=np.float64) > threshold
            if _longest_run(certain) >= self.window:
                return True
        return False


@dataclass(kw_only=True)
class OverlongFilter(RolloutFilter):
    """The final generation hit max_tokens (finish_reason "length"): the answer was cut off."""

    name: ClassVar[str] = "overlong"

    def detect(self, rollout: Rollout | RolloutRecord) -> bool:
        return rollout.truncated


def oldest_policy_version(rollout: Rollout | RolloutRecord) -> int:
    """The policy version of a rollout's oldest token: the lowest one known, or, when some token's version
    is unknown (or none was generated), the version its request was sent under, which no token is older than.
    A rollout whose request waited through an update, or that continued under new weights, is younger than
    its start."""
    if isinstance(rollout, RolloutRecord):
        tokens = rollout.tokens
        if tokens is None or tokens.policy_versions is None:
            return rollout.policy_version_start
        lowest = tokens.completion_version_min()
        return rollout.policy_version_start if lowest is None else lowest
    if any(len(t.policy_versions) != len(t.completion_ids) for t in rollout.turns):
        return rollout.policy_version_start
    versions = np.fromiter((v for t in rollout.turns for v in t.policy_versions), dtype=np.int64)
    if versions.size == 0 or (versions < 0).any():
        return rollout.policy_version_start
    return int(versions.min())


@dataclass(kw_only=True)
class StaleFilter(RolloutFilter):
    """Older than the off-policy bound for the step it would train: always enforced.

    A batch for step s trains policy s-1 into s, so a rollout's staleness is (s - 1) - the version of its
    oldest token (`oldest_policy_version`); it is stale when that exceeds `max_off_policy_steps`.
    """

    name: ClassVar[str] = "stale"
    max_off_policy_steps: int
    mode: FilterMode = field(default="enforce", init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_off_policy_steps < 0:
            raise ValueError(f"filter stale: max_off_policy_steps must be >= 0, got {self.max_off_policy_steps}")

    def flags(self, rollouts: Sequence[Rollout | RolloutRecord], step: int | None) -> list[bool]:
        if step is None:
            raise ValueError("filter stale needs the step the batch trains: pass apply_filters(..., step=s)")
        oldest_allowed = step - 1 - self.max_off_policy_steps
        return [oldest_policy_version(r) < oldest_allowed for r in rollouts]


FILTERS: dict[str, type[RolloutFilter]] = {
    cls.name: cls for cls in (ZeroAdvantageFilter, GibberishFilter, RepetitionFilter, OverlongFilter, StaleFilter)
}


def make_filter(name: str, **params: Any) -> RolloutFilter:
    """Build a filter from its name and parameters (as a config names them)."""
    if name not in FILTERS:
        raise ValueError(f"unknown filter {name!r}; known: {sorted(FILTERS)}")
    try:
        return FILTERS[name](**params)
    except TypeError as exc:
        raise ValueError(f"filter {name}: {exc}") from exc


def apply_filters(
    filters: Sequence[RolloutFilter], rollouts: Sequence[Rollout | RolloutRecord], *, step: int | None = None
) -> FilterCounts:
    """Run every filter that is not off over the ok rollouts; count detections, enforce where asked.

    Every filter sees every ok rollout, so counts are per rule and a rollout flagged by two rules
    counts for both; `rollout.filtered` keeps the first enforced reason. Errored and cancelled
    rollouts are never trained on and are not inspected.
    """
    counts = FilterCounts()
    ok = [r for r in rollouts if r.ok]
    for f in filters:
        if f.mode == "off" or not ok:
            continue
        for rollout, flagged in zip(ok, f.flags(ok, step)):
            if not flagged:
                continue
            if f.mode == "monitor":
                counts.monitored[f.name] += 1
            else:
                counts.enforced[f.name] += 1
                if rollout.filtered is None:
                    rollout.filtered = f.name
    return counts


def _completion_arrays(rollout: Rollout | RolloutRecord) -> tuple[np.ndarray, np.ndarray]:
    ids = [t.completion_ids for t in rollout.turns]
    logprobs = [t.logprobs for t in rollout.turns]
    if not ids:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    for i, (turn_ids, turn_logprobs) in enumerate(zip(ids, logprobs)):
        if len(turn_ids) != len(turn_logprobs):
            raise ValueError(
                f"rollout {rollout.rollout_id} turn {i}: {len(turn_logprobs)} logprobs for {len(turn_ids)} completion ids"
            )
    return (
        np.concatenate([np.asarray(x, dtype=np.int64) for x in ids]),
        np.concatenate([np.asarray(x, dtype=np.float64) for x in logprobs]),
    )


def _longest_run(mask: np.ndarray) -> int:
    """Length of the longest stretch of True values."""
    if not mask.any():
        return 0
    edges = np.diff(np.concatenate(([0], mask.astype(np.int8), [0])))
    return int((np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)).max())
