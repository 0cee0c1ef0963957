"""Environments mixed by target share (`envs[].ratio`): which environment's stream a shard draws from next.

The target is a share of what trains: samples in the rank files, or their generated tokens
(`dispatch.mix_by`). Groups that are filtered, stale or too few scored train nothing, so an environment
is admitted in proportion to its target over its acceptance: what a group of it admitted lately put in the
rank files (trained units per consumed group, over the last `recent_steps` committed steps). The next
group goes to the environment that is furthest behind its target, counting what committed steps trained
and what its groups still on their way will likely train. That corrects itself: an environment that fell
behind is drawn until it is not.

Per-environment in-flight caps follow from Little's law: to train its share, an environment needs in
flight its admission rate times how long its rollouts take, so each environment's cap is that share of
the permits (with headroom), and a slow environment cannot take every permit while a fast one waits.

Everything it knows is read from committed steps (commit records, rank files, windows), in step order, so
a resumed run rebuilds the same estimates from its committed steps: nothing lives only in a worker.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from beam_rl.rundir.steps import open_arrow_file
from schemas.commit_record import CommitRecord, rank_file_name

if TYPE_CHECKING:
    from beam_rl.config import RunConfig
    from beam_rl.rundir import RunDir

MixBy = Literal["samples", "tokens"]
# An environment's acceptance is never taken below this share of its prior: one whose groups all fail is
# admitted at most ten times as often as its target alone says, not to the exclusion of every other.
MIN_ACCEPTANCE_SHARE = 0.1
CAP_HEADROOM = 1.5  # Little's law gives the mean; rollouts come in groups and latencies vary


@dataclass(frozen=True)
class EnvTarget:
    name: str
    share: float  # of what trains, the ratios normalized to sum to 1
    group_size: int


@dataclass
class _StepFigures:
    """What one committed step says of each environment."""

    consumed: Mapping[str, int]  # groups whose prompts it consumed
    trained: Mapping[str, int]  # units in its rank files
    rollouts: Mapping[str, int]  # its window's finished rollouts
    rollout_s: Mapping[str, float]  # and their time from sent to finished, summed


class EnvMix:
    """Per environment: its target share, what committed steps trained of it, and its recent acceptance
    and rollout latency; and from them, which environment a shard draws next and each one's in-flight cap."""

    recent_steps = 8

    def __init__(self, targets: Sequence[EnvTarget], by: MixBy = "samples", shards: int = 1) -> None:
        if not targets:
            raise ValueError("a mix needs at least one environment")
        self.targets = {t.name: t for t in targets}
        self.by = by
        self.shards = shards
        self.trained: dict[str, int] = dict.fromkeys(self.targets, 0)  # the whole run's committed steps
        self._recent: collections.deque[_StepFigures] = collections.deque(maxlen=self.recent_steps)
        self.last_step = 0

    @classmethod
    def for_run(cls, config: RunConfig, shards: int) -> EnvMix | None:
        """The run's mix, or None when its environments set no ratio (they take turns)."""
        if not any(e.ratio is not None for e in config.envs):
            return None
        ratios = [e.ratio or 0.0 for e in config.envs]  # set on every environment (RunConfig checks)
        total = sum(ratios)
        return cls(
            [EnvTarget(e.name, ratio / total, e.group_size) for e, ratio in zip(config.envs, ratios)],
            config.dispatch.mix_by,
            shards,
        )

    # -- what committed steps say --------------------------------------------------------------

    def follow(self, run_dir: RunDir, last_step: int) -> None:
        """Read the steps committed since the last call, up to `last_step`."""
        for step in range(self.last_step + 1, last_step + 1):
            self.observe_step(run_dir, step)
            self.last_step = step

    def observe_step(self, run_dir: RunDir, step: int) -> None:
        """A committed step, from its commit record, rank files and window."""
        record = run_dir.read_commit(step)
        self.observe(record, trained_by_env(run_dir, record, self.by), run_dir.read_window(step))

    def observe(self, record: CommitRecord, trained: Mapping[str, int], window: pa.Table) -> None:
        consumed = collections.Counter(env for env, _, _ in record.offsets)
        rollouts: collections.Counter[str] = collections.Counter()
        rollout_s: collections.Counter[str] = collections.Counter()
        for r in window.select(["env", "is_eval", "t_sent", "t_finished"]).to_pylist():
            if not r["is_eval"] and r["t_sent"] is not None and r["t_finished"] is not None:
                rollouts[r["env"]] += 1
                rollout_s[r["env"]] += max(0.0, r["t_finished"] - r["t_sent"])
        for env, units in trained.items():
            if env in self.trained:
                self.trained[env] += units
        self._recent.append(_StepFigures(consumed, trained, rollouts, rollout_s))

    def acceptance(self, env: str) -> float:
        """Units a group of `env` admitted lately put in the rank files (before any: its prior)."""
        prior = self._prior(env)
        groups = sum(f.consumed.get(env, 0) for f in self._recent)
        units = sum(f.trained.get(env, 0) for f in self._recent)
        return max(units / groups if groups else prior, MIN_ACCEPTANCE_SHARE * prior)

    def _prior(self, env: str) -> float:
        """What a group would train if nothing were filtered: its attempts, or their tokens at the mean
        length the run has trained so far."""
        size = self.targets[env].group_size
        if self.by == "samples":
            return float(size)
        units = sum(sum(f.trained.values()) for f in self._recent)
        rollouts = sum(
            self.targets[e].group_size * n for f in self._recent for e, n in f.consumed.items() if e in self.targets
        )
        return size * units / rollouts if units and rollouts else float(size)

    def shares(self) -> dict[str, float | None]:
        """Of what committed steps trained, each environment's share (None before anything trained)."""
        total = sum(self.trained.values())
        return {env: (n / total if total else None) for env, n in self.trained.items()}

    # -- decisions -----------------------------------------------------------------------------

    def choose(self, candidates: Sequence[str], pending_groups: Mapping[str, int]) -> str | None:
        """Of `candidates` (environments with prompts left and room under their cap), the one furthest
        behind its target: committed units plus what the shards' pending groups (admitted, not in a
        committed step; this shard's times the shard count) will likely train, over its share."""

        def standing(env: str) -> tuple[float, int]:
            projected = self.trained[env] + self.shards * pending_groups.get(env, 0) * self.acceptance(env)
            return projected / self.targets[env].share, list(self.targets).index(env)

        return min(candidates, key=standing, default=None)

    def caps(self, permits: int) -> dict[str, int] | None:
        """Each environment's in-flight cap in rollouts, from Little's law: its share of admitted rollouts
        times its mean rollout time, of the permits, with headroom; at least a group. None until every
        environment has a measured rollout time."""
        latency = {}
        for env in self.targets:
            n = sum(f.rollouts.get(env, 0) for f in self._recent)
            if not n:
                return None
            latency[env] = sum(f.rollout_s.get(env, 0.0) for f in self._recent) / n
        # Rollouts admitted per unit trained, by environment: target / acceptance groups of group_size each.
        load = {env: t.share / self.acceptance(env) * t.group_size * latency[env] for env, t in self.targets.items()}
        total = sum(load.values())
        if total <= 0:
            return None
        return {
            env: max(self.targets[env].group_size, math.ceil(CAP_HEADROOM * permits * w / total))
            for env, w in load.items()
        }

    def summary(self, permits: int) -> dict[str, dict[str, float | int | None]]:
        """For status and `beam-rl inspect`: per environment its target, trained share, acceptance, cap."""
        shares, caps = self.shares(), self.caps(permits) or {}
        return {
            env: {
                "target": round(t.share, 4),
                "trained": self.trained[env],
                "trained_share": None if (share := shares[env]) is None else round(share, 4),
                "acceptance": round(self.acceptance(env), 3),
                "cap": caps.get(env),
            }
            for env, t in self.targets.items()
        }


