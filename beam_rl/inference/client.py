"""Async client of one vLLM server: token-in/token-out completions, load, health and weight reload.

Errors are typed (`InferenceError` and subclasses) so the dispatcher can tell a sick server from a
bad request; transient failures (connection, timeout, HTTP 5xx) are retried with backoff here.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from beam_rl.envs.base import Completion, SamplingParams

log = logging.getLogger(__name__)

# Hundreds of rollouts share one server; aiohttp's default of 100 connections would queue them.
DEFAULT_MAX_CONNECTIONS = 1024


class InferenceError(Exception):
    """Any failure talking to an inference server; the message names the server URL."""

    #: True when the failure says something about the server's health (it counts toward marking
    #: the server unhealthy) rather than about the request that was sent.
    server_fault: bool = False
    #: True when sending the same request again may succeed.
    retryable: bool = False

    def __init__(self, message: str, url: str) -> None:
        super().__init__(message)
        self.url = url


class InferenceHTTPError(InferenceError):
    """The server answered with a non-2xx status (5xx retryable, 4xx not)."""

    def __init__(self, message: str, url: str, status: int, body: str = "") -> None:
        super().__init__(message, url)
        self.status = status
        self.body = body
        # 503 is what a paused vLLM answers: it is transient, so retry it like any 5xx.
        self.retryable = self.server_fault = status >= 500


class InferenceTimeout(InferenceError):
    server_fault = True
    retryable = True


class InferenceConnectionError(InferenceError):
    server_fault = True
    retryable = True

    def __init__(self, message: str, url: str, refused: bool = False) -> None:
        super().__init__(message, url)
        #: No connection could be made at all: the server is down rather than slow or sick, so the
        #: pool takes it out of selection at once instead of after several failures.
        self.refused = refused


class InferenceBadResponse(InferenceError):
    """A 2xx answer that is not what the protocol promises (bad JSON, missing or mismatched fields)."""


@dataclass(frozen=True)
class Answer:
    """A 2xx answer: the URL asked and the raw body (parsed by the caller, with orjson for JSON)."""

    url: str
    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        try:
            return orjson.loads(self.body)
        except orjson.JSONDecodeError as exc:
            raise InferenceBadResponse(f"{self.url}: response is not JSON ({exc})", self.url) from None


@dataclass(frozen=True)
class ServerLoad:
    """A server's load from its Prometheus `/metrics`, summed over engines and models.

    Counts missing from the scrape read as 0; fractions and counters missing read as None.
    """

    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float | None = None  # max over engines: a fraction does not add up
    prefix_cache_hits: float | None = None
    prefix_cache_queries: float | None = None

    @property
    def queued(self) -> float:
        return self.running + self.waiting

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        if not self.prefix_cache_queries or self.prefix_cache_hits is None:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries


def parse_server_load(text: str) -> ServerLoad:
    """Parse a Prometheus text exposition into a `ServerLoad` (raises ValueError if malformed)."""
    sums: dict[str, float] = {}
    maxes: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
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
    )


def _as(kind: type, values: list[Any]) -> list[Any]:
    """`values` as a list of `kind`: itself when it already is one (what orjson parses from a
    well-formed answer; the type check runs in C), else converted item by item."""
    if set(map(type, values)) <= {kind}:
        return values
    return [kind(v) for v in values]


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


class InferenceClient:
    """One vLLM server. Implements `CompletionClient`; safe to share among hundreds of rollouts."""

    def __init__(
        self,
        base_url: str,
        model: str = "default",
        timeout_s: float = 60.0,
        max_retries: int = 2,
        backoff_s: float = 0.2,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        if max_retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ValueError("need max_retries >= 0, timeout_s > 0 and backoff_s >= 0")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_connections = max_connections
        # aiohttp rather than httpx: with hundreds of requests in flight, httpx's pool bookkeeping
        # (linear in open connections per request) was most of the dispatcher's CPU (bench/README.md).
        self._session: aiohttp.ClientSession | None = None  # made on first use, on the loop using it

    def __repr__(self) -> str:
        return f"InferenceClient({self.base_url!r}, model={self.model!r})"

    async def complete(self, prompt_ids: list[int], sampling: SamplingParams, n: int = 1) -> list[Completion]:
        payload: dict[str, Any] = {
            "model": self.model,
            "prompt": list(prompt_ids),
            "n": n,
            "max_tokens": sampling.max_tokens,  # vLLM's default is 16: always say it
            "temperature": sampling.temperature,
            # The sampled tokens' logprobs only: 1 would add an alternative per token to the answer,
            # which the dispatcher then parses (its JSON is 36% smaller with 0; bench/README.md).
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "stop_token_ids": list(sampling.stop_token_ids),
        }
        if sampling.seed is not None:
            payload["seed"] = sampling.seed
        answer = await self._request("POST", "/v1/completions", json=payload)
        return parse_completions(answer.json(), answer.url, n)

    async def load(self) -> ServerLoad:
        answer = await self._request("GET", "/metrics", retry=False)
        try:
            return parse_server_load(answer.text)
        except ValueError as exc:
            raise InferenceBadResponse(
                f"{self.base_url}/metrics: unparseable metrics ({exc})", self.base_url
            ) from None

    async def health(self) -> bool:
        """True when `GET /health` answers 2xx within the timeout; never raises for a sick server."""
        try:
            await self._request("GET", "/health", retry=False, timeout_s=min(self.timeout_s, 10.0))
        except InferenceError:
            return False
        return True

    async def reload_weights(self, path: str, timeout_s: float | None = None) -> None:
        # Not retried: a half-applied reload can leave vLLM broken, so the caller decides what next.
        await self._request(
            "POST",
            "/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}},
            retry=False,
            timeout_s=timeout_s,
        )

    async def pause(self, mode: str = "keep") -> None:
        await self._request("POST", "/pause", params={"mode": mode}, retry=False)

    async def resume(self) -> None:
        await self._request("POST", "/resume", retry=False)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- transport ----------------------------------------------------------------------------

    async def _request(
        self, method: str, path: str, *, retry: bool = True, timeout_s: float | None = None, **kwargs: Any
    ) -> Answer:
        attempts = 1 + (self.max_retries if retry else 0)
        for attempt in range(attempts):
            try:
                return await self._send_once(method, path, timeout_s or self.timeout_s, **kwargs)
            except InferenceError as exc:
                if not exc.retryable or attempt + 1 >= attempts:
                    if attempt:
                        exc.args = (f"{exc.args[0]} (after {attempt + 1} attempts)",)
                    raise
                delay = self._backoff(attempt)
                log.warning("%s; retrying in %.2fs (attempt %d of %d)", exc, delay, attempt + 2, attempts)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    def _backoff(self, attempt: int) -> float:
        # Exponential with "equal jitter": half fixed, half random, so retries of many rollouts
        # that failed together (a server restart) do not hit the server again in lockstep.
        ceiling = self.backoff_s * (2**attempt)
        return ceiling / 2 + random.uniform(0, ceiling / 2)

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0),
                json_serialize=lambda obj: orjson.dumps(obj).decode(),
            )
        return self._session

    async def _send_once(
        self, method: str, path: str, timeout_s: float, json: Any = None, params: dict[str, str] | None = None
    ) -> Answer:
        url = f"{self.base_url}{path}"
        try:
            # One deadline for the whole request, waiting for a pooled connection included, so a
            # trickling server cannot hang a rollout.
            async with self._http().request(
                method, url, json=json, params=params, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as response:
                body = await response.read()
        except TimeoutError as exc:  # aiohttp's own timeouts subclass it
            raise InferenceTimeout(
                f"{method} {url}: no answer within {timeout_s:g}s ({type(exc).__name__})", url
            ) from None
        except aiohttp.ClientConnectorError as exc:
            raise InferenceConnectionError(
                f"{method} {url}: cannot connect ({type(exc).__name__}: {exc})", url, refused=True
            ) from None
        except aiohttp.ClientError as exc:
            raise InferenceConnectionError(
                f"{method} {url}: connection failed ({type(exc).__name__}: {exc})", url
            ) from None
        answer = Answer(url, response.status, body)
        if response.status >= 400:
            text = answer.text[:500]
            raise InferenceHTTPError(f"{method} {url}: HTTP {response.status}: {text}", url, response.status, text)
        return answer
