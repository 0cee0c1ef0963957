"""An embedded stand-in for a vLLM server: the slice of its OpenAI-compatible HTTP API that beam-rl
uses, served by a tiny real model, an instant fake, or a simulated continuous-batching engine
(`mode="simulated"`, see `simulated.py`), with load metrics and fault injection.

Run in-process (`EmbeddedServer(...).start()`) or as a subprocess
(`python -m beam_rl.inference.server --port 0`, which prints `READY <url>` once listening).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import pathlib
import signal
import socket
import threading
import time
from typing import Any, Callable, Literal, TypeVar

import orjson
import torch
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from beam_rl.inference.admission import Admission
from beam_rl.inference.generator import (
    ChoiceResult,
    GenerationParams,
    Generator,
    InstantGenerator,
    ModelGenerator,
    WeightsError,
)
from beam_rl.inference.launch import start_subprocess_server
from beam_rl.inference.metrics import KV_BLOCK_SIZE, PrefixCache, ServerMetrics, kv_cache_usage
from beam_rl.inference.protocol import (
    CompletionRequest,
    FaultConfig,
    FaultInjector,
    RequestError,
    TokenTexts,
    completion_body,
)
from beam_rl.inference.simulated import SimulatedEngine, SimulatedParams, add_simulated_args, simulated_params_from_args
from beam_rl.tokenizer import load_tokenizer

T = TypeVar("T")
__all__ = ["EmbeddedServer", "start_subprocess_server", "main"]


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()  # completions bodies carry thousands of logprobs


def _error_response(status: int, message: str, kind: str) -> web.Response:
    return web.json_response(RequestError(status, message, kind).body(), status=status)


class _Aborted(Exception):
    """An in-flight request dropped by `/pause?mode=abort`."""


class EmbeddedServer:
    """A vLLM-compatible server on a loopback port, for tests and local runs.

    Logprobs are those of the distribution sampled from: log-softmax of the temperature-scaled
    logits (unscaled for greedy), as recent vLLM returns by default.

    Units follow vLLM V1, where each of a request's n choices is scheduled as its own request:
    `num_requests_running`/`waiting`, `max_num_seqs` and `beam_rl:max_concurrent_requests` count
    sequences; `beam_rl:requests_total` counts HTTP completion requests.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike | None = None,
        *,
        mode: Literal["model", "instant", "simulated"] = "model",
        max_num_seqs: int = 256,
        served_model_name: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        kv_cache_tokens: int = 65536,
        latency_s: float = 0.0,
        error_rate: float = 0.0,
        hang_rate: float = 0.0,
        empty_rate: float = 0.0,
        drop_rate: float = 0.0,
        fault_seed: int = 0,
        torch_threads: int | None = 1,
        simulated: SimulatedParams | None = None,
    ) -> None:
        if mode not in ("model", "instant", "simulated"):
            raise ValueError(f"mode must be 'model', 'instant' or 'simulated', not {mode!r}")
        if mode == "model" and model_dir is None:
            from beam_rl.tinymodel import tiny_model_dir

            model_dir = tiny_model_dir()
        self.model_dir = pathlib.Path(model_dir) if model_dir is not None else None
        self.mode = mode
        self.host, self.port = host, port
        self.tokenizer = load_tokenizer(str(self.model_dir) if self.model_dir else "tiny")
        self.token_texts = TokenTexts(self.tokenizer)
        self.generator: Generator
        self.engine: SimulatedEngine | None = None
        if mode == "simulated":
            self.engine = SimulatedEngine(
                simulated or SimulatedParams(), max_num_seqs, len(self.tokenizer),
                set(self.tokenizer.all_special_ids),
                frozenset(t for t in [self.tokenizer.eos_token_id] if t is not None),
                gate=lambda: self._resumed.wait())  # pause "keep" freezes the batch between steps
            self.generator = self.engine  # type: ignore[assignment]  # same request limits
        elif mode == "model":
            self.generator = ModelGenerator(self.model_dir)
            if torch_threads is not None:
                # Process-wide, unavoidably: a tiny model's matmuls gain nothing from intra-op threads
                # and run ~10x slower when those threads contend for busy cores.
                torch.set_num_threads(torch_threads)
        else:
            self.generator = InstantGenerator(len(self.tokenizer), set(self.tokenizer.all_special_ids))
        # None = answer whatever `model` a request names; a name given here is enforced like vLLM.
        self._strict_model_name = served_model_name is not None
        self.served_model_name = served_model_name or (self.model_dir.name if self.model_dir else f"tiny-{mode}")
        self.faults = FaultInjector(
            FaultConfig(
                latency_s=latency_s,
                error_rate=error_rate,
                hang_rate=hang_rate,
                empty_rate=empty_rate,
                drop_rate=drop_rate,
                seed=fault_seed,
            )
        )
        # The simulated engine schedules per sequence itself; the metrics read its counts instead.
        self.admission = self.engine if self.engine is not None else Admission(max_num_seqs)  # type: ignore[assignment]
        self.prefix_cache = self.engine.prefix_cache if self.engine is not None else PrefixCache()
        self.kv_cache_blocks = max(1, kv_cache_tokens // KV_BLOCK_SIZE)
        self.weights_version = 0
        self.requests_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._active: dict[int, Any] = {}  # running generation states, for the KV usage gauge
        self.paused = False
        self._abort_epoch = 0  # bumped by /pause?mode=abort; requests from older epochs abort
        self._resumed: asyncio.Event | None = None
        # One model thread: torch work never blocks the event loop, and weight reloads are
        # serialised with decode steps, so a reload lands between two steps of every request.
        self._model_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._metrics_collector = ServerMetrics(self)
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.url: str | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes(
            [
                web.post("/v1/completions", self._completions),
                web.get("/v1/models", self._models),
                web.get("/health", self._health),
                web.get("/metrics", self._metrics),
                web.post("/collective_rpc", self._collective_rpc),
                web.post("/pause", self._pause),
                web.post("/resume", self._resume),
                web.get("/is_paused", self._is_paused),
                web.get("/faults", self._get_faults),
                web.post("/faults", self._set_faults),
            ]
        )
        if self.engine is not None:
            app.add_routes([web.post("/reset_prefix_cache", self._reset_prefix_cache),
                            web.get("/simulated/trace", self._simulated_trace)])
        return app

    async def start_async(self) -> str:
        """Listen on the event loop that calls this; returns the base URL."""
        self._resumed = asyncio.Event()
        self._resumed.set()
        # handler_cancellation: a client that gives up cancels its request, as in vLLM.
        self._runner = web.AppRunner(self.app(), handler_cancellation=True, shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        await web.SockSite(self._runner, sock).start()
        self.port = sock.getsockname()[1]
        self.url = f"http://{self.host}:{self.port}"
        return self.url

    async def stop_async(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def start(self) -> str:
        """Serve from a daemon thread with its own event loop; returns the base URL."""
        if self._thread is not None:
            raise RuntimeError("server already started")
        if self._stopped:
            raise RuntimeError("server was stopped; start a new EmbeddedServer")
        started = threading.Event()
        failure: list[BaseException] = []
        self._loop = asyncio.new_event_loop()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self.start_async())
            except BaseException as exc:  # noqa: BLE001 - handed to the starting thread
                failure.append(exc)
                started.set()
                return
            started.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self.stop_async())
            # Requests still hanging (hang fault, paused) would otherwise die with the loop, unawaited.
            leftover = asyncio.all_tasks(self._loop)
            for task in leftover:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*leftover, return_exceptions=True))
            self._loop.close()

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
        self._model_thread.shutdown(wait=True, cancel_futures=True)
        self._stopped = True

    def __enter__(self) -> EmbeddedServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def _on_model_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._model_thread, fn, *args)

    # -- completions -------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        self.requests_total += 1
        epoch = self._abort_epoch
        try:
            params, body = self._parse_completion(await request.read())
        except RequestError as exc:
            return web.json_response(exc.body(), status=exc.status)
        if self.paused:
            return _error_response(503, "server is paused (weight update); retry later", "ServiceUnavailableError")
        fault = self.faults.draw()
        if fault == "drop":
            assert request.transport is not None
            request.transport.abort()  # no status line at all: the client sees a dropped connection
            raise asyncio.CancelledError
        if fault == "error":
            return _error_response(500, "injected fault: internal server error", "InternalServerError")
        if fault == "hang":
            await asyncio.Event().wait()  # cancelled when the client disconnects or the server stops
        # The simulated engine schedules its own continuous batch; the model-backed path admits here.
        admitted = self.engine is None
        if admitted:
            await self.admission.acquire(params.n)
        try:
            if self.faults.config.latency_s:
                await asyncio.sleep(self.faults.config.latency_s)
            await self._wait_unpaused(epoch)
            if fault == "empty":
                choices = [ChoiceResult(finish_reason="stop") for _ in range(params.n)]
            elif self.engine is not None:
                choices = await self.engine.generate(params)
                if epoch < self._abort_epoch:
                    raise _Aborted
            else:
                self.prefix_cache.lookup(params.prompt_ids)
                choices = await self._generate(params, epoch)
        except _Aborted:
            return _error_response(503, "request aborted: server paused (mode=abort)", "ServiceUnavailableError")
        finally:
            if admitted:
                self.admission.release(params.n)
        self.prompt_tokens_total += len(params.prompt_ids)
        self.generation_tokens_total += sum(len(c.token_ids) for c in choices)
        answer = completion_body(self.token_texts, self.served_model_name, params, body, choices)
        return web.json_response(answer, dumps=_dumps)

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        assert self.engine is not None
        self.engine.prefix_cache.reset()
        return web.json_response({"status": "ok"})

    async def _simulated_trace(self, request: web.Request) -> web.Response:
        """Engine steps since `?since=<unix time>`: {"t", "duration", "running"} lists, for benchmarks."""
        assert self.engine is not None
        try:
            since = float(request.query.get("since", "0"))
        except ValueError:
            return _error_response(400, "since must be a unix time in seconds", "BadRequestError")
        return web.json_response({"max_num_seqs": self.engine.max_num_seqs, **self.engine.trace_since(since)})

    def _parse_completion(self, raw: bytes) -> tuple[GenerationParams, CompletionRequest]:
        try:
            body = CompletionRequest.model_validate_json(raw)
        except ValidationError as exc:
            raise RequestError(400, f"invalid completion request: {exc}") from None
        if self._strict_model_name and body.model not in (None, self.served_model_name):
            raise RequestError(404, f"The model `{body.model}` does not exist.", "NotFoundError")
        if body.stream or body.echo:
            raise RequestError(400, "stream and echo are not supported by the embedded server")
        if body.top_p < 1.0 or (body.top_k is not None and body.top_k > 0):
            raise RequestError(400, "top_p/top_k truncation is not supported by the embedded server")
        prompt = body.prompt if isinstance(body.prompt, list) else self.tokenizer.encode(body.prompt)
        if not prompt:
            raise RequestError(400, "prompt is empty")
        vocab = self.generator.vocab_size
        if any(t < 0 or t >= vocab for t in prompt):
            raise RequestError(400, f"prompt has token ids outside [0, {vocab})")
        limit = self.generator.max_model_len
        if len(prompt) + body.max_tokens > limit:
            raise RequestError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(prompt) + body.max_tokens} tokens ({len(prompt)} in the prompt, {body.max_tokens} for the completion).",
            )
        params = GenerationParams(
            prompt_ids=tuple(prompt),
            n=body.n,
            max_tokens=body.max_tokens,
            temperature=body.temperature,
            seed=body.seed,
            stop_token_ids=frozenset(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            top_logprobs=body.logprobs or 0,
        )
        return params, body

    async def _generate(self, params: GenerationParams, epoch: int) -> list[ChoiceResult]:
        if isinstance(self.generator, InstantGenerator):
            return self.generator.start(params).choices
        state = await self._on_model_thread(self.generator.start, params)
        key = id(state)
        self._active[key] = state
        try:
            while not state.done:
                await self._wait_unpaused(epoch)
                # Steps of all running requests interleave on the model thread, like a batch scheduler.
                await self._on_model_thread(self.generator.step, state)
        finally:
            del self._active[key]
        return state.choices

    async def _wait_unpaused(self, epoch: int) -> None:
        assert self._resumed is not None
        if epoch < self._abort_epoch:
            raise _Aborted
        await self._resumed.wait()  # pause mode "keep": in-flight requests freeze between steps
        if epoch < self._abort_epoch:
            raise _Aborted

    # -- control and status ------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": str(self.model_dir) if self.model_dir else None,
            "max_model_len": self.generator.max_model_len,
            "weights_version": self.weights_version,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.paused else 200)

    async def _collective_rpc(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            method = body["method"]
            weights_path = (body.get("kwargs") or {})["weights_path"]
        except (ValueError, KeyError, TypeError):
            return _error_response(400, 'expected {"method": "reload_weights", "kwargs": {"weights_path": DIR}}', "BadRequestError")
        if method != "reload_weights":
            return _error_response(400, f"unsupported collective_rpc method {method!r}", "BadRequestError")
        try:
            # Read and check off the model thread, so decoding goes on while a checkpoint loads.
            tensors = await asyncio.to_thread(self._check_weights, weights_path)
        except WeightsError as exc:
            return _error_response(400, str(exc), "BadRequestError")
        if isinstance(self.generator, ModelGenerator):
            await self._on_model_thread(self.generator.load_weights, tensors)
        self.weights_version += 1
        return web.json_response({"results": [{"weights_version": self.weights_version}]})

    def _check_weights(self, weights_path: str) -> dict[str, Any]:
        if not isinstance(self.generator, ModelGenerator):
            # No model to check shapes against in instant mode; still refuse a path with no weights.
            if not any(pathlib.Path(weights_path).glob("*.safetensors")):
                raise WeightsError(f"no *.safetensors files in {weights_path}")
            return {}
        try:
            return self.generator.check_weights(weights_path)
        except WeightsError:
            raise
        except Exception as exc:  # an unreadable file is the checkpoint's fault, not the server's
            raise WeightsError(f"cannot read checkpoint {weights_path}: {type(exc).__name__}: {exc}") from exc

    async def _pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            return _error_response(400, f"pause mode must be abort, wait or keep, not {mode!r}", "BadRequestError")
        assert self._resumed is not None
        self.paused = True  # new completions get 503 from now on
        if mode == "keep":
            self._resumed.clear()  # in-flight requests freeze between two decode steps
        else:
            self._resumed.set()  # requests frozen by an earlier "keep" must run (wait) or abort
        if mode == "abort":
            self._abort_epoch += 1  # admitted and queued requests answer 503 at their next step
        if mode != "keep":
            # Return only once nothing runs, so the caller can swap weights under no request.
            await self.admission.drained()
        return web.json_response({"status": "paused", "mode": mode})

    async def _resume(self, request: web.Request) -> web.Response:
        assert self._resumed is not None
        self.paused = False
        self._resumed.set()
        return web.json_response({"status": "resumed"})

    async def _is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.paused})

    async def _get_faults(self, request: web.Request) -> web.Response:
        return web.json_response(self.faults.config.model_dump())

    async def _set_faults(self, request: web.Request) -> web.Response:
        try:
            config = self.faults.update(await request.json())
        except (ValueError, TypeError, ValidationError) as exc:
            return _error_response(400, f"invalid faults: {exc}", "BadRequestError")
        return web.json_response(config.model_dump())

    # -- metrics -----------------------------------------------------------------------------

    def kv_cache_usage(self) -> float:
        if self.engine is not None:
            return self.engine.kv_cache_usage()
        return kv_cache_usage(list(self._active.values()), self.kv_cache_blocks)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics_collector.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


