"""Backpressure: whether a shard of the source may admit another group now. A pure rule over a snapshot.

Every figure it reads is one every worker can see: the shard's own dispatcher and the run directory's
committed steps. Nothing comes from another stage's process memory.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# In transit = left the source whole, not yet in a committed step (runner queues, scoring, the packer's
# pending groups). Enough to cover a step's worth plus the pipeline's round trip at full speed.
MIN_GROUPS_IN_TRANSIT = 64
# Of a step, for groups packed after some admitted after them (staleness_at_training): half the bound, at
# most one step. More at a bound of 1 would hold admission whenever the trainer has a step to train.
MAX_ADMISSION_MARGIN = 1.0


class Hold(str, enum.Enum):
    """Why admission is held back (None: it is not)."""

    STOPPING = "stopping"  # the run's last step is committed
    TRAINER = "trainer"  # the pipeline is max_async_level steps ahead of the trainer's policy
    GROUPS_OUT = "groups_out"  # (max_async_level + 1) steps' worth of groups are out already
    OFF_POLICY = "off_policy"  # a group admitted now would queue behind enough work to train past the bound
    SINK = "sink"  # too many groups in transit: scoring, packing or committing is behind
    BACKLOG = "backlog"  # the dispatcher already has enough groups waiting for permits
    ENV_CAPS = "env_caps"  # mixing: every environment with prompts left is at its in-flight cap


@dataclass(frozen=True)
class AdmissionLimits:
    max_async_level: int
    max_off_policy_steps: int
    rollouts_per_step: int  # this shard's share of a step
    margin_rollouts: int  # kept free for a group that slips behind later ones (staleness_at_training)
    max_groups_out: int  # groups admitted and not yet returned, with a trainer
    max_groups_in_transit: int
    backlog_groups: int  # groups waiting for permits, enough that a freed permit always finds work
    with_trainer: bool  # False: nobody publishes weights, so the policy never moves


@dataclass(frozen=True)
class AdmissionState:
    stopping: bool
    last_committed: int  # the newest committed step (0: none)
    policy_version: int  # the newest weights the servers hold
    groups_out: int  # admitted, not all of their rollouts returned yet
    groups_in_transit: int  # returned whole, not yet in a committed step
    groups_waiting: int  # in the dispatcher, waiting for permits
    rollouts_ahead: int = 0  # in the groups out and in transit
    room_share: float = 1.0  # of the rollouts in recent steps' windows, those that took room (CommittedSteps)
    stalled: bool = False  # StallWatch: what is in transit cannot fill a step


def hold_reason(state: AdmissionState, limits: AdmissionLimits) -> Hold | None:
    """The first reason to hold admission back, or None to admit another group."""
    if state.stopping:
        return Hold.STOPPING
    if limits.with_trainer:
        producing = state.last_committed + 1  # the step groups admitted now will likely train
        if producing - 1 - state.policy_version > limits.max_async_level:
            return Hold.TRAINER
        if state.groups_out >= limits.max_groups_out:
            return Hold.GROUPS_OUT
        if not state.stalled and staleness_at_training(state, limits) > limits.max_off_policy_steps:
            return Hold.OFF_POLICY
    # Filtered groups wait in transit for the next step too, but take no room in it.
    if not state.stalled and state.groups_in_transit * state.room_share >= limits.max_groups_in_transit:
        return Hold.SINK
    if state.groups_waiting >= limits.backlog_groups:
        return Hold.BACKLOG
    return None


def staleness_at_training(state: AdmissionState, limits: AdmissionLimits) -> int:
    """The off-policy steps of a group admitted now if it trains in its turn, plus a margin.

    Groups train about in the order they were admitted, so it lands in step last_committed + 1 +
    (rollouts ahead of it that will train) // rollouts_per_step, which trains that step's previous policy;
    its oldest token is at best today's policy. Filtered rollouts take no room in a step: of those ahead,
    `room_share` are counted. Groups that finish together reach the packer in any order, so a group may slip
    behind some admitted after it (a group is as slow as its slowest rollout): `margin_rollouts` are kept for
    that, but for the step being filled while the trainer has nothing else to train.

    Admitting past the bound only buys work the stale filter will throw away (bench/recovery/goodput.py measured
    a quarter of all tokens lost that way when the pipeline, not the engines, set the pace)."""
    ahead = int(state.rollouts_ahead * state.room_share)
    # Not for the step being filled while the trainer waits for it: nothing else would bring that step.
    if ahead >= limits.rollouts_per_step or state.last_committed > state.policy_version:
        ahead += limits.margin_rollouts
    return state.last_committed + ahead // limits.rollouts_per_step - state.policy_version


def limits_for(
    rollouts_per_step: int,
    group_size: int,
    permits: int,
    max_async_level: int,
    with_trainer: bool,
    shards: int = 1,
    *,
    max_off_policy_steps: int,
) -> AdmissionLimits:
    """The limits of one of `shards` shards holding `permits` permits, for groups of (at least)
    `group_size`. Run-wide bounds are split evenly, rounded up, so together the shards still reach them."""
    groups_per_step = -(-rollouts_per_step // group_size)

    def share(total: int) -> int:
        return -(-total // shards)

    margin_steps = min(MAX_ADMISSION_MARGIN, max_off_policy_steps / 2)
    return AdmissionLimits(
        max_async_level=max_async_level,
        max_off_policy_steps=max_off_policy_steps,
        rollouts_per_step=share(rollouts_per_step),
        margin_rollouts=int(margin_steps * share(rollouts_per_step)),
        # More would be generated by a policy that is stale before its step comes.
        max_groups_out=share(groups_per_step * (max_async_level + 1)),
        # A step's worth must fit (the packer holds groups until a batch is full), plus the round trip.
        max_groups_in_transit=share(groups_per_step + max(MIN_GROUPS_IN_TRANSIT, 2 * groups_per_step)),
        backlog_groups=max(2, permits // group_size),
        with_trainer=with_trainer,
    )


def input_finished(all_claimed: bool, stopping: bool, groups_out: int) -> bool:
    """A shard's input is over once every offset is claimed (or the run stopped) and nothing it
    admitted is still out: the end of input may then be announced."""
    return (all_claimed or stopping) and groups_out == 0
