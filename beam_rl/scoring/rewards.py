"""The reward step of scoring: each generated rollout of a complete group gets its environment's (or its
judge's) reward, async ones concurrently on the worker's reward loop; an unknowable one is a reward_error."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

from beam_rl.config import RewardSection, RunConfig
from beam_rl.envs.base import Environment, RewardUnavailable, Trajectory, finite_reward
from beam_rl.envs.plugins import PluginFailure, short_repr
from beam_rl.loop_thread import CLOSE_TIMEOUT_S, LoopThread
from beam_rl.scoring.judge import Judge, JudgeError
from beam_rl.types import Rollout, RolloutStatus


class RewardFailed(RuntimeError):
    """A reward raised something other than RewardUnavailable, or returned no finite number: a bug, not an
    infrastructure failure, so the run stops (a plug-in's reward raises PluginFailure instead)."""


def mark_reward_error(rollout: Rollout, reason: str) -> None:
    """The rollout was generated but its reward cannot be known: it leaves its group's advantages."""
    rollout.errors.append(f"RewardUnavailable: {reason}")
    rollout.status = RolloutStatus.REWARD_ERROR
    rollout.reward = 0.0


class RewardLoop(LoopThread):
    """The loop where a worker process's async rewards run, with the permits that bound each environment's
    concurrency."""

    def __init__(self) -> None:
        super().__init__("beam-rl-rewards")
        self._permits: dict[str, asyncio.Semaphore] = {}  # touched only on the loop's thread

    def permits(self, name: str, size: int) -> asyncio.Semaphore:
        """The permits of environment `name` (made with `size` on first use); call it on the loop."""
        if name not in self._permits:
            self._permits[name] = asyncio.Semaphore(size)
        return self._permits[name]


class EnvReward:
    """One environment's reward as the scoring stage calls it: the environment's own, or its judge's
    grade of the environment's final text."""

    def __init__(
        self,
        env: Environment,
        settings: RewardSection | None = None,
        judge: Judge | None = None,
        name: str | None = None,
    ) -> None:
        self.env = env
        self.settings = settings or RewardSection()
        self.judge = judge
        self.name = name or env.name  # the env entry's name: errors, and whose permits it takes

    def __call__(self, rollout: Rollout) -> float | Awaitable[float]:
        trajectory = Trajectory(rollout.turns, rollout.info)
        if self.judge is not None:
            return self.judge.grade(rollout.row, self.env.final_text(trajectory))
        return self.env.reward(rollout.row, trajectory)


class GroupRewards:
    """A group whose rewards are being computed: done once every async reward is in."""

    def __init__(self, rollouts: Sequence[Rollout], future: concurrent.futures.Future | None) -> None:
        self.rollouts = rollouts
        self._future = future

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self) -> Sequence[Rollout]:
        """The group's rollouts, rewarded; re-raises what stops the run (RewardFailed, PluginFailure, JudgeError)."""
        if self._future is not None:
            self._future.result()
        return self.rollouts


def wait_for_any(groups: Sequence[GroupRewards]) -> None:
    """Block until at least one of `groups` is done."""
    futures = [g._future for g in groups if g._future is not None]
    if futures and len(futures) == len(groups):
        concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED)


