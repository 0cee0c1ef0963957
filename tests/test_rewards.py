"""The reward step of scoring: environments' rewards, plain or async, and rewards that cannot be known."""

from __future__ import annotations

from typing import Any

from beam_rl.envs.base import Environment, RewardUnavailable, Trajectory
from beam_rl.rewards import assign_rewards
from beam_rl.types import Rollout, RolloutStatus, Turn


class _LengthEnv(Environment):
    """Reward = completion length; an empty completion means the grader is down."""

    name = "length"

    def load_rows(self, split: str = "train") -> list[dict[str, Any]]:
        return []

    def render_prompt(self, row: dict[str, Any]) -> list[int]:
        return [1]

    def reward(self, row: dict[str, Any], trajectory: Trajectory) -> float:
        ids = trajectory.turns[0].completion_ids
        if not ids:
            raise RewardUnavailable("grader down")
        return float(len(ids)) * row["scale"] + trajectory.info.get("bonus", 0)


class _AsyncLengthEnv(_LengthEnv):
    async def reward(self, row: dict[str, Any], trajectory: Trajectory) -> float:
        return super().reward(row, trajectory)


def _rollout(attempt: int, ids: list[int], info: dict[str, Any] | None = None) -> Rollout:
    return Rollout("g", "length", attempt, 3, prompt_ids=[1], turns=[Turn(ids, [0.0] * len(ids), "stop")],
                   info=info or {}, row={"scale": 2.0})


def test_every_ok_rollout_gets_its_environments_reward_from_row_turns_and_info() -> None:
    for env in (_LengthEnv(None), _AsyncLengthEnv(None)):
        rollouts = [_rollout(0, [5, 6]), _rollout(1, [5], {"bonus": 10}), _rollout(2, [5, 6, 7])]
        rollouts[2].capture_error("HTTP 500")
        assign_rewards(rollouts, env)
        assert [r.reward for r in rollouts] == [4.0, 12.0, 0.0]  # the errored one is never scored
        assert [r.status for r in rollouts] == [RolloutStatus.OK, RolloutStatus.OK, RolloutStatus.ERROR]


def test_an_unavailable_reward_makes_the_rollout_an_error_with_the_reason() -> None:
    rollouts = [_rollout(0, []), _rollout(1, [5])]
    assign_rewards(rollouts, _LengthEnv(None))
    assert rollouts[0].status is RolloutStatus.ERROR and rollouts[0].errors == ["RewardUnavailable: grader down"]
    assert rollouts[1].ok and rollouts[1].reward == 2.0
