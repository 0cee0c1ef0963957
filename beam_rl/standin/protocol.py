"""The requests the embedded server accepts, as vLLM 0.32 names their fields: `/v1/completions`,
`/v1/chat/completions`, `/inference/v1/generate` (token in, token out), and the error body of a refused
request.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, model_validator

from beam_rl.standin.generator import GenerationParams


class StreamOptions(BaseModel):
    include_usage: bool | None = False  # a last chunk with the usage of the whole request
    continuous_usage_stats: bool | None = False  # usage on every chunk too


class SamplingRequest(BaseModel):
    """Fields both endpoints honour; other fields are ignored, as vLLM ignores extras."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    model: str | None = None
    n: int = Field(1, ge=1)
    seed: int | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    return_token_ids: bool = False
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)  # salts the prefix cache
    # Not vLLM: per choice, the weights version that sampled each token (`token_weight_versions`).
    return_weight_versions: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM 0.32: a streamed choice's tokens come in chunks of this many (the first token and the end at once);
    # the server's own interval (1 here, as vLLM's default --stream-interval) is the least. Unstreamed: ignored.
    stream_interval: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return self

    def generation_params(
        self, prompt: list[int], max_tokens: int, top_logprobs: int, vocab_size: int, max_model_len: int
    ) -> GenerationParams:
        """What to generate for this request, once its prompt is tokenized; RequestError if it cannot be."""
        if self.top_p < 1.0 or (self.top_k is not None and self.top_k > 0):
            raise RequestError(400, "top_p/top_k truncation is not supported by the embedded server")
        if not prompt:
            raise RequestError(400, "prompt is empty")
        if any(t < 0 or t >= vocab_size for t in prompt):
            raise RequestError(400, f"prompt has token ids outside [0, {vocab_size})")
        if len(prompt) + max_tokens > max_model_len:
            raise RequestError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, {max_tokens} for the completion).",
            )
        return GenerationParams(
            prompt_ids=tuple(prompt),
            n=self.n,
            max_tokens=max_tokens,
            temperature=self.temperature,
            seed=self.seed,
            stop_token_ids=frozenset(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            top_logprobs=top_logprobs,
            cache_salt=self.cache_salt,
        )


class CompletionRequest(SamplingRequest):
    prompt: list[int] | str
    max_tokens: int = Field(16, ge=1)  # vLLM's completions default
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # names, tool fields: passed to the chat template as given

    role: str
    content: str


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated in favour of max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class GenerateSampling(SamplingRequest):
    """The `sampling_params` of a generate request: vLLM's SamplingParams fields the server honours."""

    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0)


class GenerateRequest(BaseModel):
    """vLLM 0.32's token-in/token-out request (`--enable-scale-out`); answers carry `weight_versions`."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    model: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: GenerateSampling
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)

    @property
    def return_weight_versions(self) -> bool:
        return self.sampling_params.return_weight_versions  # not vLLM: as on the completions route

    def generation_params(self, vocab_size: int, max_model_len: int) -> GenerationParams:
        sampling = self.sampling_params.model_copy(update={"cache_salt": self.cache_salt})
        return sampling.generation_params(
            self.token_ids, sampling.max_tokens, sampling.logprobs or 0, vocab_size, max_model_len
        )


class RequestError(Exception):
    """A request the server refuses; becomes an OpenAI-style error body with `status`."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": None, "code": self.status}}


def error_response(status: int, message: str, kind: str) -> web.Response:
    """An OpenAI-style error answer, as vLLM gives."""
    return web.json_response(RequestError(status, message, kind).body(), status=status)
