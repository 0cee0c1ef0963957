"""Completions in flight on one server: the tokens each choice has received so far, the policy version
that sampled each of them, and what a caller may watch of its rollout while it generates (`Progress`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from beam_rl.inference.errors import InferenceCorruptResponse
from beam_rl.inference.parsing import chunk_choices, out_of_vocabulary
from beam_rl.inference.types import Completion

# A token whose sampling version cannot be known from outside the server (a reload while it generated).
UNKNOWN_VERSION = -1
ABORT = "abort"  # vLLM's finish_reason of a request ended by /pause?mode=abort (its tokens so far are kept)


@dataclass
class Progress:
    """One rollout's generation so far, over all of its requests and servers: completion tokens received
    per choice, the oldest policy version that may have sampled one of them, and when the first came."""

    choices: int = 1
    tokens: list[int] = field(init=False)
    oldest_version: int | None = None
    first_token_at: float | None = None  # Unix time
    # The choices of the call in flight, as its tokens arrive (InferenceClient.complete sets them): what a
    # checkpoint of the rollout takes (dispatch/resume.py). Read them; never change them.
    live: list[Completion] | None = None
    # Called once a choice, the first time a server ends it (stop or length, not a pause's abort): a group
    # call's finished choice frees its permit while the others generate (Dispatcher._choice_ended).
    on_choice_end: Callable[[int], None] | None = None
    ended: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.tokens = [0] * self.choices

    @property
    def total(self) -> int:
        return sum(self.tokens)

    def may_hold(self, version: int) -> None:
        """Some token of this rollout may have been sampled by `version` (a lower bound)."""
        self.oldest_version = version if self.oldest_version is None else min(self.oldest_version, version)

    def choice_ended(self, choice: int) -> None:
        if choice in self.ended:
            return
        self.ended.add(choice)
        if self.on_choice_end is not None:
            self.on_choice_end(choice)

    def received(self, choice: int, count: int, version_floor: int) -> None:
        if count <= 0:
            return
        self.tokens[choice] += count
        self.may_hold(version_floor)
        if self.first_token_at is None:
            self.first_token_at = time.time()


@dataclass(eq=False)
class LiveRequest:
    """One completions or generate request in flight. Its choices are the caller's own Completion objects,
    extended as tokens arrive, so what was received survives any failure of the request.

    `version` is stamped on the tokens that arrive now; a weight update changes it at the instant the
    server switches weights as seen from here (docs/weight-updates.md), or sets UNKNOWN_VERSION when that
    instant cannot be seen. `floor` is the oldest version any of its tokens can have. With `label_version`
    (the generate route, under labels the client set while the server was paused), the server's own
    `weight_versions` spans, sent when a choice ends, replace those stamps with the labels' versions.
    """

    choices: list[Completion]
    targets: list[int]  # each choice's index in the caller's choices (and in its Progress)
    version: int
    floor: int
    streamed: bool
    progress: Progress | None = None
    label_version: Callable[[str], int] | None = None
    last_data_at: float = field(default_factory=time.monotonic)  # a stream's last bytes (set by its reader)
    body: Any = None  # the streamed body (aiohttp's StreamReader) while its reader reads it
    body_taken: int = 0  # bytes of `body` its reader has taken
    aborted_by_us: bool = False  # a continue-mode update paused this server with mode=abort while it ran
    updates_lived: int = 0  # keep and continue updates begun while it was in flight
    received_at_resume: list[int] | None = None  # each choice's tokens when the server last resumed
    url: str = ""  # where it was sent: what a corrupt answer's error names
    vocab_size: int | None = None  # the model's: token ids outside [0, vocab_size) are refused
    starts: list[int] = field(init=False)  # each choice's tokens from earlier requests (spans count from here)

    def __post_init__(self) -> None:
        self.starts = [len(choice.token_ids) for choice in self.choices]
        for choice in self.choices:
            choice.finish_reason = None
        if not self.streamed and self.progress is not None:
            self.progress.may_hold(self.floor)  # its tokens stay out of sight until it ends: assume the oldest

    def took(self, block: bytes) -> None:
        """The stream's reader took `block` of its body (part of an event is news too: the rest is coming)."""
        self.last_data_at = time.monotonic()
        self.body_taken += len(block)

    @property
    def untaken_bytes(self) -> int:
        """Bytes the loop has read from the socket into the body that its reader has not taken yet: it
        wakes the reader to take them in the loop's next pass."""
        return self.body.total_bytes - self.body_taken if self.body is not None else 0

    def add(self, index: int, token_ids: list[int], logprobs: list[float], finish_reason: str | None) -> None:
        # Every token enters a choice here, whatever the route: checked before it is kept, so that what a
        # failure leaves in `partial` (continued on another server) holds none of a corrupt answer's.
        vocab = self.vocab_size
        if vocab is not None and token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab):  # inline: hot
            raise InferenceCorruptResponse(
                f"{self.url}: choice {index}: {out_of_vocabulary(token_ids, vocab)}", self.url
            )
        choice = self.choices[index]
        choice.token_ids.extend(token_ids)
        choice.logprobs.extend(logprobs)
        choice.policy_versions.extend([self.version] * len(token_ids))
        if finish_reason is not None:
            choice.finish_reason = finish_reason
        if self.progress is not None:
            floor = self.version if self.version != UNKNOWN_VERSION else self.floor
            self.progress.received(self.targets[index], len(token_ids), floor)
            if finish_reason is not None and finish_reason != ABORT:
                self.progress.choice_ended(self.targets[index])

    def add_chunk(self, chunk: Any, bad: Any) -> None:
        """One server-sent event of a streamed answer, or a whole generate answer (read by
        `parsing.chunk_choices`): each choice's new tokens, and the versions its `weight_versions` spans name
        when it ends. `bad(reason)` makes the exception for a malformed one."""
        for index, token_ids, logprobs, finish_reason, spans in chunk_choices(chunk, len(self.choices), bad):
            self.add(index, token_ids, logprobs, finish_reason)
            if spans and self.label_version is not None:
                self._stamp_spans(index, spans, bad)

    def resuming(self, version: int) -> None:
        """The server resumes now: stamp `version` on what arrives from here on. Everything received so far
        was sampled before the pause."""
        self.received_at_resume = [len(c.token_ids) - start for c, start in zip(self.choices, self.starts)]
        self.version = version

    def settle_aborted(self) -> None:
        """Once the request is over, in continue mode: a choice the server ran before the pause was wholly
        sampled then, by the version the request was sent under (`floor`), whenever its tokens arrived. It
        ran then if the pause aborted it, or if it had a token before the resume. Otherwise it either finished
        before the pause or reached the server during it and ran after; its unknown stamps stay."""
        if not self.aborted_by_us or self.updates_lived != 1 or self.received_at_resume is None:
            return
        for choice, start, before in zip(self.choices, self.starts, self.received_at_resume):
            if choice.finish_reason == ABORT or before > 0:
                versions = choice.policy_versions
                versions[start:] = [self.floor if v == UNKNOWN_VERSION else v for v in versions[start:]]

    def _stamp_spans(self, index: int, spans: list[Any], bad: Any) -> None:
        label = self.label_version
        assert label is not None  # the caller checked
        versions = self.choices[index].policy_versions
        base = self.starts[index]
        try:
            for span in spans:
                start, end = base + span["start"], base + span["end"]
                if not base <= start <= end <= len(versions):
                    raise bad(f"choice {index}: weight_versions span {span} outside its {len(versions) - base} tokens")
                versions[start:end] = [label(str(span["version"]))] * (end - start)
        except (KeyError, TypeError) as exc:
            raise bad(f"choice {index}: unreadable weight_versions ({exc!r})") from None


def copy_completion(c: Completion) -> Completion:
    return Completion(list(c.token_ids), list(c.logprobs), c.finish_reason, list(c.policy_versions))


@dataclass(frozen=True)
class UpdateTiming:
    """What one weight update cost one server: how long it generated nothing because it was paused (0 in
    reload mode, where the engine stops only for the load itself) and how long the load took."""

    url: str
    mode: str
    version: int
    paused_s: float
    reload_s: float

    @property
    def engine_idle_s(self) -> float:
        """Engine time the update took from generation: the pause, or (reload mode) the load itself."""
        return self.paused_s if self.mode != "reload" else self.reload_s

    def as_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "mode": self.mode,
            "version": self.version,
            "paused_s": round(self.paused_s, 4),
            "reload_s": round(self.reload_s, 4),
            "engine_idle_s": round(self.engine_idle_s, 4),
        }
