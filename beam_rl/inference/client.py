"""Async client of one vLLM server: token-in/token-out completions (streamed or whole, over `/v1/completions`
or vLLM's `/inference/v1/generate`) with the policy version that sampled each token, load, health, API keys
and TLS, and weight updates in three modes.

Errors are typed (`InferenceError` and subclasses) so the dispatcher can tell a sick server from a
bad request; transient failures (connection, timeout, HTTP 5xx) are retried with backoff here, and a
completion that fails carries the tokens it had received (`partial`), so it can be continued elsewhere.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import ipaddress
import logging
import math
import random
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from beam_rl.inference.inflight import ABORT, UNKNOWN_VERSION, LiveRequest, Progress, UpdateTiming, copy_completion
from beam_rl.inference.sse import EventData
from beam_rl.inference.types import Completion, SamplingParams
from beam_rl.loop_thread import LoopThread

log = logging.getLogger(__name__)

# Hundreds of rollouts share one server; aiohttp's default of 100 connections would queue them.
DEFAULT_MAX_CONNECTIONS = 1024
# How long no stream may receive a token before a keep pause counts them drained. A server answers the pause
# once it has sent what was sampled before it (vLLM waits 20 ms for its output tasks first), so this covers
# only what is on its way (docs/weight-updates.md).
DRAIN_QUIET_S = 0.005


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
        #: The choices of a failed completion as far as they came (tokens, logprobs, versions), set by
        #: `InferenceClient.complete`; None when nothing was asked or nothing can be kept.
        self.partial: list[Completion] | None = None


class InferenceHTTPError(InferenceError):
    """The server answered with a non-2xx status (5xx retryable, 4xx not)."""

    def __init__(self, message: str, url: str, status: int, body: str = "") -> None:
        super().__init__(message, url)
        self.status = status
        self.body = body
        # 503 is what a paused vLLM answers: it is transient, so retry it like any 5xx.
        self.retryable = self.server_fault = status >= 500


class InferenceAuthError(InferenceHTTPError):
    """HTTP 401 or 403: the server wants an API key this client does not have, or refuses the one it has.
    Never retried: the same key will not work the next time."""


class InferenceAborted(InferenceError):
    """The server ended the request with finish_reason "abort" without this client having paused it for a
    weight update (another client paused it, or it is shutting down): continued from its tokens."""

    retryable = True


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


UpdateMode = Literal["reload", "keep", "continue"]
# The route completions go to: OpenAI's completions, or vLLM's token-in/token-out generate route (`vllm serve
# --enable-scale-out`), whose answers say which weight label sampled each token (docs/weight-updates.md).
Route = Literal["completions", "generate"]
ROUTE_PATHS: dict[str, str] = {"completions": "/v1/completions", "generate": "/inference/v1/generate"}


def _is_loopback(url: str) -> bool:
    """Whether `url` names a server on this machine (localhost, 127.0.0.0/8, ::1)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class InferenceClient:
    """One vLLM server. Implements `CompletionClient`; safe to share among hundreds of rollouts.

    `version` is the policy version the server holds as far as this client loaded it (`update_weights`);
    every token it receives is stamped with the version that sampled it, or UNKNOWN_VERSION where that
    cannot be seen from outside (docs/weight-updates.md).
    """

    def __init__(
        self,
        base_url: str,
        model: str = "default",
        timeout_s: float = 60.0,
        max_retries: int = 2,
        backoff_s: float = 0.2,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        *,
        stream: bool = False,
        api_key: str | None = None,
        ca_bundle: str | Path | None = None,
        version: int = 0,
        extra_body: dict[str, Any] | None = None,
        route: Route = "completions",
    ) -> None:
        if max_retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ValueError("need max_retries >= 0, timeout_s > 0 and backoff_s >= 0")
        if route not in ROUTE_PATHS:
            raise ValueError(f"route must be one of {sorted(ROUTE_PATHS)}, not {route!r}")
        self.base_url = base_url.rstrip("/")
        self._on_this_machine = _is_loopback(self.base_url)
        self.model = model
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_connections = max_connections
        self.stream = stream
        self.route = route
        self.version = version
        self._initial_version = version  # what a server reporting vLLM's first label, "default", holds
        self.extra_body = dict(extra_body or {})  # more sampling fields of every request (vLLM's extras)
        self.tokens_received = 0  # completion tokens that came back from this server, all requests
        # Kept out of repr, logs and errors: only the header the session sends holds it.
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._ssl: ssl.SSLContext | None = (
            ssl.create_default_context(cafile=str(ca_bundle)) if ca_bundle is not None else None)
        # aiohttp rather than httpx: with hundreds of requests in flight, httpx's pool bookkeeping
        # (linear in open connections per request) was most of the dispatcher's CPU (bench/README.md).
        # One per event loop that talks to the server (made on first use, on that loop): the requests' loop,
        # and the loop of its own a paused update runs on (`_paused_update`).
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
        self._pause_loop: LoopThread | None = None
        self._live: set[LiveRequest] = set()
        self._update_lock: asyncio.Lock | None = None
        # Set once the keep/continue update holding the server is over; None when there is none. No request
        # is sent meanwhile: it would only queue, and must carry the new version's cache salt.
        self._update_over: asyncio.Event | None = None
        self._reloading = 0  # reload-mode updates in flight: requests sent meanwhile get unknown versions
        # The version this client last loaded and told the server to report (vLLM's /update_weight_version):
        # a server that reports another has restarted since, on its initial weights. None: nothing to check
        # (no update yet, or a server without the route).
        self._labelled: int | None = None
        self._labels_supported = True

    def __repr__(self) -> str:
        return f"InferenceClient({self.base_url!r}, model={self.model!r})"

    # -- completions -----------------------------------------------------------------------------

    async def complete(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        n: int = 1,
        *,
        partial: list[Completion] | None = None,
        progress: Progress | None = None,
    ) -> list[Completion]:
        """`n` completions of `prompt_ids`; with `partial` (the `partial` of an earlier failure, here or on
        another server), each unfinished choice is continued from its tokens as prompt + tokens so far.

        Transient failures are retried here, continuing from what arrived; a failure that remains is raised
        with `partial` set. `progress` is updated as tokens arrive."""
        choices = [copy_completion(c) for c in partial] if partial else [Completion([], [], None) for _ in range(n)]
        if len(choices) != n:
            raise ValueError(f"partial holds {len(choices)} choices for n={n}")
        retries = 0
        while True:
            todo = [i for i, c in enumerate(choices) if c.finish_reason in (None, ABORT)]
            if not todo:
                return choices
            try:
                ours = await self._generate(prompt_ids, sampling, choices, todo, progress)
                foreign = [i for i in todo if choices[i].finish_reason == ABORT and i not in ours]
                if foreign:
                    raise InferenceAborted(f"{self.base_url}: the server aborted choices {foreign} "
                                           "(not paused by this client)", self.base_url)
            except InferenceError as exc:
                exc.partial = choices
                if exc.retryable and retries < self.max_retries:
                    delay = self._backoff(retries)
                    retries += 1
                    log.warning("%s; continuing in %.2fs (attempt %d of %d)", exc, delay, retries + 1,
                                self.max_retries + 1)
                    await asyncio.sleep(delay)
                    continue
                if retries:
                    exc.args = (f"{exc.args[0]} (after {retries + 1} attempts)",)
                raise

    async def _generate(self, prompt_ids: list[int], sampling: SamplingParams, choices: list[Completion],
                        todo: list[int], progress: Progress | None) -> set[int]:
        """Send what `todo`'s choices still need: one request for them all when none has a token yet (the
        n choices share one prefill), else one per choice, continuing it. Returns the choices this
        client's own continue-mode update aborted (continued after it)."""
        await self._update_finished()
        if len(todo) == len(choices) and not any(choices[i].token_ids for i in todo):
            sends = [(todo, list(prompt_ids), sampling)]
        else:
            sends = []
            for i in todo:
                done = len(choices[i].token_ids)
                if done >= sampling.max_tokens:
                    choices[i].finish_reason = "length"
                    continue
                seed = None if sampling.seed is None else sampling.seed + (i if len(choices) > 1 else 0)
                sends.append(([i], [*prompt_ids, *choices[i].token_ids],
                              dataclasses.replace(sampling, max_tokens=sampling.max_tokens - done, seed=seed)))
        results = await asyncio.gather(*(self._send_completion(prompt, params, choices, targets, progress)
                                         for targets, prompt, params in sends), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        return {i for r in results for i in r}

    async def _send_completion(self, prompt_ids: list[int], sampling: SamplingParams, choices: list[Completion],
                               targets: list[int], progress: Progress | None) -> set[int]:
        await self._update_finished()  # an update may have begun since _generate looked: no await from here on
        payload = self._payload(prompt_ids, sampling, len(targets))
        # Spans are read only under labels set while the server was paused: during a reload-mode update
        # the label moves while the engine samples, so it cannot say which weights sampled a token.
        spans = self.route == "generate" and self._labels_supported and not self._reloading
        request = LiveRequest([choices[i] for i in targets], targets,
                              UNKNOWN_VERSION if self._reloading else self.version, self.version,
                              self.stream, progress, self._version_of_label if spans else None)
        self._live.add(request)
        before = sum(len(c.token_ids) for c in request.choices)
        try:
            if self.stream:
                await self._read_stream(payload, request)
            elif self.route == "generate":
                answer = await self._send_once("POST", ROUTE_PATHS["generate"], self.timeout_s, json=payload)
                self._read_generated(answer, request)
            else:
                answer = await self._send_once("POST", ROUTE_PATHS["completions"], self.timeout_s, json=payload)
                for index, c in enumerate(parse_completions(answer.json(), answer.url, len(targets))):
                    request.add(index, c.token_ids, c.logprobs, c.finish_reason)
        finally:
            self._live.discard(request)
            self.tokens_received += sum(len(c.token_ids) for c in request.choices) - before
        if not request.aborted_by_us:
            return set()
        request.settle_aborted()
        return {t for t, c in zip(targets, request.choices) if c.finish_reason == ABORT}

    def _payload(self, prompt_ids: list[int], sampling: SamplingParams, n: int) -> dict[str, Any]:
        params: dict[str, Any] = {
            "n": n,
            "max_tokens": sampling.max_tokens,  # vLLM's default is 16: always say it
            "temperature": sampling.temperature,
            # The sampled tokens' logprobs only: 1 would add an alternative per token to the answer,
            # which the dispatcher then parses (its JSON is 36% smaller with 0; bench/README.md).
            "logprobs": 0,
            "skip_special_tokens": False,
            "stop_token_ids": list(sampling.stop_token_ids),
        }
        if sampling.seed is not None:
            params["seed"] = sampling.seed
        # New weights must not reuse KV blocks the old ones computed: the prefix cache is salted per policy
        # version (a request sent during a reload-mode update shares the old one's).
        salt = f"policy-v{self.version}"
        params.update(self.extra_body)
        if self.route == "generate":
            payload = {"model": self.model, "token_ids": prompt_ids, "sampling_params": params, "cache_salt": salt}
        else:
            payload = {"model": self.model, "prompt": prompt_ids, **params, "return_token_ids": True,
                       "cache_salt": salt}
        if self.stream:
            payload["stream"] = True
        return payload

    def _read_generated(self, answer: Answer, request: LiveRequest) -> None:
        def bad(reason: str) -> InferenceBadResponse:
            return InferenceBadResponse(f"{answer.url}: bad generate response: {reason}", answer.url)

        body = answer.json()
        request.add_chunk(body, bad)
        if len(body["choices"]) != len(request.choices):
            raise bad(f"asked for n={len(request.choices)} choices, got {len(body['choices'])}")

    def _version_of_label(self, label: str) -> int:
        """The policy version a weight label names: the client labels each update with its version, and a
        server holds the weights it started with until the first label."""
        if label == "default":
            return self._initial_version
        return int(label) if label.isdecimal() else UNKNOWN_VERSION

    async def _read_stream(self, payload: dict[str, Any], request: LiveRequest) -> None:
        url = f"{self.base_url}{ROUTE_PATHS[self.route]}"

        def bad(reason: str) -> InferenceBadResponse:
            return InferenceBadResponse(f"{url}: bad {self.route} stream: {reason}", url)

        ended = False
        try:
            async with self._http().post(url, json=payload, headers=self._headers,
                                         timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as response:
                if response.status >= 400:
                    raise _http_error("POST", url, response.status, await response.read())
                events = EventData()
                request.body, request.body_taken = response.content, 0
                async for block in response.content.iter_any():
                    request.took(block)
                    for data in events.feed(block):
                        if data == b"[DONE]":
                            ended = True
                            break
                        try:
                            chunk = orjson.loads(data)
                        except orjson.JSONDecodeError as exc:
                            raise bad(f"a chunk is not JSON ({exc})") from None
                        request.add_chunk(chunk, bad)
                    if ended:
                        break
        except TimeoutError as exc:  # aiohttp's own timeouts subclass it
            raise InferenceTimeout(
                f"POST {url}: not finished within {self.timeout_s:g}s ({type(exc).__name__})", url) from None
        except aiohttp.ClientConnectorError as exc:
            raise InferenceConnectionError(f"POST {url}: cannot connect ({type(exc).__name__}: {exc})", url,
                                           refused=True) from None
        except aiohttp.ClientError as exc:
            raise InferenceConnectionError(
                f"POST {url}: connection failed mid-stream ({type(exc).__name__}: {exc})", url) from None
        finally:
            request.body = None  # read no more: nothing of it is waited for
        if not ended:
            raise InferenceConnectionError(f"POST {url}: the stream ended without [DONE]", url)
        for choice in request.choices:
            # vLLM streams nothing for a choice aborted before its first token: it ended, like any abort.
            if choice.finish_reason is None:
                choice.finish_reason = ABORT

    # -- weight updates ----------------------------------------------------------------------------

    async def update_weights(self, path: str | Path, version: int, mode: UpdateMode = "keep", *,
                             drain_quiet_s: float = DRAIN_QUIET_S, timeout_s: float | None = None) -> UpdateTiming:
        """Have the server load the checkpoint at `path` as policy `version` (docs/weight-updates.md):
        "reload" loads while requests run; "keep" pauses them frozen, loads, resumes; "continue" aborts
        them (each keeps its tokens), loads, and `complete` continues them under the new weights. Not
        retried: a half-applied load can leave vLLM broken, so the caller decides what next."""
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        if mode not in ("reload", "keep", "continue"):
            raise ValueError(f"update mode must be reload, keep or continue, not {mode!r}")
        async with self._update_lock:
            self._labelled = None
            try:
                if mode == "reload":
                    timing = await self._reload_while_running(path, version, timeout_s)
                else:
                    timing = await self._paused_update(path, version, mode, drain_quiet_s, timeout_s)
                if self._labelled != version:
                    await self._label_weights(version)  # after the resume: the engine need not wait for it
                return timing
            finally:
                if not self._labels_supported:
                    for request in self._live:
                        request.label_version = None  # its spans name none of our versions

    async def _reload_while_running(self, path: str | Path, version: int, timeout_s: float | None) -> UpdateTiming:
        # Nothing marks the step at which the server switched: a token arriving from now on may come from
        # either side of it, so running requests and those sent meanwhile stamp it unknown.
        self._reloading += 1
        for request in self._live:
            request.version = UNKNOWN_VERSION
            request.label_version = None  # the label moves after the load, not with it: its spans would be wrong
        try:
            reload_s = await self._timed_reload(path, timeout_s)
        finally:
            self._reloading -= 1
        self.version = version
        return UpdateTiming(self.base_url, "reload", version, 0.0, reload_s)

    async def _paused_update(self, path: str | Path, version: int, mode: str, drain_quiet_s: float,
                             timeout_s: float | None) -> UpdateTiming:
        self._update_over = asyncio.Event()
        try:
            # On the generate route the server labels every token with the label current when it was sampled:
            # set while nothing samples, it moves exactly with the load, so no stream need drain.
            labelled = self.route == "generate" and self._labels_supported
            for request in self._live:
                request.updates_lived += 1
                if mode == "continue":
                    request.aborted_by_us = True  # the pause ends each running request with its tokens so far
                if labelled:
                    request.version = UNKNOWN_VERSION  # from either side of the pause, until its spans say
                elif mode == "keep" and not request.streamed:
                    request.version = UNKNOWN_VERSION  # its tokens arrive all at once: no boundary to see
            paused_s, reload_s = await self._pause_elsewhere(path, version, mode, labelled, drain_quiet_s, timeout_s)
        finally:
            self._update_over.set()
            self._update_over = None
        return UpdateTiming(self.base_url, mode, version, paused_s, reload_s)

    async def _pause_elsewhere(self, path: str | Path, version: int, mode: str, labelled: bool, drain_quiet_s: float,
                               timeout_s: float | None) -> tuple[float, float]:
        """Run the pause, the load and the resume on a loop of their own. The loop this is called on runs every
        request's stream and can be busy for a large part of a second (an abort pause, a dead server's
        requests): a pause whose answers waited behind it would keep the server paused that long.

        What requests in flight receive is stamped anew just before the resume. In keep mode that waits for
        the streams to drain here (`_check_drained`, from the pause on, while the weights load). In continue
        mode a request the pause cut, or one that had a token by then, is settled when it ends
        (`LiveRequest.settle_aborted`);
        answers that are not streamed have no token before they end, so the resume waits for this loop to
        read those waiting once the load is over. On the generate route the spans say which tokens came
        before, and nothing waits for this loop."""
        requests_loop = asyncio.get_running_loop()
        drains = mode == "keep" and not labelled
        drained: concurrent.futures.Future = concurrent.futures.Future()
        caught_up: Callable[[], concurrent.futures.Future] | None = None
        if drains:
            def caught_up() -> concurrent.futures.Future:
                return drained
        elif mode == "continue" and not labelled and not self.stream:
            def caught_up() -> concurrent.futures.Future:
                return asyncio.run_coroutine_threadsafe(asyncio.sleep(0), requests_loop)

        def on_paused() -> None:
            if drains:
                # The quiet is a margin for a network, where bytes sent on other connections before the answer
                # may still be on their way; a server on this machine has put them in our sockets already.
                quiet_s = 0.0 if self._on_this_machine else drain_quiet_s
                paused_at = time.monotonic()
                requests_loop.call_soon_threadsafe(self._check_drained, drained, quiet_s, paused_at,
                                                   paused_at + max(1.0, 50 * drain_quiet_s))

        over = self._update_over
        assert over is not None  # set by _paused_update

        def on_resumed() -> None:  # requests held back go out now, not a few passes of the requests' loop later
            with contextlib.suppress(RuntimeError):  # that loop has closed: nothing waits
                requests_loop.call_soon_threadsafe(over.set)

        work = asyncio.wrap_future(self._paused_loop().submit(self._pause_load_and_resume(
            path, version, "abort" if mode == "continue" else "keep", labelled, timeout_s, on_paused, on_resumed,
            caught_up, streams_drained=drains)))
        try:
            return await asyncio.shield(work)  # begun, an update runs to its resume even if this task is cancelled
        finally:
            drained.cancel()  # if still waited for (this task was cancelled), the resume goes out at once

    async def _pause_load_and_resume(self, path: str | Path, version: int, pause_mode: str, labelled: bool,
                                     timeout_s: float | None, on_paused: Callable[[], object],
                                     on_resumed: Callable[[], object],
                                     caught_up: Callable[[], concurrent.futures.Future] | None,
                                     streams_drained: bool) -> tuple[float, float]:
        """On the pause's loop: pause; load (and label, `labelled`); once the requests' loop has `caught_up`,
        stamp what requests in flight receive next (the new version's after a drain, else unknown); resume,
        and release the requests held back meanwhile (`on_resumed`).
        Returns the seconds from the pause call to the resume's answer, and the load's."""
        started = time.monotonic()
        try:
            await self.pause(pause_mode)
            on_paused()
            if labelled:
                reload_s = await self._load_and_label(path, version, timeout_s)
            else:
                reload_s = await self._timed_reload(path, timeout_s)
            if caught_up is not None:
                await asyncio.wrap_future(caught_up())
            # The server samples nothing until it resumes: every token sampled from here on is the new version's.
            self.version = version
            for request in list(self._live):  # a copy: the requests' loop starts and ends requests meanwhile
                request.resuming(self._version_after_update(request, drained=streams_drained))
        finally:
            await self.resume()
        on_resumed()
        return time.monotonic() - started, reload_s

    def _paused_loop(self) -> LoopThread:
        if self._pause_loop is None:
            self._pause_loop = LoopThread(f"beam-rl-pause {self.base_url}")
            self._pause_loop.at_close(self._close_session)
        return self._pause_loop

    def _version_after_update(self, request: LiveRequest, drained: bool) -> int:
        """The version to stamp on what a request in flight across a keep or continue update receives next."""
        if request.label_version is not None:
            return UNKNOWN_VERSION  # until its spans come: a token arriving now may have been sampled before
        if request.version == UNKNOWN_VERSION or not drained:
            # Without a drain, what arrives now may still be from before the pause: the tail of a stream
            # the pause aborted, or of one it froze.
            return UNKNOWN_VERSION
        return self.version  # every stream drained: what arrives now comes from the new weights

    def _check_drained(self, drained: concurrent.futures.Future, quiet_s: float, paused_at: float,
                       deadline: float, read_since: bool = False) -> None:
        """On the requests' loop, as a plain callback (a task would wait a loop pass more at every step). The
        server answered the pause at `paused_at` having sent every token the engine sampled before it. A pass
        of the loop reads its sockets, then runs its due timers; what a read brings, each stream's reader
        takes in the next pass. The drain ends at a timer set once the streams had been quiet for `quiet_s`
        since the answer (`read_since`: the pass it runs in read the sockets after that), if they still are
        and none holds bytes read but not yet taken. A stream still busy at `deadline` gets unknown versions."""
        if drained.done():
            return
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        streams = [r for r in self._live if r.streamed and r.version != UNKNOWN_VERSION]
        latest = max((r.last_data_at for r in streams), default=paused_at)
        wait = max(latest, paused_at) + quiet_s - now
        if now < deadline:
            if wait > 0:
                loop.call_later(wait, self._check_drained, drained, quiet_s, paused_at, deadline)
                return
            if any(r.untaken_bytes for r in streams):
                loop.call_soon(self._check_drained, drained, quiet_s, paused_at, deadline)  # after the readers
                return
            if not read_since:
                loop.call_later(0, self._check_drained, drained, quiet_s, paused_at, deadline, True)
                return
        else:
            busy = [r for r in streams if r.last_data_at + quiet_s > now or r.untaken_bytes]
            if busy:
                log.warning("%s: %d streams still received tokens while paused; their versions are unknown",
                            self.base_url, len(busy))
            for request in busy:
                request.version = UNKNOWN_VERSION
        drained.set_result(None)

    async def _timed_reload(self, path: str | Path, timeout_s: float | None) -> float:
        started = time.monotonic()
        await self.reload_weights(str(path), timeout_s)
        return time.monotonic() - started

    async def _load_and_label(self, path: str | Path, version: int, timeout_s: float | None) -> float:
        """Load and label at once, while paused: nothing samples, so either may land first. A load that
        fails gives the old weights their label back before the resume."""
        loaded, labelled = await asyncio.gather(self._timed_reload(path, timeout_s), self._label_weights(version),
                                                return_exceptions=True)
        if isinstance(loaded, BaseException):
            if not isinstance(labelled, BaseException):
                with contextlib.suppress(InferenceError):
                    await self._label_weights(self.version)
            raise loaded
        if isinstance(labelled, BaseException):
            raise labelled
        return loaded

    async def _update_finished(self) -> None:
        while (over := self._update_over) is not None and not over.is_set():  # set at the resume's answer
            await over.wait()

    async def reload_weights(self, path: str, timeout_s: float | None = None) -> None:
        # Not retried: a half-applied reload can leave vLLM broken, so the caller decides what next.
        await self._request(
            "POST",
            "/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}},
            retry=False,
            timeout_s=timeout_s,
        )

    async def _label_weights(self, version: int) -> None:
        if not self._labels_supported:
            return
        try:
            await self._request("POST", "/update_weight_version", json={"new_version": str(version)}, retry=False)
        except InferenceHTTPError as exc:
            if exc.status not in (404, 405):
                raise
            self._labels_supported = False  # a server without vLLM's RL routes: restarts go unnoticed
            log.warning("%s has no /update_weight_version: a restart between updates will not be noticed",
                        self.base_url)
            return
        self._labelled = version

    async def weight_version(self) -> str:
        """The weight version the server reports (vLLM's `GET /weight_info`; "default" until one is set)."""
        answer = await self._request("GET", "/weight_info", retry=False, timeout_s=min(self.timeout_s, 10.0))
        try:
            return str(orjson.loads(answer.text)["weight_version"])
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            raise InferenceBadResponse(f"{self.base_url}/weight_info: unexpected answer ({exc})",
                                       self.base_url) from None

    async def restarted(self) -> bool:
        """True when the server reports weights other than the version this client last loaded into it:
        it restarted since and serves its initial weights. False when it reports them, or cannot say (no
        update yet, one under way, a server without the route); raises InferenceError if unreachable."""
        expected = self._labelled  # None from the start of an update until its label is set
        if expected is None:
            return False
        served = await self.weight_version()
        # An update that started meanwhile relabels the server: only a check it did not overlap counts.
        return self._labelled == expected and served != str(expected)

    async def pause(self, mode: str = "keep") -> None:
        await self._request("POST", "/pause", params={"mode": mode}, retry=False)

    async def resume(self) -> None:
        await self._request("POST", "/resume", retry=False)

    # -- load, health, access --------------------------------------------------------------------

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

    async def check_access(self) -> None:
        """`GET /v1/models`, a route vLLM guards with its API key: InferenceAuthError when the server wants
        a key this client lacks or refuses the one it has; InferenceError when it cannot be reached."""
        await self._request("GET", "/v1/models", retry=False, timeout_s=min(self.timeout_s, 30.0))

    async def check_generate_route(self) -> None:
        """One token from `/inference/v1/generate`: InferenceHTTPError (403 or 404) when the server does not
        serve it (vLLM without `--enable-scale-out`, or older than 0.32)."""
        payload = {"model": self.model, "token_ids": [0], "sampling_params": {"max_tokens": 1, "logprobs": 0}}
        await self._request("POST", ROUTE_PATHS["generate"], json=payload, retry=False,
                            timeout_s=min(self.timeout_s, 30.0))

    async def aclose(self) -> None:
        if self._pause_loop is not None:
            self._pause_loop.close()  # closes its session first
            self._pause_loop = None
        await self._close_session()

    async def _close_session(self) -> None:
        """Close the session of the loop this runs on."""
        session = self._sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session.close()

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
        loop = asyncio.get_running_loop()
        if loop not in self._sessions:
            self._sessions[loop] = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0,
                                               ssl=self._ssl if self._ssl is not None else True),
                json_serialize=lambda obj: orjson.dumps(obj).decode(),
                # A stream's lines are read whole; an aborted choice may send many tokens in one chunk.
                read_bufsize=1 << 20,
            )
        return self._sessions[loop]

    async def _send_once(
        self, method: str, path: str, timeout_s: float, json: Any = None, params: dict[str, str] | None = None
    ) -> Answer:
        url = f"{self.base_url}{path}"
        try:
            # One deadline for the whole request, waiting for a pooled connection included, so a
            # trickling server cannot hang a rollout.
            async with self._http().request(
                method, url, json=json, params=params, headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s)
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
        if response.status >= 400:
            raise _http_error(method, url, response.status, body)
        return Answer(url, response.status, body)


def _http_error(method: str, url: str, status: int, body: bytes) -> InferenceHTTPError:
    text = body.decode("utf-8", errors="replace")[:500]
    if status in (401, 403):
        return InferenceAuthError(f"{method} {url}: HTTP {status}: the server refuses this client's API key "
                                  f"(or wants one): {text}", url, status, text)
    return InferenceHTTPError(f"{method} {url}: HTTP {status}: {text}", url, status, text)
