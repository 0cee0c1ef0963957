"""What a vLLM server's answers say, read into the client's types: the choices of a completions answer, those
of each event of a stream (or of a whole generate answer), the load in its `/metrics` and the weight version
in its `/weight_info`. Malformed answers raise `InferenceBadResponse`; nothing here does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import orjson
from prometheus_client.parser import text_string_to_metric_families

from beam_rl.inference.errors import InferenceBadResponse
from beam_rl.inference.types import Completion, ServerLoad


def _as(kind: type, values: list[Any]) -> list[Any]:
    """`values` as a list of `kind`: itself when it already is one (what orjson parses from a
    well-formed answer; the type check runs in C), else converted item by item."""
    if set(map(type, values)) <= {kind}:
        return values
    return [kind(v) for v in values]


def out_of_vocabulary(token_ids: list[int], vocab_size: int) -> str | None:
    """What puts `token_ids` (integers, as parsed) outside [0, vocab_size), where an id would index past the
    trainer's embedding, or None. On the path of every answer: min and max run in C (about 30 ns a token of a
    whole answer, 300 ns an event of a stream, CPU time on a loaded 2-core machine)."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        low, high = min(token_ids), max(token_ids)
        return f"token id {low if low < 0 else high} outside the model's vocabulary [0, {vocab_size})"
    return None


def parse_completions(body: Any, url: str, n: int) -> list[Completion]:
    """The choices of a `/v1/completions` answer, ordered by `index`, with ids and logprobs checked."""

    def bad(reason: str) -> InferenceBadResponse:
        return InferenceBadResponse(f"{url}: bad completions response: {reason}", url)

    if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
        raise bad("no 'choices' list")
    choices = body["choices"]
    if len(choices) != n:
        raise bad(f"asked for n={n} choices, got {len(choices)}")
    try:
        choices = sorted(choices, key=lambda c: int(c.get("index", 0)))
    except (AttributeError, TypeError, ValueError) as exc:
        raise bad(f"unreadable choice index ({exc})") from None
    completions = []
    for choice in choices:
        index = choice.get("index", 0)
        token_ids = choice.get("token_ids")
        if not isinstance(token_ids, list):
            raise bad(f"choice {index} has no 'token_ids' (is return_token_ids supported?)")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if not isinstance(logprobs, list):
            raise bad(f"choice {index} has no 'logprobs.token_logprobs'")
        if len(token_ids) != len(logprobs):
            raise bad(f"choice {index} has {len(token_ids)} token ids but {len(logprobs)} logprobs")
        try:
            completions.append(
                Completion(
                    token_ids=_as(int, token_ids),
                    logprobs=_as(float, logprobs),
                    finish_reason=choice.get("finish_reason"),
                )
            )
        except (TypeError, ValueError) as exc:
            raise bad(f"choice {index} has a non-numeric token id or logprob ({exc})") from None
    return completions


# One choice's part of a chunk: its index, new token ids and their logprobs, finish reason (None while it
# runs) and `weight_versions` spans (None but in a generate-route choice's last chunk).
ChunkChoice = tuple[int, list[int], list[float], str | None, list[Any] | None]


def chunk_choices(chunk: Any, n: int, bad: Callable[[str], Exception]) -> Iterator[ChunkChoice]:
    """The choices of one server-sent event of a streamed answer, or of a whole generate answer, for a
    request of `n` choices: vLLM's completions shape (`logprobs.token_logprobs`) or its generate shape
    (`logprobs.content`, and `weight_versions` when a choice ends). `bad(reason)` makes the exception for a
    malformed one. A generator, so that the choices before a malformed one are taken before it raises."""
    if not isinstance(chunk, dict) or not isinstance(chunk.get("choices"), list):
        raise bad("a stream chunk without a 'choices' list")
    for choice in chunk["choices"]:
        index = choice.get("index", 0)
        if not isinstance(index, int) or not 0 <= index < n:
            raise bad(f"a stream chunk for choice {index!r} of {n}")
        try:  # as a whole answer's (parse_completions): what is kept of them is a list of ints
            token_ids = _as(int, choice.get("token_ids") or [])
        except (TypeError, ValueError) as exc:
            raise bad(f"choice {index}: a non-numeric token id ({exc})") from None
        logprobs = choice.get("logprobs") or {}
        if "content" in logprobs:
            try:
                logprobs = [entry["logprob"] for entry in logprobs["content"] or ()]
            except (KeyError, TypeError) as exc:
                raise bad(f"choice {index}: unreadable logprobs.content ({exc!r})") from None
        else:
            logprobs = logprobs.get("token_logprobs") or []
        if len(token_ids) != len(logprobs):
            raise bad(f"choice {index}: a chunk of {len(token_ids)} token ids with {len(logprobs)} logprobs")
        yield index, token_ids, logprobs, choice.get("finish_reason"), choice.get("weight_versions")


# The samples a ServerLoad is made of (vLLM v1's names and the older ones). vLLM's exposition is mostly
# histograms (hundreds of bucket lines a server); only these lines are handed to the parser.
_LOAD_SAMPLES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_queries_total",
    "vllm:num_preemptions_total",
)


def load_lines(text: str) -> str:
    """The sample lines of `text` that a ServerLoad reads, without their families' comments: the same sums and
    maxima, parsed at a fraction of the cost (the dispatcher polls every server; bench/README.md)."""
    return "".join(
        line + "\n"
        for line in text.splitlines()
        if line.startswith(_LOAD_SAMPLES) and line.partition("{")[0].split(" ", 1)[0] in _LOAD_SAMPLES
    )


def parse_server_load(text: str) -> ServerLoad:
    """Parse a Prometheus text exposition into a `ServerLoad` (raises ValueError if a line it reads is
    malformed)."""
    sums: dict[str, float] = {}
    maxes: dict[str, float] = {}
    for family in text_string_to_metric_families(load_lines(text)):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
            maxes[sample.name] = max(maxes.get(sample.name, -math.inf), sample.value)
    # vLLM renamed the KV metrics in v1; accept the older names so older servers still balance.
    kv = maxes.get("vllm:kv_cache_usage_perc", maxes.get("vllm:gpu_cache_usage_perc"))
    hits = sums.get("vllm:prefix_cache_hits_total", sums.get("vllm:gpu_prefix_cache_hits_total"))
    queries = sums.get("vllm:prefix_cache_queries_total", sums.get("vllm:gpu_prefix_cache_queries_total"))
    return ServerLoad(
        running=sums.get("vllm:num_requests_running", 0.0),
        waiting=sums.get("vllm:num_requests_waiting", 0.0),
        kv_cache_usage=kv,
        prefix_cache_hits=hits,
        prefix_cache_queries=queries,
        preemptions=sums.get("vllm:num_preemptions_total"),
    )


def parse_weight_info(text: str, base_url: str) -> str:
    """The weight version in vLLM's `GET /weight_info` answer ("default" until one is set)."""
    try:
        return str(orjson.loads(text)["weight_version"])
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise InferenceBadResponse(f"{base_url}/weight_info: unexpected answer ({exc})", base_url) from None
