"""The RL vocabulary every layer speaks: group requests, rollouts, training samples, train batches.

Plain dataclasses, no Beam and no I/O, so the domain stays testable in milliseconds and the
Beam layer can carry these objects between stages unchanged.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from schemas.fields import (
    DISCARD_FATES,
    ROLLOUT_FIELDS,
    SAMPLE_TOKEN_FIELDS,
    declared,
    record_attributes,
    sample_attributes,
)


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
    # Of those, what a runner checkpoint kept of the ones that were generating (beam_rl.dispatch.resume.
    # ResumePoint): they continue from their tokens.
    resume: tuple[Any, ...] = ()

    @property
    def attempts_to_run(self) -> tuple[int, ...]:
        return tuple(range(self.group_size)) if self.attempts is None else self.attempts


@dataclass
class Turn:
    """One model generation inside a trajectory.

    `env_ids` are the tokens the environment appended before this generation (empty for the first
    turn, whose context is the rollout's prompt); they are context, never trained on.
    `completion_ids` are the exact ids the server returned, EOS/stop tokens included, `logprobs` and
    `policy_versions` (the policy version that sampled each) parallel to them; empty `policy_versions`
    means unknown.
    """

    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    env_ids: list[int] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


class _RolloutKeys:
    """What a rollout and its window record both derive from their values: one definition for both."""

    group_id: str
    env_name: str
    attempt: int
    status: RolloutStatus
    epoch: int
    index: int

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


@dataclass
class Rollout(_RolloutKeys):
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
    # Its timeline, Unix seconds (schemas/fields.py says what each stamp marks).
    t_admitted: float | None = None
    t_sent: float = 0.0
    t_first_token: float | None = None
    t_finished: float = 0.0
    t_scored: float | None = None
    # Filled by the train sink:
    advantage: float = 0.0
    filtered: str | None = None  # name of the filter that flagged it; None = clean
    # Tokens generated for it but not in its turns (earlier tries, a cancelled or failed one's), by fate.
    discarded_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DISCARD_FATES, 0))
    temperature: float = 1.0
    epoch: int = 0
    index: int = 0
    is_eval: bool = False
    eval_round: int = 0  # evaluation only: the committed step the round follows
    dispatch_worker: str = ""  # host:pid of the worker that dispatched it
    score_worker: str = ""  # host:pid of the worker that scored it
    _tokens: RolloutTokens | None = field(default=None, init=False, repr=False, compare=False)  # see tokens()

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

    @property
    def token_version_min(self) -> int | None:
        return min(self._token_versions(), default=None)

    @property
    def token_version_max(self) -> int | None:
        return max(self._token_versions(), default=None)

    def _token_versions(self) -> set[int]:
        return {v for t in self.turns for v in t.policy_versions if v >= 0}

    def capture_error(self, error: BaseException | str) -> None:
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.errors.append(text)
        self.status = RolloutStatus.ERROR

    def tokens(self) -> RolloutTokens:
        """Its tokens as arrays (ValueError as RolloutTokens.from_rollout), converted once, so that its
        sample and its record share them: ask once the trajectory is final (the scoring stage)."""
        if self._tokens is None:
            self._tokens = RolloutTokens.from_rollout(self)
        return self._tokens

    def record(self) -> RolloutRecord:
        """What the observation window keeps of a rollout: its declared values and its tokens as arrays.
        Tokens that cannot be read (ids outside int32, logprobs that do not match their ids) are left out,
        saying why in `errors`, so a rollout that is not trained on never stops the pipeline."""
        values = {f.attr: copy.copy(getattr(self, f.attr)) for f in ROLLOUT_FIELDS if f.source == "rollout"}
        try:
            tokens = self.tokens()
        except ValueError as exc:
            tokens = None
            values["errors"].append(f"BadTokens: {exc}")
        return RolloutRecord(**values, tokens=tokens)


@dataclass(eq=False)
class RolloutTokens:
    """A rollout's tokens end to end, laid out as its sample: the prompt, then each turn's environment
    tokens and completion tokens. Context tokens carry logprob 0 and policy version -1.

    A clean rollout's record and its Sample share the three arrays (one copy in memory). Stored next to
    what holds them (its sample in a scored group, its pending group in the packer's state), a record
    drops them and gets them back when read (beam_rl.scoring.samples.share_sample_tokens,
    BatchBuilder.restore_pending).
    """

    input_ids: np.ndarray | None  # int32 [T]
    logprobs: np.ndarray | None  # float32 [T]; NaN where the server sent none
    policy_versions: np.ndarray | None  # int32 [T]; -1 on context and where unknown
    segments: tuple[int, ...]  # prompt length, then each turn's env and completion lengths: 1 + 2 * turns
    finish_reasons: list[str | None]  # per turn

    @classmethod
    def from_rollout(cls, rollout: Rollout) -> RolloutTokens:
        """ValueError naming the rollout (and turn) for ids that are not int32 token ids, or logprobs or
        policy versions that are not one per completion id."""
        prompt = _as_ids(rollout.prompt_ids, rollout, "prompt_ids")
        ids, segments = [prompt], [len(prompt)]
        logprobs, versions = [np.zeros(len(prompt), np.float32)], [np.full(len(prompt), -1, np.int32)]
        for i, turn in enumerate(rollout.turns):
            env = _as_ids(turn.env_ids, rollout, f"turn {i} env_ids")
            completion = _as_ids(turn.completion_ids, rollout, f"turn {i} completion_ids")
            ids += [env, completion]
            logprobs += [np.zeros(len(env), np.float32), _as_logprobs(turn, rollout, i)]
            versions += [np.full(len(env), -1, np.int32), _as_versions(turn, rollout, i)]
            segments += [len(env), len(completion)]
        return cls(
            np.concatenate(ids),
            np.concatenate(logprobs),
            np.concatenate(versions),
            tuple(segments),
            [t.finish_reason for t in rollout.turns],
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RolloutTokens):
            return NotImplemented
        arrays = ("input_ids", "logprobs", "policy_versions")
        return (self.segments, self.finish_reasons) == (other.segments, other.finish_reasons) and all(
            _same(getattr(self, name), getattr(other, name)) for name in arrays
        )

    @property
    def num_turns(self) -> int:
        return len(self.finish_reasons)

    @property
    def num_tokens(self) -> int:
        return sum(self.segments)

    @property
    def completion_tokens(self) -> int:
        return sum(self.segments[2::2])

    @property
    def truncated(self) -> bool:
        return bool(self.finish_reasons) and self.finish_reasons[-1] == "length"

    def loss_mask(self) -> np.ndarray:
        """True on completion tokens."""
        generated = np.zeros(len(self.segments), dtype=bool)
        generated[2::2] = True
        return np.repeat(generated, self.segments)

    def completion_version_min(self) -> int | None:
        """The lowest policy version among its completion tokens; None when it has none, or when one of them
        is unknown (below 0). One slice a turn, not a mask over every token: the packer asks for every rollout."""
        if self.policy_versions is None:
            raise ValueError("these tokens were stored without their arrays and never given them back")
        lowest, start = None, self.segments[0]
        for env, completion in zip(self.segments[1::2], self.segments[2::2]):
            start += env
            if completion:
                turn = int(self.policy_versions[start : start + completion].min())
                lowest = turn if lowest is None else min(lowest, turn)
                start += completion
        return None if lowest is None or lowest < 0 else lowest

    def version_range(self) -> tuple[int | None, int | None]:
        """The oldest and newest known policy version among its tokens."""
        if self.policy_versions is None:
            raise ValueError("these tokens were stored without their arrays and never given them back")
        known = self.policy_versions[self.policy_versions >= 0]
        return (int(known.min()), int(known.max())) if known.size else (None, None)


@declared(record_attributes())
class RolloutRecord(_RolloutKeys):
    """A rollout as the observation window keeps it: one row of window.arrow.

    Its attributes are the columns of schemas/fields.py ROLLOUT_FIELDS whose source is "rollout" (copied
    from the Rollout) or "record" (set later: t_packed by the packer; t_committed is stamped on the file
    by the writer); the "computed" columns are the properties below, the token columns come from
    `tokens` (None when the rollout's tokens could not be read; `errors` says why).
    """

    tokens: RolloutTokens | None = None

    if TYPE_CHECKING:  # its other attributes are made at import from schemas/fields.py; a checker sees Any
        __dataclass_fields__: ClassVar[dict[str, Any]]

        def __init__(self, **values: Any) -> None: ...

        def __getattr__(self, name: str) -> Any: ...

        def __setattr__(self, name: str, value: Any) -> None: ...

    @property
    def num_turns(self) -> int:
        return self.tokens.num_turns if self.tokens else 0

    @property
    def completion_tokens(self) -> int:
        return self.tokens.completion_tokens if self.tokens else 0

    @property
    def num_tokens(self) -> int:
        """Prompt, environment and completion tokens: what the batch cutter counts."""
        return self.tokens.num_tokens if self.tokens else 0

    @property
    def truncated(self) -> bool:
        return self.tokens.truncated if self.tokens else False

    @property
    def token_version_min(self) -> int | None:
        return self.tokens.version_range()[0] if self.tokens else None

    @property
    def token_version_max(self) -> int | None:
        return self.tokens.version_range()[1] if self.tokens else None

    def record(self) -> RolloutRecord:
        return self


@declared(sample_attributes())
class Sample:
    """One flat training sequence: a whole trajectory's tokens with per-token training data; one row of a
    rank file. Its attributes are declared in schemas/fields.py: the per-token arrays of TOKEN_FIELDS
    (input_ids, loss_mask, ..., each [T]) and the per-sample values of SAMPLE_FIELDS (rollout_id, ...),
    minus what the writer computes. A per-token array with a fill value may be left out: every token
    gets the fill (policy_versions: -1, unknown)."""

    if TYPE_CHECKING:  # its attributes are made at import from schemas/fields.py; a checker sees Any
        __dataclass_fields__: ClassVar[dict[str, Any]]

        def __init__(self, **values: Any) -> None: ...

        def __getattr__(self, name: str) -> Any: ...

        def __setattr__(self, name: str, value: Any) -> None: ...

    def __post_init__(self) -> None:
        for f in SAMPLE_TOKEN_FIELDS:
            if getattr(self, f.name) is None:
                setattr(self, f.name, np.full(len(self), f.fill, f.dtype))

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


def _as_ids(ids: list[int], rollout: Rollout, what: str) -> np.ndarray:
    # numpy raises OverflowError on ids outside int32; rename it so the bad rollout is findable.
    try:
        arr = np.asarray(ids, dtype=np.int32).reshape(-1)
    except (OverflowError, TypeError, ValueError) as exc:
        raise ValueError(f"rollout {rollout.rollout_id}: {what} are not int32 token ids ({exc})") from exc
    if arr.size and arr.min() < 0:
        raise ValueError(f"rollout {rollout.rollout_id}: {what} holds a negative token id {int(arr.min())}")
    return arr


def _as_logprobs(turn: Turn, rollout: Rollout, i: int) -> np.ndarray:
    if len(turn.logprobs) != len(turn.completion_ids):
        raise ValueError(
            f"rollout {rollout.rollout_id} turn {i}: {len(turn.logprobs)} logprobs "
            f"for {len(turn.completion_ids)} completion ids"
        )
    try:
        return np.asarray(turn.logprobs, dtype=np.float32).reshape(-1)
    except (TypeError, ValueError):
        pass
    try:  # a None is kept as NaN here (the window shows what came); a training sample refuses it
        return np.array([np.nan if x is None else x for x in turn.logprobs], dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"rollout {rollout.rollout_id} turn {i}: logprobs are not numbers ({exc})") from exc


def _as_versions(turn: Turn, rollout: Rollout, i: int) -> np.ndarray:
    n = len(turn.completion_ids)
    if not turn.policy_versions:
        return np.full(n, -1, np.int32)  # unknown
    if len(turn.policy_versions) != n:
        raise ValueError(
            f"rollout {rollout.rollout_id} turn {i}: {len(turn.policy_versions)} policy versions for {n} completion ids"
        )
    return np.asarray(turn.policy_versions, dtype=np.int32)


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is b
    return np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
