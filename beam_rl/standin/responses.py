"""The answers of the embedded server in vLLM 0.32's shapes: a completion, a token-in/token-out generate
answer, their Server-Sent-Events streams (`serving.py`'s chunks, then `data: [DONE]`), and a chat completion.

`token_weight_versions` (per choice, parallel to `token_ids`) is not vLLM's: it appears only when a
request sets `return_weight_versions`.
"""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Any

import orjson
from tokenizers.decoders import DecodeStream

from beam_rl.standin.generator import ChoiceResult, GenerationParams, Weights
from beam_rl.standin.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest


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


def dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()  # completions bodies carry thousands of logprobs


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


def _total_usage(params: GenerationParams, choices: list[ChoiceResult]) -> dict[str, int]:
    """The usage of a whole (not streamed) answer: the prompt, and every choice's tokens."""
    return _usage(len(params.prompt_ids), sum(len(c.token_ids) for c in choices))


_ID_PREFIX = {"text_completion": "cmpl", "chat.completion": "chatcmpl"}


def _envelope(object_type: str, model_name: str) -> dict[str, Any]:
    """The OpenAI envelope's first keys (id, object, created, model), as vLLM writes them: the start of a
    whole completion or chat body, and the head of every chunk of a streamed completion."""
    return {
        "id": f"{_ID_PREFIX[object_type]}-{uuid.uuid4().hex}",
        "object": object_type,
        "created": int(time.time()),
        "model": model_name,
    }


def visible_text(tokenizer: Any, token_ids: list[int], skip_special_tokens: bool) -> str:
    """A choice's text as vLLM's detokenizer (tokenizers' DecodeStream, stepped a token at a time) leaves
    it: trailing tokens that only make an incomplete UTF-8 character are never emitted. One step of many
    tokens answers only when its last token ends a character, and then with the per-token text, so the
    longest prefix that does is taken (an unfinished character is at most 3 bytes, so 3 tokens); the
    per-token loop, several times slower, is the fallback."""
    backend = tokenizer.backend_tokenizer
    for end in range(len(token_ids), max(len(token_ids) - 4, 0), -1):
        text = DecodeStream(skip_special_tokens=skip_special_tokens).step(backend, token_ids[:end])
        if text is not None:
            return text
    stream = DecodeStream(skip_special_tokens=skip_special_tokens)
    return "".join(stream.step(backend, t) or "" for t in token_ids)


def _stop_reason(choice: ChoiceResult, params: GenerationParams) -> int | None:
    # vLLM names the stop token here when a stop_token_id (not EOS) ended the choice.
    last = choice.token_ids[-1] if choice.token_ids else None
    if choice.finish_reason == "stop" and last is not None and last in params.stop_token_ids:
        return last
    return None


def completion_logprobs(
    texts: TokenTexts, choice: ChoiceResult, start: int, end: int, top_k: int, text_offset: int = 0
) -> dict[str, Any]:
    """vLLM's `CompletionLogProbs` of tokens [start, end) of a choice, offsets counted from `text_offset`."""
    tokens = [texts(t) for t in choice.token_ids[start:end]]
    offsets = []
    for text in tokens:
        offsets.append(text_offset)
        text_offset += len(text)
    top = None
    if top_k:
        top = [{texts(t): lp for t, lp in alternatives.items()} for alternatives in choice.top_logprobs[start:end]]
    return {"tokens": tokens, "token_logprobs": choice.logprobs[start:end], "top_logprobs": top, "text_offset": offsets}


def completion_body(
    texts: TokenTexts,
    model_name: str,
    params: GenerationParams,
    request: CompletionRequest,
    choices: list[ChoiceResult],
) -> dict[str, Any]:
    """A vLLM-shaped completions response; `token_ids` keep the EOS/stop token that ended a choice."""
    out = []
    for index, choice in enumerate(choices):
        body = {
            "index": index,
            "text": visible_text(texts.tokenizer, choice.token_ids, request.skip_special_tokens),
            "logprobs": (
                completion_logprobs(texts, choice, 0, len(choice.token_ids), request.logprobs)
                if request.logprobs is not None
                else None
            ),
            "finish_reason": choice.finish_reason,
            "stop_reason": _stop_reason(choice, params),
            "token_ids": choice.token_ids if request.return_token_ids else None,
            "prompt_token_ids": list(params.prompt_ids) if request.return_token_ids else None,
            "prompt_logprobs": None,
        }
        if request.return_weight_versions:
            body["token_weight_versions"] = choice.weight_versions
        out.append(body)
    return {**_envelope("text_completion", model_name), "choices": out, "usage": _total_usage(params, choices)}