def trained_by_env(run_dir: RunDir, record: CommitRecord, by: MixBy) -> dict[str, int]:
    """A committed step's rank files, per environment: their samples, or the generated tokens in them."""
    totals: collections.Counter[str] = collections.Counter()
    for rank in range(record.counts.ranks):
        name = rank_file_name(rank)
        data = run_dir.map_committed_file(record, name, verify=False)
        table = open_arrow_file(record.step, run_dir.step_dir(record.step) / name, data).read_all()
        if not table.num_rows:
            continue
        envs = [group_id.rpartition("/")[0] for group_id in table.column("group_id").to_pylist()]
        if by == "samples":
            totals.update(envs)
            continue
        masks = table.column("loss_mask").combine_chunks()
        rows = pc.list_parent_indices(masks).to_numpy()
        generated = np.bincount(
            rows, weights=pc.list_flatten(masks).to_numpy(zero_copy_only=False), minlength=table.num_rows
        )
        for env, n in zip(envs, generated, strict=True):
            totals[env] += int(n)
    return dict(totals)


def describe(run_dir: RunDir, config: RunConfig, steps: list[int]) -> list[str]:
    """For `beam-rl inspect`: a line per environment of a mixed run, its target and trained share."""
    mix = EnvMix.for_run(config, config.dispatch.shards)
    if mix is None:
        return []
    for step in steps:
        mix.observe_step(run_dir, step)
    lines = []
    for env, figures in mix.summary(config.inference.max_inflight).items():
        share = "-" if figures["trained_share"] is None else f"{figures['trained_share']:.3f}"
        lines.append(
            f"mix of {env}: target {figures['target']:.3f} of trained {mix.by}, trained {share} "
            f"({figures['trained']} {mix.by}), acceptance {figures['acceptance']} per group"
        )
    return lines
