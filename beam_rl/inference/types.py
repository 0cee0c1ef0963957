"""What the inference client takes and returns: sampling parameters, completions and a server's load, and
the slice of the client an environment calls. The client's types live here, beside it, so that environments
and the dispatcher import them without importing each other."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 32
    temperature: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Completion:
    """One choice of a completions response, exactly as the server returned it, with the policy version
    that sampled each token when the client knows it (empty: unknown; -1 for one token: unknown)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    policy_versions: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class ServerLoad:
    """A server's load from its Prometheus `/metrics`, summed over engines and models
    (`beam_rl.inference.parsing:parse_server_load`).

    Counts missing from the scrape read as 0; fractions and counters missing read as None.
    """

    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float | None = None  # max over engines: a fraction does not add up
    prefix_cache_hits: float | None = None
    prefix_cache_queries: float | None = None
    preemptions: float | None = None  # a counter: sequences the server preempted for KV-cache room

    @property
    def queued(self) -> float:
        return self.running + self.waiting

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        if not self.prefix_cache_queries or self.prefix_cache_hits is None:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries


class CompletionClient(Protocol):
    """The slice of the inference client an environment uses (beam_rl.inference.client:InferenceClient)."""

    async def complete(self, prompt_ids: list[int], sampling: SamplingParams, n: int = 1) -> list[Completion]: ...