def label_spans(sampled_by: list[Weights]) -> list[dict[str, Any]]:
    """vLLM's `weight_versions` of a choice: [start, end) runs of output tokens under one label."""
    spans: list[dict[str, Any]] = []
    start = 0
    for label, run in itertools.groupby(w.label for w in sampled_by):
        end = start + sum(1 for _ in run)
        spans.append({"version": label, "start": start, "end": end})
        start = end
    return spans


class _ChoiceStream:
    """The SSE chunks of one streamed request: one per choice per step that sampled tokens or finished it,
    as vLLM's stream generators write them; subclasses shape each chunk. With a `stream_interval` of N, as
    vLLM 0.32's output processor: a choice's first tokens at once, then a chunk each time N more are held, and
    what is left when it ends (an abort included); a pause holds a partial chunk until generation resumes."""

    def __init__(self, params: GenerationParams, stream_options: Any, stream_interval: int | None = None) -> None:
        self.params = params
        self._interval = max(stream_interval or 1, 1)  # clamped below by the server's own (vLLM's default: 1)
        n = params.n
        self._sent = [0] * n  # tokens already in a chunk, per choice
        self._finished = [False] * n
        self._usage = bool(stream_options and stream_options.include_usage)
        self._continuous_usage = self._usage and bool(stream_options and stream_options.continuous_usage_stats)
        self._head: dict[str, Any] = {}

    def chunks(self, choices: list[ChoiceResult]) -> bytes:
        """`data:` events for what the choices gained since the last call."""
        events = []
        for index, choice in enumerate(choices):
            start, end = self._sent[index], len(choice.token_ids)
            finished = choice.finish_reason is not None
            if self._finished[index] or (end == start and not finished) or (end == 0 and finished):
                continue  # nothing new; a choice that ends with no token at all sends nothing, as in vLLM
            if not finished and start > 0 and end - start < self._interval:
                continue  # a partial chunk waits for the rest of it (or for the choice's end)
            self._sent[index], self._finished[index] = end, finished
            if choice.finish_reason == "abort" and end > start:
                # An abort samples nothing: tokens not yet streamed came from earlier steps, and vLLM
                # streams them before the abort's own chunk, which carries no token.
                events.append(self._event(index, choice, start, end, None))
                start = end
            events.append(self._event(index, choice, start, end, choice.finish_reason))
        return b"".join(events)

    def _event(self, index: int, choice: ChoiceResult, start: int, end: int, finish_reason: str | None) -> bytes:
        chunk: dict[str, Any] = {**self._head, "choices": [self._choice(index, choice, start, end, finish_reason)]}
        if self._continuous_usage:
            chunk["usage"] = _usage(len(self.params.prompt_ids), end)
        return _event(chunk)

    def _choice(
        self, index: int, choice: ChoiceResult, start: int, end: int, finish_reason: str | None
    ) -> dict[str, Any]:
        raise NotImplementedError

    def end(self) -> bytes:
        """The usage chunk (when asked for) and `data: [DONE]`."""
        tail = b""
        if self._usage:
            usage = _usage(len(self.params.prompt_ids), sum(self._sent))
            tail = _event({**self._head, "choices": [], "usage": usage})
        return tail + b"data: [DONE]\n\n"


