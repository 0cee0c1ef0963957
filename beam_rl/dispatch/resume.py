"""What a rollout in flight had generated when a runner checkpoint took it, and how a restored dispatcher
continues it instead of starting it again.

A launch records each call its environment made (the prompt's digest and the completions it got). A
checkpoint takes, per launch in flight, those calls plus the one in flight with the tokens streamed so far
(`ResumePoint`). After a restore, the new launch of the same attempts answers the environment's calls from
the record while they match (`Replay`: same prompt, same n) and continues the unfinished one from its tokens
(prompt + tokens so far, as a re-dispatch does). Every recorded token keeps the policy version that sampled
it. A call whose prompt differs from the record (an environment that is not deterministic across a
restart) ends the replay there: the rest is generated afresh and the record's tokens count as lost.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import logging
from array import array
from dataclasses import dataclass

from beam_rl.inference.types import Completion

log = logging.getLogger(__name__)


def prompt_digest(prompt_ids: list[int], n: int) -> bytes:
    """Names one call: its prompt tokens and how many choices it asked for."""
    return hashlib.blake2b(array("i", prompt_ids).tobytes() + n.to_bytes(4, "little"), digest_size=16).digest()


def _version_runs(versions: list[int]) -> tuple[tuple[int, int], ...]:
    """(version, run length) pairs. A checkpoint takes every launch in flight, most of whose tokens one
    version sampled: that case is counted in C, not walked token by token."""
    if versions and versions.count(versions[0]) == len(versions):
        return ((versions[0], len(versions)),)
    return tuple((version, sum(1 for _ in run)) for version, run in itertools.groupby(versions))


@dataclass(frozen=True)
class Tokens:
    """One choice's tokens, compact: ids as int32, logprobs as float32 (the windows store them so: a
    resumed rollout trains on the same values), and versions as (version, run length) pairs."""

    ids: bytes
    logprobs: bytes
    versions: tuple[tuple[int, int], ...]
    finish_reason: str | None

    @classmethod
    def of(cls, completion: Completion) -> Tokens:
        return cls(
            array("i", completion.token_ids).tobytes(),
            array("f", completion.logprobs).tobytes(),
            _version_runs(completion.policy_versions),
            completion.finish_reason,
        )

    def __len__(self) -> int:
        return len(self.ids) // 4

    def completion(self) -> Completion:
        versions: list[int] = []
        for version, count in self.versions:
            versions += [version] * count
        return Completion(
            array("i", self.ids).tolist(), array("f", self.logprobs).tolist(), self.finish_reason, versions
        )


@dataclass(frozen=True)
class Call:
    """One call of a launch to the inference client: finished, or in flight with its tokens so far."""

    prompt: bytes  # prompt_digest
    choices: tuple[Tokens, ...]
    finished: bool

    @classmethod
    def of(cls, prompt: bytes, completions: list[Completion], finished: bool) -> Call:
        return cls(prompt, tuple(map(Tokens.of, completions)), finished)

    @property
    def tokens(self) -> int:
        return sum(map(len, self.choices))


@dataclass(frozen=True)
class ResumePoint:
    """A launch's calls when a checkpoint took it, in call order (only the last may be unfinished)."""

    group_id: str
    attempts: tuple[int, ...]
    version_start: int  # the policy version its first request was sent under
    t_start: float  # when it started (Unix time): a resumed rollout's latency counts from there
    calls: tuple[Call, ...]

    @property
    def tokens(self) -> int:
        return sum(call.tokens for call in self.calls)

    def tokens_per_choice(self) -> list[int]:
        counts = [0] * len(self.attempts)
        for call in self.calls:
            for i, choice in enumerate(call.choices[: len(counts)]):
                counts[i] += len(choice)
        return counts

    @property
    def oldest_version(self) -> int | None:
        """The oldest policy version known to have sampled one of its tokens (None: none known)."""
        known = [v for call in self.calls for choice in call.choices for v, _ in choice.versions if v >= 0]
        return min(known, default=None)

    @property
    def encoded_bytes(self) -> int:
        """The size of its token data (what it adds to a checkpoint, before the runner's own encoding)."""
        return sum(len(c.ids) + len(c.logprobs) + 8 * len(c.versions) for call in self.calls for c in call.choices)


class Replay:
    """Answers a resumed launch's calls from its ResumePoint while they match the record."""

    def __init__(self, point: ResumePoint) -> None:
        self.point = point
        self._name = f"{point.group_id}/{point.attempts[0]}"
        self._calls = collections.deque(point.calls)
        self.dropped_tokens = 0  # recorded tokens a call that did not match left unused

    def next(self, prompt_ids: list[int], n: int) -> tuple[list[Completion], bool] | None:
        """The recorded completions of this call and whether it had finished; None when there is no record
        left, or the call is not the recorded one (then none of the rest is used)."""
        if not self._calls:
            return None
        call = self._calls.popleft()
        if call.prompt != prompt_digest(prompt_ids, n) or len(call.choices) != n:
            self.dropped_tokens += call.tokens + sum(c.tokens for c in self._calls)
            self._calls.clear()
            log.warning(
                "rollout %s: its environment's call differs from the one the checkpoint recorded; "
                "%d recorded tokens are generated again",
                self._name,
                self.dropped_tokens,
            )
            return None
        return [choice.completion() for choice in call.choices], call.finished
