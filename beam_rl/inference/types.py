"""What the inference client takes and returns: sampling parameters and completions, and the slice of the
client an environment calls. The client's types live here, beside it, so that environments and the
dispatcher import them without importing each other."""

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


class CompletionClient(Protocol):
    """The slice of the inference client an environment uses (beam_rl.inference.client:InferenceClient)."""

    async def complete(
        self, prompt_ids: list[int], sampling: SamplingParams, n: int = 1
    ) -> list[Completion]: ...