class CompletionStream(_ChoiceStream):
    """A streamed completion, as vLLM's `completion_stream_generator` writes it."""

    def __init__(
        self, texts: TokenTexts, model_name: str, params: GenerationParams, request: CompletionRequest
    ) -> None:
        super().__init__(params, request.stream_options, request.stream_interval)
        self.texts, self.request = texts, request
        self._backend = texts.tokenizer.backend_tokenizer
        self._head = _envelope("text_completion", model_name)
        # vLLM's own incremental detokenizer: an incomplete UTF-8 character waits for the token completing it.
        self._text = [DecodeStream(skip_special_tokens=request.skip_special_tokens) for _ in range(params.n)]
        self._text_offset = [0] * params.n

    def _choice(
        self, index: int, choice: ChoiceResult, start: int, end: int, finish_reason: str | None
    ) -> dict[str, Any]:
        request = self.request
        logprobs = None
        if request.logprobs is not None:
            logprobs = completion_logprobs(self.texts, choice, start, end, request.logprobs, self._text_offset[index])
            if logprobs["tokens"]:
                self._text_offset[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        body: dict[str, Any] = {
            "index": index,
            "text": self._step_text(index, choice.token_ids[start:end], whole=start == 0 and finish_reason is not None),
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": _stop_reason(choice, self.params) if finish_reason else None,
            "prompt_token_ids": list(self.params.prompt_ids) if request.return_token_ids and start == 0 else None,
            "token_ids": choice.token_ids[start:end] if request.return_token_ids else None,
        }
        if request.return_weight_versions:
            body["token_weight_versions"] = choice.weight_versions[start:end]
        return body

    def _step_text(self, index: int, token_ids: list[int], whole: bool) -> str:
        """The text a choice's detokenizer emits for these tokens, stepped one token at a time as vLLM's is. A
        whole choice in one chunk (the instant backend's) is a whole answer's text (the per-token loop was half
        the instant server's CPU); a choice streamed in parts goes token by token."""
        if whole:
            return visible_text(self.texts.tokenizer, token_ids, self.request.skip_special_tokens)
        stream = self._text[index]
        return "".join(stream.step(self._backend, t) or "" for t in token_ids)


def _generate_choice(
    choice: ChoiceResult,
    params: GenerationParams,
    request: GenerateRequest,
    index: int,
    start: int,
    end: int,
    finish_reason: str | None,
) -> dict[str, Any]:
    """One choice of a generate answer or chunk: tokens [start, end), and the labels' spans once it ends."""
    logprobs = None
    if request.sampling_params.logprobs is not None:
        logprobs = {
            "content": [
                # `token` as vLLM writes it without a tokenizer (`token_id:N`): verifiers' renderer client
                # (prime-rl's generate path) checks it against the sampled ids.
                {"token_id": t, "token": f"token_id:{t}", "logprob": max(lp, -9999.0), "top_logprobs": []}
                for t, lp in zip(choice.token_ids[start:end], choice.logprobs[start:end])
            ]
        }
    body: dict[str, Any] = {
        "index": index,
        "finish_reason": finish_reason,
        "stop_reason": _stop_reason(choice, params) if finish_reason else None,
        "token_ids": choice.token_ids[start:end],
        "logprobs": logprobs,
        "weight_versions": label_spans(choice.sampled_by) if finish_reason else None,  # vLLM: final chunk only
    }
    if request.return_weight_versions:
        body["token_weight_versions"] = choice.weight_versions[start:end]
    return body


def generate_body(
    texts: TokenTexts, model_name: str, params: GenerationParams, request: GenerateRequest, choices: list[ChoiceResult]
) -> dict[str, Any]:
    """vLLM's `GenerateTokensResponse` (output_mode "tokens")."""
    return {
        "request_id": uuid.uuid4().hex,
        "model": model_name,
        "created": int(time.time()),
        "output_mode": "tokens",
        "choices": [
            _generate_choice(c, params, request, i, 0, len(c.token_ids), c.finish_reason) for i, c in enumerate(choices)
        ],
        "usage": _total_usage(params, choices),
    }


class GenerateStream(_ChoiceStream):
    """A streamed generate answer, as vLLM's `serve_tokens_stream_generator` writes it."""

    def __init__(self, params: GenerationParams, request: GenerateRequest) -> None:
        super().__init__(params, request.stream_options, request.sampling_params.stream_interval)
        self.request = request
        self._head = {"request_id": uuid.uuid4().hex, "output_mode": "tokens"}

    def _choice(
        self, index: int, choice: ChoiceResult, start: int, end: int, finish_reason: str | None
    ) -> dict[str, Any]:
        return _generate_choice(choice, self.params, self.request, index, start, end, finish_reason)


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chat_body(
    texts: TokenTexts,
    model_name: str,
    params: GenerationParams,
    request: ChatCompletionRequest,
    choices: list[ChoiceResult],
) -> dict[str, Any]:
    """A vLLM-shaped chat completion: the assistant's reply in `choices[].message.content`."""
    out = []
    for index, choice in enumerate(choices):
        content = visible_text(texts.tokenizer, choice.token_ids, request.skip_special_tokens)
        body = {
            "index": index,
            "message": {
                "role": "assistant",
                "content": content,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": None,
            },
            "logprobs": _chat_logprobs(texts, choice, request.top_logprobs) if request.logprobs else None,
            "finish_reason": choice.finish_reason,
            "stop_reason": _stop_reason(choice, params),
            "token_ids": choice.token_ids if request.return_token_ids else None,
        }
        if request.return_weight_versions:
            body["token_weight_versions"] = choice.weight_versions
        out.append(body)
    return {
        **_envelope("chat.completion", model_name),
        "choices": out,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": _total_usage(params, choices),
        "prompt_logprobs": None,
        "prompt_token_ids": list(params.prompt_ids) if request.return_token_ids else None,
        "kv_transfer_params": None,
    }


def _chat_logprobs(texts: TokenTexts, choice: ChoiceResult, top_k: int) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = texts(token_id)
        return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode())}

    content = []
    for position, (token_id, logprob) in enumerate(zip(choice.token_ids, choice.logprobs)):
        alternatives = choice.top_logprobs[position].items() if top_k else ()
        top = [entry(t, lp) for t, lp in sorted(alternatives, key=lambda kv: -kv[1])[:top_k]]
        content.append({**entry(token_id, logprob), "top_logprobs": top})
    return {"content": content}