# -- subprocess mode --------------------------------------------------------------------------


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 = any free port")
    parser.add_argument("--model-dir", default=None, help="default: the cached tiny model")
    parser.add_argument("--mode", choices=("model", "instant", "simulated"), default="model")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--served-model-name", default=None)
    for name in ("latency-s", "error-rate", "hang-rate", "empty-rate", "drop-rate"):
        parser.add_argument(f"--{name}", type=float, default=0.0)
    parser.add_argument("--fault-seed", type=int, default=0)
    parser.add_argument(
        "--torch-threads", type=int, default=1, help="intra-op threads; 1 suits a tiny model and many servers per host"
    )
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
        latency_s=args.latency_s,
        error_rate=args.error_rate,
        hang_rate=args.hang_rate,
        empty_rate=args.empty_rate,
        drop_rate=args.drop_rate,
        fault_seed=args.fault_seed,
        torch_threads=args.torch_threads,
        simulated=simulated_params_from_args(args) if args.mode == "simulated" else None,
    )
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    url = await server.start_async()
    print(f"READY {url}", flush=True)
    await stopping.wait()
    await server.stop_async()
    server.stop()  # not started from a thread: only releases the model thread


def main(argv: list[str] | None = None) -> None:
    asyncio.run(_serve(_parse_args(argv)))


if __name__ == "__main__":
    main()
