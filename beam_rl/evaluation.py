"""Held-out evaluation: every K committed steps, the eval split of each environment goes through the
same dispatcher (same servers, current policy) and its rollouts are scored, never trained on."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

import numpy as np

from beam_rl.schedule import PromptSchedule
from beam_rl.types import GroupRequest, Rollout, RolloutStatus

EVAL_PREFIX = "eval"


@dataclasses.dataclass
class EvalRound:
    after_step: int
    policy_version: int
    expected_groups: int
    rollouts: list[Rollout] = dataclasses.field(default_factory=list)
    groups_done: int = 0

    def summary(self) -> dict[str, Any]:
        """Per environment: mean reward and pass@1 (share of rollouts with full reward) over ok rollouts."""
        by_env: dict[str, list[Rollout]] = defaultdict(list)
        for rollout in self.rollouts:
            by_env[rollout.env_name].append(rollout)
        envs = {}
        for env, rollouts in sorted(by_env.items()):
            rewards = np.array([r.reward for r in rollouts if r.status is RolloutStatus.OK], dtype=float)
            envs[env] = {
                "prompts": len({r.group_id for r in rollouts}),
                "rollouts": len(rollouts),
                "errored": sum(r.status is not RolloutStatus.OK for r in rollouts),
                "mean_reward": float(rewards.mean()) if rewards.size else None,
                "pass@1": float((rewards >= 1.0).mean()) if rewards.size else None,
            }
        return {"after_step": self.after_step, "policy_version": self.policy_version, "envs": envs}


def eval_groups(schedule: PromptSchedule, after_step: int, samples_per_prompt: int,
                policy_version: int) -> list[GroupRequest]:
    """One group per held-out prompt, with ids no training group can have."""
    groups = []
    for position in range(len(schedule)):
        request = schedule.group(position, policy_version)
        groups.append(dataclasses.replace(
            request, group_id=f"{EVAL_PREFIX}@{after_step}/{request.group_id}",
            group_size=samples_per_prompt, is_eval=True))
    return groups