class Rewarder:
    """Rewards complete groups, each environment's with its own `reward` settings, on one RewardLoop.

    Sync rewards run inline in the caller's thread; async ones on the loop, at most `concurrency` per
    environment and each within `timeout_s`. RewardUnavailable or the timeout make the rollout a
    reward_error; anything else a reward raises, or a result that is not a finite number, stops the run.
    """

    def __init__(self, rewards: Mapping[str, EnvReward], loop: RewardLoop) -> None:
        self.rewards = dict(rewards)
        self.loop = loop

    @classmethod
    def from_config(cls, config: RunConfig, envs: Mapping[str, Environment], loop: RewardLoop) -> Rewarder:
        rewards = {}
        for entry in config.envs:
            judge = Judge(entry.reward.judge, entry.name) if entry.reward.judge is not None else None
            if judge is not None:
                loop.at_close(judge.aclose)
            rewards[entry.name] = EnvReward(envs[entry.name], entry.reward, judge, name=entry.name)
        return cls(rewards, loop)

    def start(self, rollouts: Sequence[Rollout]) -> GroupRewards:
        """Reward the group's ok rollouts: sync rewards now, async ones started on the loop."""
        reward = self.rewards[rollouts[0].env_name]
        waiting: list[tuple[Rollout, Awaitable[Any]]] = []
        for rollout in rollouts:
            if not rollout.ok:
                continue
            try:
                value = reward(rollout)
            except RewardUnavailable as exc:
                mark_reward_error(rollout, str(exc))
                continue
            except Exception as exc:
                raise _failure(reward, rollout, exc) from exc
            if inspect.isawaitable(value):
                waiting.append((rollout, value))
            else:
                rollout.reward = _checked(value, reward, rollout)
        if not waiting:
            return GroupRewards(rollouts, None)
        return GroupRewards(rollouts, self.loop.submit(self._await_rewards(reward, waiting)))

    async def _await_rewards(self, reward: EnvReward, waiting: list[tuple[Rollout, Awaitable[Any]]]) -> None:
        permits = self.loop.permits(reward.name, reward.settings.concurrency)
        timeout_s = reward.settings.timeout_s

        async def one(rollout: Rollout, pending: Awaitable[Any]) -> None:
            async with permits:  # the timeout starts once the reward may run, not while it queues
                task = asyncio.ensure_future(pending)
                try:
                    finished, _ = await asyncio.wait({task}, timeout=timeout_s)
                finally:
                    if not task.done():
                        task.cancel()
                if not finished:  # ours, unlike a TimeoutError the reward raises itself (a bug, like any other)
                    await asyncio.wait({task})  # the cancelled reward cleans up (a sandbox ends its processes)
                    mark_reward_error(rollout, f"the reward took longer than {timeout_s} s (reward.timeout_s)")
                    return
            try:
                value = task.result()
            except RewardUnavailable as exc:
                mark_reward_error(rollout, str(exc))
                return
            except Exception as exc:
                raise _failure(reward, rollout, exc) from exc
            rollout.reward = _checked(value, reward, rollout)

        outcomes = await asyncio.gather(*(one(r, p) for r, p in waiting), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    def close(self) -> None:
        """Close the judges' HTTP sessions (on the loop they were used on)."""
        for reward in self.rewards.values():
            if reward.judge is not None and not self.loop.closed:
                self.loop.submit(reward.judge.aclose()).result(timeout=CLOSE_TIMEOUT_S)


def _failure(reward: EnvReward, rollout: Rollout, exc: Exception) -> Exception:
    if isinstance(exc, (PluginFailure, JudgeError, RewardFailed)):  # already name the env and what broke
        return exc
    return RewardFailed(
        f"env {reward.name!r}: reward raised {type(exc).__name__}: {exc}; "
        f"rollout {rollout.rollout_id}, row {short_repr(rollout.row)}"
    )


def _checked(value: Any, reward: EnvReward, rollout: Rollout) -> float:
    number = finite_reward(value)
    if number is None:
        raise RewardFailed(
            f"env {reward.name!r}: reward returned {short_repr(value)} ({type(value).__name__}), "
            f"not a finite number; rollout {rollout.rollout_id}, row {short_repr(rollout.row)}"
        )
    return number


def assign_rewards(rollouts: Sequence[Rollout], env: Environment, settings: RewardSection | None = None) -> None:
    """Reward one group outside a pipeline (tests, offline scoring), on a loop of its own."""
    if not rollouts:
        return
    name = rollouts[0].env_name
    with RewardLoop() as loop:
        Rewarder({name: EnvReward(env, settings, name=name)}, loop).start(rollouts).wait()
