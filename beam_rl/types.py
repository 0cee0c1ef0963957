"""The RL vocabulary every layer speaks: group requests, rollouts, training samples, train batches.

Plain dataclasses, no Beam and no I/O, so the domain stays testable in milliseconds and the
Beam layer can carry these objects between stages unchanged.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class RolloutStatus(str, enum.Enum):
    OK = "ok"
    ERROR = "error"  # generation failed (server error, timeout, empty trajectory, a broken turn loop)
    CANCELLED = "cancelled"
    # Generated, but its reward cannot be known (a judge or sandbox failed or timed out): left out of its
    # group's advantages rather than scored 0.
    REWARD_ERROR = "reward_error"


def make_group_id(epoch: int, index: int) -> str:
    """A group's stable identity: the dataset row it came from in a given epoch."""
    return f"e{epoch}-i{index}"


@dataclass(frozen=True)
class GroupRequest:
    """One prompt to run `group_size` times; emitted by the prompt source."""

    group_id: str
    epoch: int
    index: int  # row offset in the environment's dataset
    env_name: str
    group_size: int
    row: dict[str, Any]  # the dataset row the environment renders and scores
    is_eval: bool = False  # held-out evaluation: measured, never trained on
    eval_round: int = 0  # evaluation only: the committed step the round follows
    # The attempts to run; None = all of 0..group_size-1. A group restored from a runner checkpoint
    # runs again only the attempts whose rollouts had not left the source yet.
    attempts: tuple[int, ...] | None = None

    @property
    def attempts_to_run(self) -> tuple[int, ...]:
        return tuple(range(self.group_size)) if self.attempts is None else self.attempts


@dataclass
class Turn:
    """One model generation inside a trajectory.

    `env_ids` are the tokens the environment appended before this generation (empty for the first
    turn, whose context is the rollout's prompt); they are context, never trained on.
    `completion_ids` are the exact ids the server returned, EOS/stop tokens included.
    """

    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    env_ids: list[int] = field(default_factory=list)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass
class Rollout:
    """One attempt at a group's prompt, from dispatch to scoring."""

    group_id: str
    env_name: str
    attempt: int  # index within the group, 0..group_size-1
    group_size: int
    prompt_ids: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)  # what the environment's turn loop recorded for its reward
    row: dict[str, Any] = field(default_factory=dict)  # the dataset row: the scoring stage's reward reads it
    reward: float = 0.0  # set by the scoring stage
    status: RolloutStatus = RolloutStatus.OK
    errors: list[str] = field(default_factory=list)
    policy_version_start: int = 0
    policy_version_end: int = 0
    server: str | None = None
    t_start: float = 0.0
    t_end: float = 0.0
    # Filled by the train sink:
    advantage: float = 0.0
    filtered: str | None = None  # name of the filter that flagged it; None = clean
    temperature: float = 1.0
    epoch: int = 0
    index: int = 0
    is_eval: bool = False
    eval_round: int = 0  # evaluation only: the committed step the round follows
    dispatch_worker: str = ""  # host:pid of the worker that dispatched it
    score_worker: str = ""  # host:pid of the worker that scored it

    @property
    def rollout_id(self) -> str:
        return f"{self.group_id}/{self.attempt}"

    @property
    def ok(self) -> bool:
        return self.status is RolloutStatus.OK

    @property
    def prompt_offset(self) -> tuple[str, int, int]:
        """(env, epoch, index) of the prompt answered: what a committed step records as consumed."""
        return self.env_name, self.epoch, self.index

    @property
    def truncated(self) -> bool:
        return bool(self.turns) and self.turns[-1].truncated

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def completion_tokens(self) -> int:
        return sum(len(t.completion_ids) for t in self.turns)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + sum(len(t.env_ids) + len(t.completion_ids) for t in self.turns)

    def capture_error(self, error: BaseException | str) -> None:
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.errors.append(text)
        self.status = RolloutStatus.ERROR

    def record(self) -> RolloutRecord:
        """What the observation window keeps of a rollout once its tokens are no longer needed."""
        return RolloutRecord(
            group_id=self.group_id, env_name=self.env_name, attempt=self.attempt, epoch=self.epoch,
            index=self.index, is_eval=self.is_eval, status=self.status, reward=self.reward,
            advantage=self.advantage, filtered=self.filtered, num_turns=self.num_turns,
            completion_tokens=self.completion_tokens, num_tokens=self.num_tokens, truncated=self.truncated,
            policy_version_start=self.policy_version_start, policy_version_end=self.policy_version_end,
            server=self.server, errors=list(self.errors), t_start=self.t_start, t_end=self.t_end,
            dispatch_worker=self.dispatch_worker, score_worker=self.score_worker)


@dataclass
class RolloutRecord:
    """A rollout without its tokens: one row of the observation window (see schemas/).

    The window of a step can hold thousands of filtered rollouts; keeping only these fields keeps
    the packer's state small (and Prism 2.62 silently drops single state values of tens of MB).
    """

    group_id: str
    env_name: str
    attempt: int
    epoch: int
    index: int
    is_eval: bool
    status: RolloutStatus
    reward: float
    advantage: float
    filtered: str | None
    num_turns: int
    completion_tokens: int
    num_tokens: int  # prompt, environment and completion tokens: what the batch cutter counts
    truncated: bool
    policy_version_start: int
    policy_version_end: int
    server: str | None
    errors: list[str]
    t_start: float
    t_end: float
    dispatch_worker: str = ""
    score_worker: str = ""

    rollout_id = Rollout.rollout_id
    ok = Rollout.ok
    prompt_offset = Rollout.prompt_offset

    def record(self) -> RolloutRecord:
        return self


@dataclass
class Sample:
    """One flat training sequence: a whole trajectory's tokens with per-token training data."""

    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # bool [T], True where the model generated the token
    logprobs: np.ndarray  # float32 [T], inference logprobs (0 on context tokens)
    advantages: np.ndarray  # float32 [T], 0 on context tokens
    temperatures: np.ndarray  # float32 [T]
    rollout_id: str
    group_id: str
    policy_version: int  # version the rollout started on
    reward: float = 0.0

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class MicroBatch:
    """Samples concatenated into one row of at most `seq_len` tokens (no padding)."""

    samples: list[Sample]

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.samples)


@dataclass
class TrainBatch:
    """What one trainer step consumes: micro-batches per data-parallel rank, plus the window."""

    step: int
    micro_batches: list[list[MicroBatch]]  # [rank][micro_batch]
    group_ids: list[str]  # groups whose samples this batch trains on
    window: dict[str, Any]  # observation-window statistics of all rollouts since the last batch
    rollouts: list[RolloutRecord] = field(default_factory=list)  # the window itself, errored and filtered too
