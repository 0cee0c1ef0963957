"""The reward step of scoring: plain and async rewards, concurrency and its bound, the timeout, rewards that
cannot be known (reward_error) and rewards that are broken (the run stops)."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from typing import Any

import pytest

from beam_rl.config import RewardSection
from beam_rl.envs.base import Environment, RewardUnavailable, Trajectory
from beam_rl.scoring.rewards import EnvReward, Rewarder, RewardFailed, RewardLoop, assign_rewards
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


class _SlowEnv(_LengthEnv):
    """An async reward that sleeps `row["sleep"]` seconds, counting how many run at once."""

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self.running = self.most_running = 0
        self.cancelled = 0
        self.threads: set[int] = set()

    async def reward(self, row: dict[str, Any], trajectory: Trajectory) -> float:
        self.threads.add(threading.get_ident())
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await asyncio.sleep(row["sleep"])
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
        if row.get("fail"):
            raise RewardUnavailable("judge answered garbage")
        return row["scale"]


def _rollout(attempt: int, ids: list[int], info: dict[str, Any] | None = None, group: str = "g",
             **row: Any) -> Rollout:
    return Rollout(group, "length", attempt, 3, prompt_ids=[1], turns=[Turn(ids, [0.0] * len(ids), "stop")],
                   info=info or {}, row={"scale": 2.0, **row})


def _group(group: str, n: int, **row: Any) -> list[Rollout]:
    return [_rollout(i, [5], group=group, **row) for i in range(n)]


def test_every_ok_rollout_gets_its_environments_reward_from_row_turns_and_info() -> None:
    for env in (_LengthEnv(None), _AsyncLengthEnv(None)):
        rollouts = [_rollout(0, [5, 6]), _rollout(1, [5], {"bonus": 10}), _rollout(2, [5, 6, 7])]
        rollouts[2].capture_error("HTTP 500")
        assign_rewards(rollouts, env)
        assert [r.reward for r in rollouts] == [4.0, 12.0, 0.0]  # the errored one is never scored
        assert [r.status for r in rollouts] == [RolloutStatus.OK, RolloutStatus.OK, RolloutStatus.ERROR]


def test_an_unavailable_reward_makes_the_rollout_a_reward_error_with_the_reason() -> None:
    for env in (_LengthEnv(None), _AsyncLengthEnv(None)):
        rollouts = [_rollout(0, []), _rollout(1, [5])]
        assign_rewards(rollouts, env)
        assert rollouts[0].status is RolloutStatus.REWARD_ERROR
        assert rollouts[0].errors == ["RewardUnavailable: grader down"]
        assert not rollouts[0].ok and rollouts[0].reward == 0.0
        assert rollouts[1].ok and rollouts[1].reward == 2.0


def test_sync_rewards_run_inline_and_async_ones_on_the_reward_loop() -> None:
    slow = _SlowEnv()
    with RewardLoop() as loop:
        rewarder = Rewarder({"length": EnvReward(slow)}, loop)
        rollouts = _group("g", 2, sleep=0.01)
        rewarding = rewarder.start(rollouts)
        assert not rewarding.done()  # start returns before an async reward is in
        assert [r.reward for r in rewarding.wait()] == [2.0, 2.0]
        sync = Rewarder({"length": EnvReward(_LengthEnv(None))}, loop).start(_group("h", 2))
        assert sync.done() and [r.reward for r in sync.rollouts] == [2.0, 2.0]  # done inside start
    assert threading.get_ident() not in slow.threads and len(slow.threads) == 1


def _timed(concurrency: int, groups: int, per_group: int, sleep: float) -> tuple[float, int]:
    env = _SlowEnv()
    with RewardLoop() as loop:
        rewarder = Rewarder({"length": EnvReward(env, RewardSection(concurrency=concurrency))}, loop)
        started = time.perf_counter()
        rewarding = [rewarder.start(_group(f"g{i}", per_group, sleep=sleep)) for i in range(groups)]
        for group in rewarding:
            assert [r.reward for r in group.wait()] == [2.0] * per_group
        return time.perf_counter() - started, env.most_running


def test_slow_rewards_of_several_groups_overlap() -> None:
    # 4 groups x 4 rollouts of 0.25 s: ~0.25 s together, ~4 s one at a time (the old behaviour).
    together, most = _timed(concurrency=64, groups=4, per_group=4, sleep=0.25)
    alone, one = _timed(concurrency=1, groups=4, per_group=4, sleep=0.25)
    assert (most, one) == (16, 1)
    assert alone / together > 4, (alone, together)


def test_concurrency_is_bounded_per_environment() -> None:
    _, most = _timed(concurrency=3, groups=3, per_group=4, sleep=0.02)
    assert most == 3


def test_a_reward_over_the_timeout_is_a_reward_error_and_is_cancelled() -> None:
    env = _SlowEnv()
    rollouts = [_rollout(0, [5], sleep=0.01), _rollout(1, [5], sleep=30), _rollout(2, [5], sleep=0.01, fail=True)]
    started = time.perf_counter()
    assign_rewards(rollouts, env, RewardSection(timeout_s=0.3))
    assert time.perf_counter() - started < 10
    assert [r.status for r in rollouts] == [RolloutStatus.OK, RolloutStatus.REWARD_ERROR, RolloutStatus.REWARD_ERROR]
    assert rollouts[1].errors == ["RewardUnavailable: the reward took longer than 0.3 s (reward.timeout_s)"]
    assert rollouts[2].errors == ["RewardUnavailable: judge answered garbage"]
    assert env.cancelled == 1 and env.running == 0


def test_the_timeout_does_not_count_time_spent_waiting_for_a_permit() -> None:
    # One permit, three rewards of 0.2 s, timeout 0.5 s: the third waits 0.4 s but runs for 0.2 s only.
    rollouts = _group("g", 3, sleep=0.2)
    assign_rewards(rollouts, _SlowEnv(), RewardSection(concurrency=1, timeout_s=0.5))
    assert all(r.ok for r in rollouts)


class _BrokenEnv(_LengthEnv):
    def __init__(self, result: Any, run_async: bool) -> None:
        super().__init__(None)
        self.result, self.run_async = result, run_async

    def reward(self, row: dict[str, Any], trajectory: Trajectory) -> Any:
        async def later() -> Any:
            return self._give()
        return later() if self.run_async else self._give()

    def _give(self) -> Any:
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


@pytest.mark.parametrize("run_async", [False, True])
@pytest.mark.parametrize(("result", "error"), [
    (ZeroDivisionError("division by zero"), r"reward raised ZeroDivisionError: division by zero"),
    (float("nan"), r"reward returned nan \(float\), not a finite number"),
    ("1.0", r"reward returned '1.0' \(str\), not a finite number"),
])
def test_a_broken_reward_stops_the_run_naming_the_env_and_the_rollout(result: Any, error: str, run_async: bool) -> None:
    # Not RewardUnavailable: a reward that is wrong must not quietly become a masked rollout.
    rollouts = _group("e0-i3", 2)
    with pytest.raises(RewardFailed, match=rf"env 'length': {error}; rollout e0-i3/0, row \{{'scale': 2.0\}}"):
        assign_rewards(rollouts, _BrokenEnv(result, run_async))


def test_a_reward_loop_nobody_holds_stops_its_thread() -> None:
    loop = RewardLoop()
    thread = loop._thread
    assert thread.is_alive()
    del loop
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


class _OwnTimeoutEnv(_LengthEnv):
    async def reward(self, row: dict[str, Any], trajectory: Trajectory) -> float:
        raise TimeoutError("the grader's own socket timed out")


def test_a_timeout_error_the_reward_raises_itself_is_not_taken_for_the_stages_timeout() -> None:
    with pytest.raises(RewardFailed, match="reward raised TimeoutError: the grader's own socket timed out"):
        assign_rewards(_group("g", 2), _OwnTimeoutEnv(None), RewardSection(timeout_s=30))
