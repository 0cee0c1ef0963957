"""An embedded stand-in for a vLLM 0.32 server: the slice of its HTTP API that beam-rl uses (OpenAI's
completions, vLLM's token-in/token-out generate route, the weight-update routes), with load metrics and
fault injection, served by one of three backends: a tiny real model ("model"), random tokens ("instant")
or a simulated continuous-batching engine ("simulated").

Run in-process (`EmbeddedServer(...).start()`) or as a subprocess
(`python -m beam_rl.standin.server --port 0`, which prints `READY <url>` once listening).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import gc
import json
import os
import pathlib
import signal
import socket
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError

from beam_rl.model.tokenizer import load_tokenizer
from beam_rl.processes import keep_triton_out
from beam_rl.standin.backend import Backend, PauseGate, PauseState
from beam_rl.standin.faults import (
    FaultConfig,
    FaultInjector,
    add_fault_args,
    fault_config_from_args,
    scripted_choice,
)
from beam_rl.standin.generator import ChoiceResult, GenerationParams, WeightsError
from beam_rl.standin.launch import start_subprocess_server
from beam_rl.standin.lora import LoraAdapters
from beam_rl.standin.metrics import ServerMetrics
from beam_rl.standin.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    RequestError,
    error_response,
)
from beam_rl.standin.responses import (
    CompletionStream,
    GenerateStream,
    TokenTexts,
    chat_body,
    completion_body,
    dumps,
    generate_body,
)
from beam_rl.standin.security import Handler, api_key_middleware, server_ssl_context
from beam_rl.standin.simulated import (
    SimulatedEngine,
    SimulatedParams,
    add_simulated_args,
    simulated_params_from_args,
)
from beam_rl.standin.stepped import InstantBackend, ModelBackend

__all__ = ["EmbeddedServer", "FaultConfig", "main", "start_subprocess_server"]

Mode = Literal["model", "instant", "simulated"]
R = TypeVar("R", bound=BaseModel)
DIED_EXIT_CODE = 70  # a subprocess server killed by the die_after_tokens fault exits with this


@dataclass(eq=False)
class SeenRequest:
    """A generation request as the server read it and how it ended: what tests and benchmarks check a client
    asked for (a continued completion: the same seed, a longer prompt, fewer tokens to go)."""

    t: float  # Unix time it arrived
    seed: int | None
    prompt_tokens: int
    max_tokens: int
    n: int
    ended: float | None = None  # Unix time its answer was over, sent in full or cut off
    tokens: int | None = None  # completion tokens of an answer generated to its end; None: cut off (or failed)


class EmbeddedServer:
    """A vLLM-compatible server on a loopback port, for tests and local runs.

    `faults`: a server given a FaultConfig (even an empty one) injects its faults and serves `GET/POST
    /faults` to change them; without one that route does not exist (404). `api_key`: required on every
    route that may change the server's state (`security.needs_key`), not only on /v1 as in vLLM.

    Logprobs are those of the distribution sampled from: log-softmax of the temperature-scaled
    logits (unscaled for greedy), as recent vLLM returns by default. Pauses follow vLLM 0.32: every
    mode queues new requests until `/resume`; "keep" freezes running ones between two steps,
    "wait" lets them finish, "abort" ends them with finish_reason "abort" and their tokens so far.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike | None = None,
        *,
        mode: Mode = "model",
        max_num_seqs: int = 256,
        served_model_name: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        kv_cache_tokens: int = 65536,
        torch_threads: int | None = 1,
        simulated: SimulatedParams | None = None,
        faults: FaultConfig | None = None,
        api_key: str | Sequence[str] | None = None,
        ssl_certfile: str | os.PathLike | None = None,
        ssl_keyfile: str | os.PathLike | None = None,
        exit_on_death: bool = False,
        enable_lora: bool = False,
        device: str = "cpu",
        dtype: str = "float32",
    ) -> None:
        if mode not in ("model", "instant", "simulated"):
            raise ValueError(f"mode must be 'model', 'instant' or 'simulated', not {mode!r}")
        if mode == "model" and model_dir is None:
            from beam_rl.model.tiny import tiny_model_dir

            model_dir = tiny_model_dir()
        self.model_dir = pathlib.Path(model_dir) if model_dir is not None else None
        self.host, self.port = host, port
        self.tokenizer = load_tokenizer(str(self.model_dir) if self.model_dir else "tiny")
        self.texts = TokenTexts(self.tokenizer)
        self.faults = FaultInjector(faults or FaultConfig())
        # Faults are a test's tool: the route that changes them is served only to a server started with some.
        self.faults_enabled = faults is not None
        self.gate = PauseGate()
        self.backend: Backend = self._make_backend(
            mode, max_num_seqs, kv_cache_tokens, torch_threads, simulated, device, dtype
        )
        # vLLM's runtime LoRA routes, served only when enabled (as vLLM with --enable-lora).
        self.lora = LoraAdapters(self.backend, self.model_dir if mode == "model" else None) if enable_lora else None
        # None = answer whatever `model` a request names; a name given here is enforced like vLLM.
        self._strict_model_name = served_model_name is not None
        self.served_model_name = served_model_name or (self.model_dir.name if self.model_dir else f"tiny-{mode}")
        self.requests_total = 0
        self.requests_seen: collections.deque[SeenRequest] = collections.deque(maxlen=100_000)  # newest last
        self._death_at = self._death_threshold()
        self._exit_on_death = exit_on_death
        self._dead = False  # died of die_after_tokens, in-process: answers nothing until started again
        keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
        self._middlewares: list[Middleware] = [self._crashed, *([api_key_middleware(keys)] if keys else [])]
        self._ssl = (
            server_ssl_context(str(ssl_certfile), str(ssl_keyfile) if ssl_keyfile else None) if ssl_certfile else None
        )
        self._metrics_collector = ServerMetrics(self)
        self._runner: web.AppRunner | None = None
        self._site: web.SockSite | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.url: str | None = None

    def _make_backend(
        self,
        mode: Mode,
        max_num_seqs: int,
        kv_cache_tokens: int,
        torch_threads: int | None,
        simulated: SimulatedParams | None,
        device: str,
        dtype: str,
    ) -> Backend:
        special = set(self.tokenizer.all_special_ids)
        if mode == "model":
            assert self.model_dir is not None
            return ModelBackend(
                self.model_dir, max_num_seqs, self.gate, self.faults, kv_cache_tokens, torch_threads, device, dtype
            )
        if mode == "instant":
            return InstantBackend(len(self.tokenizer), special, max_num_seqs, self.gate, self.faults, kv_cache_tokens)
        eos = frozenset(t for t in [self.tokenizer.eos_token_id] if t is not None)
        return SimulatedEngine(
            simulated or SimulatedParams(), max_num_seqs, len(self.tokenizer), special, eos, self.gate, self.faults
        )

    # -- lifecycle ---------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=self._middlewares)
        app.add_routes(
            [
                web.post("/v1/completions", self._completions),
                web.post("/v1/chat/completions", self._chat_completions),
                web.post("/inference/v1/generate", self._generate),
                web.get("/v1/models", self._models),
                web.post("/tokenize", self._tokenize),
                web.get("/health", self._health),
                web.get("/metrics", self._metrics),
                web.post("/collective_rpc", self._collective_rpc),
                web.post("/update_weight_version", self._update_weight_version),
                web.post("/update_weights", self._update_weights),
                web.get("/weight_info", self._weight_info),
                web.post("/pause", self._pause),
                web.post("/resume", self._resume),
                web.get("/is_paused", self._is_paused),
                web.post("/reset_prefix_cache", self._reset_prefix_cache),
                web.get("/simulated/trace", self._trace),
                *(self._fault_routes() if self.faults_enabled else []),
                *(self.lora.routes() if self.lora is not None else []),
            ]
        )
        return app

    async def start_async(self) -> str:
        """Listen on the event loop that calls this; returns the base URL."""
        self._dead = False
        # handler_cancellation: a client that gives up cancels its request, as in vLLM.
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self._site = web.SockSite(self._runner, sock, ssl_context=self._ssl)
        await self._site.start()
        self.port = sock.getsockname()[1]
        self.url = f"{'https' if self._ssl else 'http'}://{self.host}:{self.port}"
        return self.url

    async def stop_async(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.backend.aclose()

    def start(self) -> str:
        """Serve from a daemon thread with its own event loop; returns the base URL."""
        if self._thread is not None:
            raise RuntimeError("server already started")
        if self._stopped:
            raise RuntimeError("server was stopped; start a new EmbeddedServer")
        started = threading.Event()
        failure: list[BaseException] = []
        loop = self._loop = asyncio.new_event_loop()

        def serve() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.start_async())
            except BaseException as exc:  # handed to the starting thread
                failure.append(exc)
                started.set()
                return
            started.set()
            loop.run_forever()
            loop.run_until_complete(self.stop_async())
            # Requests still hanging (hang fault, paused) would otherwise die with the loop, unawaited.
            leftover = asyncio.all_tasks(loop)
            for task in leftover:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*leftover, return_exceptions=True))
            loop.close()

        self._thread = threading.Thread(target=serve, name=f"embedded-vllm-{id(self):x}", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]
        assert self.url is not None
        return self.url

    def stop(self) -> None:
        if self._thread is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._thread = None
        self._stopped = True

    def __enter__(self) -> EmbeddedServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- completions -------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        self.requests_total += 1
        try:
            body = self._parse(CompletionRequest, await request.read(), "completion request")
            if body.echo:
                raise RequestError(400, "echo is not supported by the embedded server")
            prompt = body.prompt if isinstance(body.prompt, list) else self.tokenizer.encode(body.prompt)
            params = self._with_adapter(
                body, body.generation_params(prompt, body.max_tokens, body.logprobs or 0, *self._limits)
            )
        except RequestError as exc:
            return web.json_response(exc.body(), status=exc.status)
        if body.stream:
            stream = CompletionStream(self.texts, self.served_model_name, params, body)
            return await self._answer(
                request, params, lambda source: self._send_events(request, stream, source), progress=True
            )
        return await self._answer(request, params, self._whole(params, body, completion_body), progress=False)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        self.requests_total += 1
        try:
            body = self._parse(ChatCompletionRequest, await request.read(), "chat completion request")
            if body.stream:
                raise RequestError(400, "stream is not supported by the embedded server's chat completions")
            prompt = self._render_chat(body)
            max_tokens = (
                body.max_completion_tokens or body.max_tokens or max(1, self.backend.max_model_len - len(prompt))
            )
            params = self._with_adapter(
                body,
                body.generation_params(prompt, max_tokens, body.top_logprobs if body.logprobs else 0, *self._limits),
            )
        except RequestError as exc:
            return web.json_response(exc.body(), status=exc.status)
        return await self._answer(request, params, self._whole(params, body, chat_body), progress=False)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        self.requests_total += 1
        try:
            body = self._parse(GenerateRequest, await request.read(), "generate request")
            params = self._with_adapter(body, body.generation_params(*self._limits))
        except RequestError as exc:
            return web.json_response(exc.body(), status=exc.status)
        if body.stream:
            stream = GenerateStream(params, body)
            return await self._answer(
                request, params, lambda source: self._send_events(request, stream, source), progress=True
            )
        return await self._answer(request, params, self._whole(params, body, generate_body), progress=False)

    async def _answer(
        self,
        request: web.Request,
        params: GenerationParams,
        respond: Callable[[AsyncIterator[list[ChoiceResult]]], Any],
        progress: bool,
    ) -> web.StreamResponse:
        """Apply the request's fault, then `respond` from the choices as they are generated (after
        every step with `progress`, else once finished)."""
        seen = SeenRequest(time.time(), params.seed, len(params.prompt_ids), params.max_tokens, params.n)
        self.requests_seen.append(seen)
        fault = self.faults.draw()
        if fault == "drop":
            assert request.transport is not None
            request.transport.abort()  # no status line at all: the client sees a dropped connection
            raise asyncio.CancelledError
        if fault == "error":
            return error_response(500, "injected fault: internal server error", "InternalServerError")
        if fault == "hang":
            await asyncio.Event().wait()  # cancelled when the client disconnects or the server stops
        # Every step is watched when streaming, or when the server may have to die mid-request.
        progress = progress or self._death_at is not None
        try:
            async with contextlib.aclosing(self._choices(params, fault == "empty", progress)) as source:
                return await respond(_noting_the_end(source, seen))
        finally:
            seen.ended = time.time()

    async def _choices(
        self,
        params: GenerationParams,
        empty: bool,
        progress: bool,
    ) -> AsyncGenerator[list[ChoiceResult], None]:
        """The request's choices as they grow: generated, scripted (fault `replies`) or empty (fault)."""
        if empty:
            await asyncio.sleep(self.faults.config.latency_s)
            yield [ChoiceResult(finish_reason="stop") for _ in range(params.n)]
        elif self.faults.config.replies:
            replies = [self.faults.next_reply() for _ in range(params.n)]
            await asyncio.sleep(max(r.latency_s for r in replies) + self.faults.config.latency_s)
            yield [scripted_choice(r, self.tokenizer, params, self.backend.weights) for r in replies]
        else:
            async for choices in self.backend.generate(params, progress=progress):
                yield choices
                await self._maybe_die()

    def _whole(self, params: GenerationParams, body: Any, build: Callable[..., dict[str, Any]]) -> Callable[..., Any]:
        """Responds with one JSON body, built by `build` from the finished choices."""

        async def respond(source: AsyncIterator[list[ChoiceResult]]) -> web.Response:
            choices: list[ChoiceResult] = []
            async for choices in source:  # noqa: B007 (the last list holds every choice, finished)
                pass
            return web.json_response(build(self.texts, self.served_model_name, params, body, choices), dumps=dumps)

        return respond

    async def _send_events(
        self, request: web.Request, stream: CompletionStream | GenerateStream, source: AsyncIterator[list[ChoiceResult]]
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        try:
            async for choices in source:
                data = stream.chunks(choices)
                if data:
                    await response.write(data)
            await response.write(stream.end())
            await response.write_eof()
        except ConnectionResetError:
            # The client closed the stream (a rollout it no longer wants) before the server saw the connection
            # lost: the request ends here, as vLLM aborts it, and closing `source` frees its slots.
            pass
        return response

    @property
    def _limits(self) -> tuple[int, int]:
        return self.backend.vocab_size, self.backend.max_model_len

    def _parse(self, model: type[R], raw: bytes, what: str) -> R:
        try:
            body = model.model_validate_json(raw)
        except ValidationError as exc:
            raise RequestError(400, f"invalid {what}: {exc}") from None
        adapters = self.lora.loaded if self.lora is not None else {}
        name = getattr(body, "model", None)  # every request names one
        if self._strict_model_name and name not in (None, self.served_model_name, *adapters):
            raise RequestError(404, f"The model `{name}` does not exist.", "NotFoundError")
        return body

    def _with_adapter(self, body: Any, params: GenerationParams) -> GenerationParams:
        """The params of a request naming a LoRA adapter sample with it (RequestError: one unloaded)."""
        adapter = self.lora.adapter_of(body.model) if self.lora is not None else None
        return params if adapter is None else dataclasses.replace(params, adapter=adapter)

    def _render_chat(self, body: ChatCompletionRequest) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(
                [m.model_dump() for m in body.messages],
                tokenize=False,
                add_generation_prompt=body.add_generation_prompt,
                **(body.chat_template_kwargs or {}),
            )
        except Exception as exc:  # a template that cannot render these messages is the request's fault
            raise RequestError(400, f"cannot apply the chat template: {type(exc).__name__}: {exc}") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    # -- the die_after_tokens fault -----------------------------------------------------------

    def _death_threshold(self) -> int | None:
        after = self.faults.config.die_after_tokens
        return None if after is None else self.backend.generation_tokens + after

    async def _maybe_die(self) -> None:
        if self._death_at is None or self.backend.generation_tokens < self._death_at:
            return
        if self._exit_on_death:
            os._exit(DIED_EXIT_CODE)  # the process dies: no cleanup, no answer, like a crashed server
        # In-process, dying is what a client sees of a crash: every connection drops, the port closes, and a
        # request on a kept-alive connection meanwhile is dropped too (`_crashed`), never answered.
        self._dead = True
        self._death_at = None
        if self._site is not None:
            await self._site.stop()
        assert self._runner is not None
        for handler in self._runner.server.connections if self._runner.server else ():
            if handler.transport is not None:
                handler.transport.abort()
        raise asyncio.CancelledError

    @web.middleware
    async def _crashed(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self._dead:
            if request.transport is not None:
                request.transport.abort()
            raise asyncio.CancelledError
        return await handler(request)

    # -- control and status ------------------------------------------------------------------

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize for a text prompt: the ids this server's tokenizer makes of it."""
        try:
            body = json.loads(await request.read())
            prompt, special = body["prompt"], bool(body.get("add_special_tokens", True))
            if not isinstance(prompt, str):
                raise TypeError("prompt must be a string")
        except (ValueError, KeyError, TypeError) as exc:
            return error_response(400, f"bad tokenize request: {exc}", "BadRequestError")
        tokens = self.tokenizer.encode(prompt, add_special_tokens=special)
        return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": self.backend.max_model_len})

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": str(self.model_dir) if self.model_dir else None,
            "max_model_len": self.backend.max_model_len,
            "weights_version": self.backend.weights.loads,
        }
        adapters = self.lora.cards(self.served_model_name) if self.lora is not None else []
        return web.json_response({"object": "list", "data": [card, *adapters]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)  # vLLM 0.32 stays healthy while paused

    async def _collective_rpc(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            method = body["method"]
            weights_path = (body.get("kwargs") or {})["weights_path"]
        except (ValueError, KeyError, TypeError):
            return error_response(
                400, 'expected {"method": "reload_weights", "kwargs": {"weights_path": DIR}}', "BadRequestError"
            )
        if method != "reload_weights":
            return error_response(400, f"unsupported collective_rpc method {method!r}", "BadRequestError")
        try:
            await self.backend.load_weights(weights_path)
        except WeightsError as exc:
            return error_response(400, str(exc), "BadRequestError")
        return web.json_response({"results": [{"weights_version": self.backend.weights.loads}]})

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        try:
            new_version = (await request.json())["new_version"]
        except (ValueError, KeyError, TypeError):
            return error_response(400, 'expected {"new_version": "..."}', "BadRequestError")
        if not isinstance(new_version, str):
            return error_response(400, "new_version must be a string", "BadRequestError")
        await self.backend.label_weights(new_version)
        return web.json_response({"success": True, "new_version": new_version})

    async def _update_weights(self, request: web.Request) -> web.Response:
        """prime-rl's inference server route (its `inference/vllm/server.py`): load the weights at `weight_dir`.
        Simulated weights have nothing to load; the stand-in answers as prime-rl's server does."""
        return web.json_response({"status": "ok"})

    async def _weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.backend.weights.label})

    async def _pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            return error_response(400, f"pause mode must be abort, wait or keep, not {mode!r}", "BadRequestError")
        if mode == "keep":
            self.gate.set(PauseState.PAUSED_ALL)
            await self.backend.quiesce()  # returns with no step in flight
            return web.json_response({"status": "paused"})
        self.gate.set(PauseState.PAUSED_NEW)
        if mode == "abort":
            await self.backend.abort_all()
        else:
            await self.backend.running_drained()
        if request.query.get("clear_cache", "true").lower() not in ("false", "0"):
            self.backend.prefix_cache.reset()  # vLLM clears its caches once drained, unless told not to
        return web.json_response({"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        self.gate.set(PauseState.UNPAUSED)
        return web.json_response({"status": "resumed"})

    async def _is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.gate.state != PauseState.UNPAUSED})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.backend.prefix_cache.reset()
        return web.json_response({"status": "ok"})

    def _fault_routes(self) -> list[web.RouteDef]:
        return [web.get("/faults", self._get_faults), web.post("/faults", self._set_faults)]

    async def _get_faults(self, request: web.Request) -> web.Response:
        return web.json_response(self.faults.config.model_dump())

    async def _set_faults(self, request: web.Request) -> web.Response:
        try:
            changes = await request.json()
            config = self.faults.update(changes)
        except (ValueError, TypeError, ValidationError) as exc:
            return error_response(400, f"invalid faults: {exc}", "BadRequestError")
        if "die_after_tokens" in changes:
            self._death_at = self._death_threshold()
        return web.json_response(config.model_dump())

    async def _trace(self, request: web.Request) -> web.Response:
        """Engine steps since `?since=<unix time>`: {"t", "duration", "running"} lists, for benchmarks."""
        try:
            since = float(request.query.get("since", "0"))
        except ValueError:
            return error_response(400, "since must be a unix time in seconds", "BadRequestError")
        trace = self.backend.trace_since(since)
        if trace is None:
            return error_response(404, "this backend keeps no trace of engine steps", "NotFoundError")
        return web.json_response(trace)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics_collector.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _noting_the_end(
    source: AsyncIterator[list[ChoiceResult]],
    seen: SeenRequest,
) -> AsyncIterator[list[ChoiceResult]]:
    choices: list[ChoiceResult] = []
    async for choices in source:
        yield choices
    seen.tokens = sum(len(c.token_ids) for c in choices)


# -- subprocess mode --------------------------------------------------------------------------


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 = any free port")
    parser.add_argument("--model-dir", default=None, help="default: the cached tiny model")
    parser.add_argument("--mode", choices=("model", "instant", "simulated"), default="model")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument(
        "--torch-threads", type=int, default=1, help="intra-op threads; 1 suits a tiny model and many servers per host"
    )
    parser.add_argument(
        "--api-key",
        nargs="+",
        default=None,
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on /v1/* and on every route that changes the "
        "server's state (default: $VLLM_API_KEY, if set; the variable keeps the key out of `ps`)",
    )
    parser.add_argument("--ssl-keyfile", default=None, help="serve https with this PEM private key")
    parser.add_argument("--ssl-certfile", default=None, help="serve https with this PEM certificate")
    parser.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve vLLM's runtime LoRA routes (/v1/load_lora_adapter, /v1/unload_lora_adapter)",
    )
    add_fault_args(parser)
    add_simulated_args(parser)
    return parser.parse_args(argv)


async def _serve(args: argparse.Namespace) -> None:
    server = EmbeddedServer(
        args.model_dir,
        mode=args.mode,
        max_num_seqs=args.max_num_seqs,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        torch_threads=args.torch_threads,
        simulated=simulated_params_from_args(args) if args.mode == "simulated" else None,
        faults=fault_config_from_args(args),
        api_key=args.api_key or os.environ.get("VLLM_API_KEY") or None,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        exit_on_death=True,
        enable_lora=args.enable_lora,
    )
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    url = await server.start_async()
    # The heap of imports and model (torch, transformers: ~400k objects) lives as long as the
    # process; frozen, full collections skip it (one cost ~0.18 s here, while serving).
    gc.collect()
    gc.freeze()
    print(f"READY {url}", flush=True)
    await stopping.wait()
    await server.stop_async()


def main(argv: list[str] | None = None) -> None:
    keep_triton_out()
    asyncio.run(_serve(_parse_args(argv)))


if __name__ == "__main__":
    main()
