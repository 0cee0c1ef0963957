"""Held-out evaluation: every K committed steps, the eval split of each environment goes through the
same dispatcher (same servers, current policy); its rollouts are rewarded, summarised, never trained on."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from beam_rl.types import RolloutRecord, RolloutStatus


def summarize_round(after_step: int, records: Sequence[RolloutRecord]) -> dict[str, Any]:
    """Per environment: mean reward and pass@1 (share of rollouts with full reward) over ok rollouts."""
    by_env: dict[str, list[RolloutRecord]] = defaultdict(list)
    for record in records:
        by_env[record.env_name].append(record)
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
    version = min((r.policy_version_start for r in records), default=0)
    return {"after_step": after_step, "policy_version": version, "envs": envs}
