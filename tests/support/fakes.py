"""The tests' one home for fakes of what a part talks to: a scripted inference client, and Beam state that
stores bytes as a runner does."""

from __future__ import annotations

import pickle
from typing import Any

from beam_rl.inference.types import Completion, SamplingParams

Reply = str | tuple[str, bool] | list[Completion]


class ScriptedClient:
    """A CompletionClient (beam_rl.inference.types) answering each call with the next scripted reply, recording
    every call as (prompt_ids, sampling, n).

    A reply is a list of Completions, returned as it is, or a text, tokenized with `tok` and answered as one
    choice: EOS appended (the server stopped on its own), or not for a `(text, False)` pair (cut at max_tokens);
    logprob -0.5 a token, and each token stamped with `version` when one is given. The prompt list is recorded
    as passed (not copied), so an environment that changes a list after handing it over shows up as a changed
    recorded prompt."""

    def __init__(self, tok: Any, *replies: Reply, version: int | None = None) -> None:
        self.tok = tok
        self.replies = list(replies)
        self.version = version
        self.calls: list[tuple[list[int], SamplingParams, int]] = []

    async def complete(self, prompt_ids: list[int], sampling: SamplingParams, n: int = 1) -> list[Completion]:
        self.calls.append((prompt_ids, sampling, n))
        reply = self.replies.pop(0)
        if isinstance(reply, list):
            return reply
        text, stopped = (reply, True) if isinstance(reply, str) else reply
        ids = self.tok.encode(text, add_special_tokens=False) + ([self.tok.eos_token_id] if stopped else [])
        versions = [] if self.version is None else [self.version] * len(ids)
        return [Completion(ids, [-0.5] * len(ids), "stop" if stopped else "length", versions)]

    @property
    def prompts(self) -> list[list[int]]:
        return [call[0] for call in self.calls]

    @property
    def samplings(self) -> list[SamplingParams]:
        return [call[1] for call in self.calls]


class StateValue:
    """A Beam ReadModifyWrite state that stores its value pickled, as a runner does; counts what was written."""

    def __init__(self) -> None:
        self.raw: bytes | None = None
        self.writes: list[int] = []  # the size of each write

    def read(self) -> Any:
        return None if self.raw is None else pickle.loads(self.raw)

    def write(self, value: Any) -> None:
        self.raw = pickle.dumps(value)
        self.writes.append(len(self.raw))


class StateBag:
    """A Beam bag state that stores each element pickled, as a runner does; counts what was added."""

    def __init__(self) -> None:
        self.items: list[bytes] = []
        self.added = 0

    def read(self) -> list[Any]:
        return [pickle.loads(item) for item in self.items]

    def add(self, value: Any) -> None:
        self.items.append(pickle.dumps(value))
        self.added += 1

    def clear(self) -> None:
        self.items = []
