"""The wire shapes of the embedded server: vLLM's `/v1/completions` request and response, its error
body, and the test-only fault-injection settings.
"""

from __future__ import annotations

import random
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from beam_rl.inference.generator import ChoiceResult, GenerationParams


class CompletionRequest(BaseModel):
    """The `/v1/completions` fields honoured here; other fields are ignored, as vLLM ignores extras."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    model: str | None = None
    prompt: list[int] | str
    n: int = Field(1, ge=1)
    seed: int | None = None
    max_tokens: int = Field(16, ge=1)  # vLLM's completions default
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = None
    logprobs: int | None = Field(None, ge=0)
    return_token_ids: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    stream: bool = False
    echo: bool = False


class RequestError(Exception):
    """A request the server refuses; becomes an OpenAI-style error body with `status`."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": None, "code": self.status}}


class TokenTexts:
    """Each token id's own text (`decode([id])`), memoised. The logprobs body names every generated
    token twice; decoding them one by one was most of the embedded server's CPU."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text


def completion_body(
    texts: TokenTexts, model_name: str, params: GenerationParams, request: CompletionRequest, choices: list[ChoiceResult]
) -> dict[str, Any]:
    """A vLLM-shaped completions response; `token_ids` keep the EOS/stop token that ended a choice."""
    out = []
    for index, choice in enumerate(choices):
        last = choice.token_ids[-1] if choice.token_ids else None
        out.append(
            {
                "index": index,
                "text": texts.tokenizer.decode(choice.token_ids, skip_special_tokens=request.skip_special_tokens),
                "logprobs": _logprobs_body(texts, choice, request.logprobs) if request.logprobs is not None else None,
                "finish_reason": choice.finish_reason,
                # vLLM names the stop token here when a stop_token_id (not EOS) ended the choice.
                "stop_reason": last if last is not None and last in params.stop_token_ids else None,
                "token_ids": choice.token_ids if request.return_token_ids else None,
                "prompt_token_ids": list(params.prompt_ids) if request.return_token_ids else None,
                "prompt_logprobs": None,
            }
        )
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": out,
        "usage": {
            "prompt_tokens": len(params.prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(params.prompt_ids) + completion_tokens,
        },
    }


def _logprobs_body(texts: TokenTexts, choice: ChoiceResult, top_k: int) -> dict[str, Any]:
    tokens = [texts(t) for t in choice.token_ids]
    offsets = []
    position = 0
    for text in tokens:
        offsets.append(position)
        position += len(text)
    top = None
    if top_k:
        top = [{texts(t): lp for t, lp in alternatives.items()} for alternatives in choice.top_logprobs]
    return {"tokens": tokens, "token_logprobs": choice.logprobs, "top_logprobs": top, "text_offset": offsets}


class FaultConfig(BaseModel):
    """Test-only fault injection; each rate is a per-request probability, drawn from a seeded RNG."""

    model_config = ConfigDict(extra="forbid")

    latency_s: float = Field(0.0, ge=0)  # added to every request while it holds its running slots
    error_rate: float = Field(0.0, ge=0, le=1)  # HTTP 500
    hang_rate: float = Field(0.0, ge=0, le=1)  # never answer; ends when the client disconnects
    empty_rate: float = Field(0.0, ge=0, le=1)  # HTTP 200 with zero completion tokens
    drop_rate: float = Field(0.0, ge=0, le=1)  # close the connection without a response
    seed: int = 0


FAULTS = ("drop", "error", "hang", "empty")


class FaultInjector:
    """Draws at most one fault per request; one seed gives one fault sequence."""

    def __init__(self, config: FaultConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)

    def update(self, changes: dict[str, Any]) -> FaultConfig:
        """Apply a partial update (validated as a whole); a new `seed` restarts the sequence."""
        self.config = FaultConfig.model_validate({**self.config.model_dump(), **changes})
        if "seed" in changes:
            self._rng.seed(self.config.seed)
        return self.config

    def draw(self) -> str | None:
        # Every switch is drawn on every request, so changing one rate does not shift the others.
        draws = [self._rng.random() for _ in FAULTS]
        for name, draw in zip(FAULTS, draws):
            if draw < getattr(self.config, f"{name}_rate"):
                return name
        return None
