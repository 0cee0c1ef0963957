"""Async client of one vLLM server: token-in/token-out completions (streamed or whole, over `/v1/completions`
or vLLM's `/inference/v1/generate`) with the policy version that sampled each token, load, health, API keys
and TLS, and weight updates in three modes.

Errors are typed (`InferenceError` and subclasses, in errors.py) so the dispatcher can tell a sick server
from a bad request; transient failures (connection, timeout, HTTP 5xx) are retried with backoff here, and a
completion that fails carries the tokens it had received (`partial`), so it can be continued elsewhere.
This module holds the requests and their transport; what answers say is read in parsing.py, and the weight
updates run in weight_updates.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import ssl
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import aiohttp
import orjson

from beam_rl.inference.errors import (
    InferenceAborted,
    InferenceAuthError,
    InferenceBadResponse,
    InferenceConnectionError,
    InferenceCorruptResponse,
    InferenceError,
    InferenceHTTPError,
    InferenceRetired,
    InferenceTimeout,
    http_error,
)
from beam_rl.inference.inflight import ABORT, UNKNOWN_VERSION, LiveRequest, Progress, UpdateTiming, copy_completion
from beam_rl.inference.parsing import parse_completions, parse_server_load, parse_weight_info
from beam_rl.inference.sse import EventData
from beam_rl.inference.types import Completion, SamplingParams, ServerLoad
from beam_rl.inference.weight_updates import DRAIN_QUIET_S, UpdateMode, WeightUpdates
from beam_rl.listeners import is_loopback

T = TypeVar("T")

# What other modules and plug-ins import from here: the client, its errors (their home is errors.py), the
# load type and the parsers they use, and the update mode's defaults.
__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "DRAIN_QUIET_S",
    "ROUTE_PATHS",
    "Answer",
    "InferenceAborted",
    "InferenceAuthError",
    "InferenceBadResponse",
    "InferenceClient",
    "InferenceConnectionError",
    "InferenceCorruptResponse",
    "InferenceError",
    "InferenceHTTPError",
    "InferenceRetired",
    "InferenceTimeout",
    "Route",
    "ServerLoad",
    "UpdateMode",
    "parse_completions",
    "parse_server_load",
]

log = logging.getLogger(__name__)

# Hundreds of rollouts share one server; aiohttp's default of 100 connections would queue them.
DEFAULT_MAX_CONNECTIONS = 1024
# The most of one answer held in memory (a whole body, or one event of a stream); inference.max_response_mb.
DEFAULT_MAX_RESPONSE_BYTES = 256 << 20


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


# The route completions go to: OpenAI's completions, or vLLM's token-in/token-out generate route (`vllm serve
# --enable-scale-out`), whose answers say which weight label sampled each token (docs/weight-updates.md).
Route = Literal["completions", "generate"]
ROUTE_PATHS: dict[str, str] = {"completions": "/v1/completions", "generate": "/inference/v1/generate"}


LORA_SERVER_HINT = (
    "start vLLM with --enable-lora, --max-lora-rank at least trainer.lora.rank and "
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (the embedded server: --enable-lora)"
)


def _lora_routes_answered(exc: InferenceHTTPError) -> bool:
    """Whether an error came from vLLM's LoRA routes (an OpenAI-style error body) rather than from a server
    that has no such route (FastAPI's {"detail": "Not Found"}, or no JSON at all)."""
    try:
        body = orjson.loads(exc.body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(body, dict) and isinstance(body.get("error"), dict)


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
        stream_interval: int = 1,
        api_key: str | None = None,
        ca_bundle: str | Path | None = None,
        version: int = 0,
        extra_body: dict[str, Any] | None = None,
        route: Route = "completions",
        lora: bool = False,
        vocab_size: int | None = None,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    ) -> None:
        if max_retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ValueError("need max_retries >= 0, timeout_s > 0 and backoff_s >= 0")
        if route not in ROUTE_PATHS:
            raise ValueError(f"route must be one of {sorted(ROUTE_PATHS)}, not {route!r}")
        self.base_url = base_url.rstrip("/")
        self._on_this_machine = is_loopback(urlsplit(self.base_url).hostname or "")
        self.model = model
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_connections = max_connections
        self.stream = stream
        # Streamed tokens come in chunks of this many (vLLM 0.32's per-request `stream_interval`): an event a
        # chunk rather than a token. A keep update on the completions route cannot see where the pause cut a
        # chunk, so it stamps such requests' later tokens unknown (docs/weight-updates.md).
        self.stream_interval = stream_interval
        self.route = route
        self.version = version
        # LoRA: each version is an adapter of its own on the server, which requests name (docs/lora.md).
        self.lora = lora
        self.adapter: str | None = None  # the adapter requests name now; None: the base model, `model`
        self._initial_version = version  # what a server reporting vLLM's first label, "default", holds
        self.extra_body = dict(extra_body or {})  # more sampling fields of every request (vLLM's extras)
        self.tokens_received = 0  # completion tokens that came back from this server, all requests
        # What an answer may hold: token ids below the model's vocabulary size (None: any integer), and
        # this many bytes at once; past either the server is sick (InferenceCorruptResponse).
        self.vocab_size = vocab_size
        self.max_response_bytes = max_response_bytes
        # Kept out of repr, logs and errors: only the header the session sends holds it.
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._ssl: ssl.SSLContext | None = (
            ssl.create_default_context(cafile=str(ca_bundle)) if ca_bundle is not None else None
        )
        # aiohttp rather than httpx: with hundreds of requests in flight, httpx's pool bookkeeping
        # (linear in open connections per request) was most of the dispatcher's CPU (bench/history.md).
        # One per event loop that talks to the server (made on first use, on that loop): the requests' loop,
        # and the loop of its own a paused update runs on (weight_updates.py).
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
        self._live: set[LiveRequest] = set()  # what a weight update restamps
        self._updates = WeightUpdates(self)
        self._retired = asyncio.Event()  # retire(): the server left the fleet

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
        if progress is not None:
            progress.live = choices
        retries = 0
        while True:
            todo = [i for i, c in enumerate(choices) if c.finish_reason in (None, ABORT)]
            if not todo:
                return choices
            try:
                ours = await self._unless_retired(self._generate(prompt_ids, sampling, choices, todo, progress))
                foreign = [i for i in todo if choices[i].finish_reason == ABORT and i not in ours]
                if foreign:
                    raise InferenceAborted(
                        f"{self.base_url}: the server aborted choices {foreign} (not paused by this client)",
                        self.base_url,
                    )
            except InferenceError as exc:
                exc.partial = choices
                if exc.retryable and retries < self.max_retries:
                    delay = self._backoff(retries)
                    retries += 1
                    log.warning(
                        "%s; continuing in %.2fs (attempt %d of %d)", exc, delay, retries + 1, self.max_retries + 1
                    )
                    await asyncio.sleep(delay)
                    continue
                if retries:
                    exc.args = (f"{exc.args[0]} (after {retries + 1} attempts)",)
                raise

    def retire(self) -> None:
        """The server leaves the fleet: every completion in flight here stops and raises InferenceRetired
        with the tokens it had received (continued on another server), and so does every later one."""
        self._retired.set()

    async def _unless_retired(self, work: Coroutine[Any, Any, T]) -> T:
        if not self._retired.is_set():
            task = asyncio.ensure_future(work)
            retired = asyncio.ensure_future(self._retired.wait())
            try:
                await asyncio.wait({task, retired}, return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                task.cancel()
                raise
            finally:
                retired.cancel()
            if task.done():
                return task.result()
            task.cancel()  # its choices keep what arrived: they are the caller's own Completion objects
            await asyncio.gather(task, return_exceptions=True)
        else:
            work.close()
        raise InferenceRetired(f"{self.base_url} left the fleet", self.base_url)

    async def _generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        choices: list[Completion],
        todo: list[int],
        progress: Progress | None,
    ) -> set[int]:
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
                sends.append(
                    (
                        [i],
                        [*prompt_ids, *choices[i].token_ids],
                        dataclasses.replace(sampling, max_tokens=sampling.max_tokens - done, seed=seed),
                    )
                )
        results = await asyncio.gather(
            *(self._send_completion(prompt, params, choices, targets, progress) for targets, prompt, params in sends),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        return {i for r in results if not isinstance(r, BaseException) for i in r}

    async def _send_completion(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        choices: list[Completion],
        targets: list[int],
        progress: Progress | None,
    ) -> set[int]:
        await self._update_finished()  # an update may have begun since _generate looked: no await from here on
        payload = self._payload(prompt_ids, sampling, len(targets))
        updates = self._updates
        # Spans are read only under labels set while the server was paused: during a reload-mode update
        # the label moves while the engine samples, so it cannot say which weights sampled a token.
        # Under LoRA a request samples with the adapter it names from start to end: its version is exact, and the
        # server's labels (one for all adapters) would say less.
        spans = self.route == "generate" and updates.labels_supported and not updates.reloading and not self.lora
        request = LiveRequest(
            [choices[i] for i in targets],
            targets,
            UNKNOWN_VERSION if updates.reloading else self.version,
            self.version,
            self.stream,
            progress,
            self._version_of_label if spans else None,
            url=f"{self.base_url}{ROUTE_PATHS[self.route]}",
            vocab_size=self.vocab_size,
        )
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
            # which the dispatcher then parses (its JSON is 36% smaller with 0; bench/history.md).
            "logprobs": 0,
            "skip_special_tokens": False,
            "stop_token_ids": list(sampling.stop_token_ids),
        }
        if sampling.seed is not None:
            params["seed"] = sampling.seed
        if self.stream and self.stream_interval > 1:
            params["stream_interval"] = self.stream_interval  # a SamplingParams field: in sampling_params on generate
        # New weights must not reuse KV blocks the old ones computed: the prefix cache is salted per policy
        # version (a request sent during a reload-mode update shares the old one's).
        salt = f"policy-v{self.version}"
        params.update(self.extra_body)
        model = self.adapter or self.model
        payload: dict[str, Any]
        if self.route == "generate":
            payload = {"model": model, "token_ids": prompt_ids, "sampling_params": params, "cache_salt": salt}
        else:
            payload = {"model": model, "prompt": prompt_ids, **params, "return_token_ids": True, "cache_salt": salt}
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
            async with self._http().post(
                url, json=payload, headers=self._headers, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            ) as response:
                if response.status >= 400:
                    raise http_error("POST", url, response.status, await self._read_capped(response, "POST", url))
                events = EventData()
                request.body, request.body_taken = response.content, 0
                async for block in response.content.iter_any():
                    request.took(block)
                    found = events.feed(block)
                    if events.pending > self.max_response_bytes:
                        raise self._too_large("POST", url, "an event of its stream")
                    for data in found:
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
                f"POST {url}: not finished within {self.timeout_s:g}s ({type(exc).__name__})", url
            ) from None
        except aiohttp.ClientConnectorError as exc:
            raise InferenceConnectionError(
                f"POST {url}: cannot connect ({type(exc).__name__}: {exc})", url, refused=True
            ) from None
        except aiohttp.ClientError as exc:
            raise InferenceConnectionError(
                f"POST {url}: connection failed mid-stream ({type(exc).__name__}: {exc})", url
            ) from None
        finally:
            request.body = None  # read no more: nothing of it is waited for
        if not ended:
            raise InferenceConnectionError(f"POST {url}: the stream ended without [DONE]", url)
        for choice in request.choices:
            # vLLM streams nothing for a choice aborted before its first token: it ended, like any abort.
            if choice.finish_reason is None:
                choice.finish_reason = ABORT

    # -- weight updates ----------------------------------------------------------------------------
    # The modes run in weight_updates.py (`WeightUpdates`); the server routes they drive stay here.

    async def update_weights(
        self,
        path: str | Path,
        version: int,
        mode: UpdateMode = "keep",
        *,
        drain_quiet_s: float = DRAIN_QUIET_S,
        timeout_s: float | None = None,
    ) -> UpdateTiming:
        """Have the server load the checkpoint at `path` as policy `version` (docs/weight-updates.md):
        "reload" loads while requests run; "keep" pauses them frozen, loads, resumes; "continue" aborts
        them (each keeps its tokens), loads, and `complete` continues them under the new weights. Not
        retried: a half-applied load can leave vLLM broken, so the caller decides what next."""
        return await self._updates.run(path, version, mode, drain_quiet_s, timeout_s)

    async def _update_finished(self) -> None:
        """Hold a request back while a keep or continue update holds the server."""
        await self._updates.finished()

    async def reload_weights(self, path: str, timeout_s: float | None = None) -> None:
        # Not retried: a half-applied reload can leave vLLM broken, so the caller decides what next.
        await self._request(
            "POST",
            "/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}},
            retry=False,
            timeout_s=timeout_s,
        )

    async def load_lora_adapter(self, name: str, path: str, timeout_s: float | None = None) -> None:
        """vLLM's `/v1/load_lora_adapter`; a name the server holds already (a retried load) counts as loaded.
        InferenceError naming the server when it serves no LoRA routes."""
        try:
            await self._request(
                "POST",
                "/v1/load_lora_adapter",
                json={"lora_name": name, "lora_path": str(path)},
                retry=False,
                timeout_s=timeout_s,
            )
        except InferenceHTTPError as exc:
            if exc.status == 400 and "already been loaded" in exc.body:
                return
            if not _lora_routes_answered(exc):
                raise InferenceError(
                    f"{self.base_url} serves no LoRA adapters (HTTP {exc.status} from "
                    f"/v1/load_lora_adapter): {LORA_SERVER_HINT}",
                    self.base_url,
                ) from None
            raise

    async def unload_lora_adapter(self, name: str) -> None:
        """vLLM's `/v1/unload_lora_adapter`; one the server no longer holds (it restarted) is gone already."""
        try:
            await self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": name}, retry=False)
        except InferenceHTTPError as exc:
            if exc.status != 404 or not _lora_routes_answered(exc):
                raise

    async def serves_lora(self) -> bool:
        """Whether the server serves vLLM's runtime LoRA routes: asked to unload an adapter it does not hold, such
        a server says so in vLLM's error body, where one without them has no such route. InferenceError when
        it cannot be asked."""
        try:
            await self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": "beam-rl-probe"}, retry=False)
        except InferenceHTTPError as exc:
            if exc.status >= 500 or isinstance(exc, InferenceAuthError):
                raise
            return _lora_routes_answered(exc)
        return True

    async def weight_version(self) -> str:
        """The weight version the server reports (vLLM's `GET /weight_info`; "default" until one is set)."""
        answer = await self._request("GET", "/weight_info", retry=False, timeout_s=min(self.timeout_s, 10.0))
        return parse_weight_info(answer.text, self.base_url)

    async def restarted(self) -> bool:
        """True when the server reports weights other than the version this client last loaded into it:
        it restarted since and serves its initial weights. False when it reports them, or cannot say (no
        update yet, one under way, a server without the route); raises InferenceError if unreachable."""
        expected = self._updates.labelled  # None from the start of an update until its label is set
        if expected is None:
            return False
        served = await self.weight_version()
        # An update that started meanwhile relabels the server: only a check it did not overlap counts.
        return self._updates.labelled == expected and served != str(expected)

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
            raise InferenceBadResponse(f"{self.base_url}/metrics: unparseable metrics ({exc})", self.base_url) from None

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

    async def served_models(self) -> list[str]:
        """The model names `GET /v1/models` lists."""
        answer = await self._request("GET", "/v1/models", retry=False, timeout_s=min(self.timeout_s, 30.0))
        try:
            return [str(card["id"]) for card in answer.json()["data"]]
        except (ValueError, KeyError, TypeError) as err:
            raise InferenceError(
                f"GET {answer.url}: not a model list ({type(err).__name__}: {err})", self.base_url
            ) from None

    async def served_context(self) -> int | None:
        """The context window `GET /v1/models` reports for the served model (vLLM's `max_model_len`: the
        card named as this client's model, else the first); None when it reports none."""
        answer = await self._request("GET", "/v1/models", retry=False, timeout_s=min(self.timeout_s, 30.0))
        try:
            cards = [card for card in answer.json()["data"] if isinstance(card, dict)]
        except (ValueError, KeyError, TypeError):
            return None
        card = next((c for c in cards if c.get("id") == self.model), cards[0] if cards else {})
        context = card.get("max_model_len")
        return context if isinstance(context, int) and not isinstance(context, bool) else None

    async def tokenize(self, text: str) -> list[int] | None:
        """The token ids the server's tokenizer makes of `text` (vLLM's `POST /tokenize`, no special
        tokens); None when the server has no such route."""
        payload = {"model": self.model, "prompt": text, "add_special_tokens": False}
        try:
            answer = await self._request(
                "POST", "/tokenize", json=payload, retry=False, timeout_s=min(self.timeout_s, 30.0)
            )
        except InferenceHTTPError as err:
            if err.status in (404, 405):
                return None
            raise
        try:
            return [int(t) for t in answer.json()["tokens"]]
        except (ValueError, KeyError, TypeError) as err:
            raise InferenceError(
                f"POST {answer.url}: not a tokenization ({type(err).__name__}: {err})", self.base_url
            ) from None

    async def check_generate_route(self) -> None:
        """One token from `/inference/v1/generate`: InferenceHTTPError (403 or 404) when the server does not
        serve it (vLLM without `--enable-scale-out`, or older than 0.32)."""
        payload = {"model": self.model, "token_ids": [0], "sampling_params": {"max_tokens": 1, "logprobs": 0}}
        await self._request(
            "POST", ROUTE_PATHS["generate"], json=payload, retry=False, timeout_s=min(self.timeout_s, 30.0)
        )

    async def aclose(self) -> None:
        self._updates.close()  # the pause's loop, and its session
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
                connector=aiohttp.TCPConnector(
                    limit=self.max_connections, limit_per_host=0, ssl=self._ssl if self._ssl is not None else True
                ),
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
                method,
                url,
                json=json,
                params=params,
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as response:
                body = await self._read_capped(response, method, url)
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
            raise http_error(method, url, response.status, body)
        return Answer(url, response.status, body)

    async def _read_capped(self, response: aiohttp.ClientResponse, method: str, url: str) -> bytes:
        """The body, or InferenceCorruptResponse as soon as it passes `max_response_bytes` (a declared length
        past it is refused unread): a server cannot make the dispatcher hold more. aiohttp stops reading the
        socket while a block waits here (read_bufsize), so no more than one block past the cap is in memory."""
        if (response.content_length or 0) > self.max_response_bytes:
            raise self._too_large(method, url, f"a body of {response.content_length} bytes")
        blocks, size = [], 0
        async for block in response.content.iter_any():
            size += len(block)
            if size > self.max_response_bytes:
                raise self._too_large(method, url, "a body")
            blocks.append(block)
        return b"".join(blocks)

    def _too_large(self, method: str, url: str, what: str) -> InferenceCorruptResponse:
        return InferenceCorruptResponse(
            f"{method} {url}: {what} larger than inference.max_response_mb ({self.max_response_bytes / 2**20:g} MiB);"
            " refused",
            url,
        )
