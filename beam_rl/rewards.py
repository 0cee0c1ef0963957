"""The reward step of scoring: each generated rollout of a complete group gets its environment's reward.

Runs in the scoring stage, not in the dispatcher, so an expensive reward (code execution, a judge) is
spread over the scoring workers and never holds up generation.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Sequence

from beam_rl.envs.base import Environment, RewardUnavailable, Trajectory
from beam_rl.types import Rollout


def assign_rewards(rollouts: Sequence[Rollout], env: Environment) -> None:
    """Set `reward` on every ok rollout; one whose reward is unavailable becomes an error."""
    for rollout in rollouts:
        if not rollout.ok:
            continue
        try:
            reward = env.reward(rollout.row, Trajectory(rollout.turns, rollout.info))
            if inspect.isawaitable(reward):
                reward = asyncio.run(_awaited(reward))
            rollout.reward = float(reward)
        except RewardUnavailable as exc:
            rollout.capture_error(f"RewardUnavailable: {exc}")


async def _awaited(awaitable):
    return await awaitable
