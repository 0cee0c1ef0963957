"""InferenceClient against an in-test aiohttp stub of vLLM's HTTP API (loopback only)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import pytest
from aiohttp import web

from beam_rl.inference.client import (
    InferenceAborted,
    InferenceAuthError,
    InferenceBadResponse,
    InferenceClient,
    InferenceConnectionError,
    InferenceHTTPError,
    InferenceTimeout,
    ServerLoad,
    parse_completions,
    parse_server_load,
)
from beam_rl.inference.inflight import UNKNOWN_VERSION, LiveRequest, Progress
from beam_rl.inference.types import Completion, SamplingParams
from beam_rl.listeners import is_loopback

pytestmark = pytest.mark.timeout(60)

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 600.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 400.0
vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 150.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 100.0
# HELP vllm:e2e_request_latency_seconds Histogram of end to end request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="m"} 2.0
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 3.0
vllm:e2e_request_latency_seconds_count{model_name="m"} 3.0
vllm:e2e_request_latency_seconds_sum{model_name="m"} 1.5
"""


class StubVLLM:
    """Answers like vLLM; `plan` scripts the next answers to /v1/completions ("ok", a status, "drop", "hang")."""

    def __init__(self) -> None:
        self.plan: list[str | int] = []
        self.completions: list[dict[str, Any]] = []  # request bodies, in arrival order
        self.headers: list[dict[str, str]] = []
        self.posts: list[
            tuple[str, dict[str, Any], dict[str, str]]
        ] = []  # (path, body, query) of control calls
        self.concurrent = 0
        self.peak_concurrent = 0
        self.delay_s = 0.0
        self.barrier: tuple[int, asyncio.Event] | None = None  # hold requests until N are in at once
        self.release = asyncio.Event()  # a "held" stream sends its first token, the rest once this is set
        self.healthy = True
        self.metrics = METRICS

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        for path in ("/collective_rpc", "/pause", "/resume"):
            app.router.add_post(path, self._control)
        return app

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.completions.append(body)
        self.headers.append(dict(request.headers))
        step = self.plan.pop(0) if self.plan else "ok"
        if step == 401:
            return web.json_response({"error": "Unauthorized"}, status=401)
        if body.get("stream"):
            return await self._stream(request, body, step)
        if step == "abort":
            choice = {"index": 0, "token_ids": [4], "logprobs": {"token_logprobs": [-0.4]}, "finish_reason": "abort"}
            return web.json_response({"choices": [choice]})
        if step == "drop":
            request.transport.close()
            return web.Response()
        if step == "hang":
            await asyncio.sleep(30)
        if isinstance(step, int):
            return web.json_response({"error": f"scripted {step}"}, status=step)
        self.concurrent += 1
        self.peak_concurrent = max(self.peak_concurrent, self.concurrent)
        try:
            if self.barrier is not None:
                size, released = self.barrier
                if self.concurrent >= size:
                    released.set()
                await released.wait()
            await asyncio.sleep(self.delay_s)
        finally:
            self.concurrent -= 1
        if step == "mismatch":
            choices = [
                {
                    "index": 0,
                    "token_ids": [1, 2, 3],
                    "logprobs": {"token_logprobs": [-0.5]},
                    "finish_reason": "stop",
                }
            ]
            return web.json_response({"choices": choices})
        # Choice i returns ids [10*i+1, 10*i+2] with logprobs [-(i+1)/10, -0.5]; sent in reverse
        # order so the client must sort by `index`.
        choices = [
            {
                "index": i,
                "text": "ignored",
                "token_ids": [10 * i + 1, 10 * i + 2],
                "logprobs": {"token_logprobs": [-(i + 1) / 10, -0.5], "tokens": ["a", "b"]},
                "finish_reason": "length" if i == 0 else "stop",
            }
            for i in reversed(range(body["n"]))
        ]
        return web.json_response({"id": "cmpl-1", "choices": choices})

    async def _stream(self, request: web.Request, body: dict[str, Any], step: str | int) -> web.StreamResponse:
        """vLLM's server-sent events: one chunk per token of choice 0 ([30 + i], logprob -i/10), then one
        with its finish_reason, then [DONE]; "cut" drops the connection after two tokens; "held" waits for
        `release` after the first; "ragged" sends the same events with CRLF line ends and a comment between
        them, in 7-byte pieces."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        events = []
        for i in range(body["max_tokens"]):
            if step == "cut" and i == 2:
                await response.write(b"".join(events))
                request.transport.close()
                return response
            chunk = {"choices": [{"index": 0, "token_ids": [30 + i], "logprobs": {"token_logprobs": [-i / 10]},
                                  "finish_reason": None}]}
            events.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        end = {"choices": [{"index": 0, "token_ids": [], "logprobs": {"token_logprobs": []}, "finish_reason": "length"}]}
        events.append(b"data: " + json.dumps(end).encode() + b"\n\ndata: [DONE]\n\n")
        if step == "held":
            await response.write(events[0])
            await self.release.wait()
            await response.write(b"".join(events[1:]))
        elif step != "ragged":
            await response.write(b"".join(events))
        else:
            data = b": keep-alive\n\n".join(events).replace(b"\n", b"\r\n")
            for start in range(0, len(data), 7):
                await response.write(data[start:start + 7])
                await asyncio.sleep(0.001)  # each piece its own read
        await response.write_eof()
        return response

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics, content_type="text/plain")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _control(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        self.posts.append((request.path, body, dict(request.query)))
        return web.json_response({"status": "ok"})


@asynccontextmanager
async def serve(stub: StubVLLM) -> AsyncIterator[str]:
    runner = web.AppRunner(stub.app(), shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def run_with_stub(test: Callable[[StubVLLM, str], Awaitable[None]]) -> StubVLLM:
    stub = StubVLLM()

    async def main() -> None:
        async with serve(stub) as url:
            await test(stub, url)

    asyncio.run(main())
    return stub


SAMPLING = SamplingParams(max_tokens=7, temperature=0.8, seed=1234, stop_token_ids=(2, 99))


def test_complete_sends_token_in_token_out_request_and_orders_choices_by_index():
    async def test(stub: StubVLLM, url: str) -> None:
        async with InferenceClient(url, model="policy") as client:
            completions = await client.complete([5, 6, 7], SAMPLING, n=3)
        assert [c.token_ids for c in completions] == [[1, 2], [11, 12], [21, 22]]
        assert [c.logprobs for c in completions] == [[-0.1, -0.5], [-0.2, -0.5], [-0.3, -0.5]]
        assert [c.finish_reason for c in completions] == ["length", "stop", "stop"]

    stub = run_with_stub(test)
    (body,) = stub.completions
    assert body == {
        "model": "policy",
        "prompt": [5, 6, 7],
        "n": 3,
        "max_tokens": 7,
        "temperature": 0.8,
        "logprobs": 0,
        "return_token_ids": True,
        "skip_special_tokens": False,
        "stop_token_ids": [2, 99],
        "cache_salt": "policy-v0",  # the prefix cache is salted per policy version
        "seed": 1234,
    }


def test_complete_without_seed_omits_it_but_still_sends_max_tokens():
    async def test(stub: StubVLLM, url: str) -> None:
        async with InferenceClient(url) as client:
            (completion,) = await client.complete([1], SamplingParams())
        assert completion.token_ids == [1, 2]

    (body,) = run_with_stub(test).completions
    assert "seed" not in body
    assert body["max_tokens"] == 32


def test_retries_500_503_and_a_dropped_connection_then_succeeds():
    async def test(stub: StubVLLM, url: str) -> None:
        stub.plan = [500, 503, "drop"]
        async with InferenceClient(url, max_retries=3, backoff_s=0.001) as client:
            completions = await client.complete([1, 2], SAMPLING, n=2)
        assert [c.token_ids for c in completions] == [[1, 2], [11, 12]]

    assert len(run_with_stub(test).completions) == 4


def test_gives_up_after_max_retries_with_an_error_naming_server_and_status():
    async def test(stub: StubVLLM, url: str) -> None:
        stub.plan = [503, 503, 503, 503]
        async with InferenceClient(url, max_retries=2, backoff_s=0.001) as client:
            with pytest.raises(InferenceHTTPError) as info:
                await client.complete([1], SAMPLING)
        assert info.value.status == 503
        assert info.value.server_fault and info.value.retryable
        assert url in str(info.value) and "503" in str(info.value) and "3 attempts" in str(info.value)

    assert len(run_with_stub(test).completions) == 3


def test_never_retries_a_4xx():
    async def test(stub: StubVLLM, url: str) -> None:
        stub.plan = [400]
        async with InferenceClient(url, max_retries=5, backoff_s=0.001) as client:
            with pytest.raises(InferenceHTTPError) as info:
                await client.complete([1], SAMPLING)
        assert info.value.status == 400 and not info.value.retryable and not info.value.server_fault
        assert "scripted 400" in str(info.value)

    assert len(run_with_stub(test).completions) == 1


def test_timeout_is_typed_and_retried_within_the_bound():
    async def test(stub: StubVLLM, url: str) -> None:
        stub.plan = ["hang", "hang"]
        async with InferenceClient(url, timeout_s=0.2, max_retries=1, backoff_s=0.001) as client:
            with pytest.raises(InferenceTimeout) as info:
                await client.complete([1], SAMPLING)
        assert url in str(info.value)

    assert len(run_with_stub(test).completions) == 2


def test_connection_refused_is_a_typed_connection_error():
    with socket.socket() as s:  # a port nothing listens on once the socket closes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main() -> None:
        async with InferenceClient(f"http://127.0.0.1:{port}", max_retries=1, backoff_s=0.001) as client:
            with pytest.raises(InferenceConnectionError, match=f"127.0.0.1:{port}"):
                await client.complete([1], SAMPLING)
            assert await client.health() is False

    asyncio.run(main())


def test_mismatched_ids_and_logprobs_is_a_bad_response():
    async def test(stub: StubVLLM, url: str) -> None:
        stub.plan = ["mismatch"]
        async with InferenceClient(url) as client:
            with pytest.raises(InferenceBadResponse, match="3 token ids but 1 logprobs"):
                await client.complete([1], SAMPLING)

    run_with_stub(test)


def test_wrong_number_of_choices_is_a_bad_response():
    body = {"choices": [{"index": 0, "token_ids": [1], "logprobs": {"token_logprobs": [-1.0]}}]}
    with pytest.raises(InferenceBadResponse, match="n=2"):
        parse_completions(body, "http://x", n=2)
    with pytest.raises(InferenceBadResponse, match="token_ids"):
        parse_completions({"choices": [{"index": 0, "logprobs": {"token_logprobs": []}}]}, "http://x", n=1)


def test_load_parses_vllm_metrics_summing_over_engines():
    async def test(stub: StubVLLM, url: str) -> None:
        async with InferenceClient(url) as client:
            load = await client.load()
        assert load == ServerLoad(
            running=5.0, waiting=4.0, kv_cache_usage=0.5, prefix_cache_hits=250.0, prefix_cache_queries=1000.0
        )
        assert load.queued == 9.0
        assert load.prefix_cache_hit_rate == 0.25

    run_with_stub(test)


def test_the_load_read_from_the_lines_it_needs_is_the_load_of_the_whole_exposition():
    from prometheus_client.parser import text_string_to_metric_families

    from beam_rl.inference.parsing import load_lines
    from bench.cost.load_parse import vllm_like_metrics

    text = vllm_like_metrics()
    assert parse_server_load(text) == ServerLoad(running=9.0, waiting=6.0, kv_cache_usage=0.5, prefix_cache_hits=120.0,
                                                 prefix_cache_queries=300.0, preemptions=3.0)
    kept = load_lines(text)
    assert len(kept.splitlines()) == 12 and "peak" not in kept and "_created" not in kept
    # The same sums as a parse of every line, which is what the dispatcher read before.
    everything = {s.name: 0.0 for f in text_string_to_metric_families(text) for s in f.samples}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            everything[sample.name] += sample.value
    assert parse_server_load(text).running == everything["vllm:num_requests_running"]
    assert parse_server_load(text).prefix_cache_queries == everything["vllm:prefix_cache_queries_total"]
    with pytest.raises(ValueError):
        parse_server_load('vllm:num_requests_running{engine="0"} not-a-number\n')


def test_missing_metrics_read_as_zero_counts_and_none_fractions():
    load = parse_server_load("# TYPE other gauge\nother 1.0\n")
    assert load == ServerLoad(
        running=0.0, waiting=0.0, kv_cache_usage=None, prefix_cache_hits=None, prefix_cache_queries=None
    )
    assert load.prefix_cache_hit_rate is None


def test_health_and_control_endpoints():
    async def test(stub: StubVLLM, url: str) -> None:
        async with InferenceClient(url) as client:
            assert await client.health() is True
            stub.healthy = False
            assert await client.health() is False
            await client.pause()
            await client.reload_weights("/runs/r/weights/step_3")
            await client.resume()

    stub = run_with_stub(test)
    assert stub.posts == [
        ("/pause", {}, {"mode": "keep"}),
        (
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": "/runs/r/weights/step_3"}},
            {},
        ),
        ("/resume", {}, {}),
    ]


def test_hundreds_of_concurrent_requests_share_one_client():
    # The stub holds every request until 256 are inside it at once: this only completes if the
    # client's connection pool lets them all through together (httpx's default allows 100).
    async def test(stub: StubVLLM, url: str) -> None:
        stub.barrier = (256, asyncio.Event())
        async with InferenceClient(url, timeout_s=30) as client:
            results = await asyncio.gather(*(client.complete([i], SAMPLING) for i in range(256)))
        assert len(results) == 256

    stub = run_with_stub(test)
    assert stub.peak_concurrent == 256


def _answer(token_ids, logprobs) -> dict:
    return {"choices": [{"index": 0, "token_ids": token_ids, "logprobs": {"token_logprobs": logprobs},
                         "finish_reason": "stop"}]}


def test_well_formed_ids_and_logprobs_are_taken_as_parsed():
    ids, logprobs = [5, 6], [-0.5, -1.0]
    (completion,) = parse_completions(_answer(ids, logprobs), "http://s", 1)
    assert completion.token_ids == [5, 6] and completion.logprobs == [-0.5, -1.0]
    # Integral logprobs (JSON `0`) and numeric strings are converted; anything else is a bad answer.
    (completion,) = parse_completions(_answer(["7", 8], [0, -1.5]), "http://s", 1)
    assert completion.token_ids == [7, 8] and completion.logprobs == [0.0, -1.5]
    assert all(type(lp) is float for lp in completion.logprobs)
    for token_ids, lps in (([1, "x"], [-1.0, -1.0]), ([1, None], [-1.0, -1.0]), ([1, 2], [-1.0, "y"])):
        with pytest.raises(InferenceBadResponse, match="non-numeric token id or logprob"):
            parse_completions(_answer(token_ids, lps), "http://s", 1)


# -- streaming, partial completions, continuation ---------------------------------------------------------


def test_a_streamed_completion_is_assembled_token_by_token_with_its_versions_and_progress():
    async def test(stub: StubVLLM, url: str) -> None:
        progress = Progress()
        async with InferenceClient(url, stream=True, version=4) as client:
            (completion,) = await client.complete([1, 2], SAMPLING, progress=progress)
        assert completion.token_ids == [30, 31, 32, 33, 34, 35, 36] and completion.finish_reason == "length"
        assert completion.logprobs == [-i / 10 for i in range(7)] and completion.policy_versions == [4] * 7
        assert progress.tokens == [7] and progress.oldest_version == 4 and progress.first_token_at > 0

    (body,) = run_with_stub(test).completions
    assert body["stream"] is True and body["cache_salt"] == "policy-v4"


def test_a_stream_read_in_ragged_pieces_gives_the_same_completion():
    async def test(stub: StubVLLM, url: str) -> None:
        stub.plan = ["ragged"]
        async with InferenceClient(url, stream=True, version=2) as client:
            (completion,) = await client.complete([1, 2], SAMPLING)
        assert completion.token_ids == [30, 31, 32, 33, 34, 35, 36] and completion.finish_reason == "length"
        assert completion.logprobs == [-i / 10 for i in range(7)] and completion.policy_versions == [2] * 7

    run_with_stub(test)


def test_a_stream_cut_mid_way_fails_with_its_tokens_and_continues_from_them():
    async def test(stub: StubVLLM, url: str) -> None:
        stub.plan = ["cut"]
        async with InferenceClient(url, stream=True, max_retries=0) as client:
            with pytest.raises(InferenceConnectionError, match="mid-stream") as info:
                await client.complete([1, 2], SAMPLING)
            (partial,) = info.value.partial
            assert partial.token_ids == [30, 31] and partial.finish_reason is None
            assert info.value.server_fault  # a dead server: the dispatcher moves the rollout elsewhere
            # Here or on another server: the prompt grows by what came, and max_tokens shrinks by as much.
            (completion,) = await client.complete([1, 2], SAMPLING, partial=info.value.partial)
        assert completion.token_ids == [30, 31, 30, 31, 32, 33, 34] and completion.finish_reason == "length"
        assert completion.logprobs[:3] == [0.0, -0.1, 0.0]

    first, second = run_with_stub(test).completions
    assert (first["prompt"], first["max_tokens"]) == ([1, 2], 7)
    assert (second["prompt"], second["max_tokens"]) == ([1, 2, 30, 31], 5)


def test_retries_continue_from_the_tokens_already_streamed():
    async def test(stub: StubVLLM, url: str) -> None:
        stub.plan = ["cut"]
        async with InferenceClient(url, stream=True, max_retries=1, backoff_s=0.001) as client:
            (completion,) = await client.complete([1, 2], SAMPLING)
        assert completion.token_ids == [30, 31, 30, 31, 32, 33, 34] and completion.finish_reason == "length"

    first, second = run_with_stub(test).completions
    assert (second["prompt"], second["max_tokens"]) == ([1, 2, 30, 31], 5)


def test_an_abort_this_client_did_not_cause_is_continued_then_raised_with_its_tokens():
    async def test(stub: StubVLLM, url: str) -> None:
        stub.plan = ["abort", "abort"]
        async with InferenceClient(url, max_retries=1, backoff_s=0.001) as client:
            with pytest.raises(InferenceAborted, match="not paused by this client") as info:
                await client.complete([1], SAMPLING)
        assert info.value.partial[0].token_ids == [4, 4] and not info.value.server_fault

    first, second = run_with_stub(test).completions
    assert (second["prompt"], second["max_tokens"]) == ([1, 4], 6)


def test_group_choices_are_continued_one_request_each_with_their_own_seed():
    async def test(stub: StubVLLM, url: str) -> None:
        partial = [Completion([5], [-0.1], None, [0]), Completion([6, 7], [-0.1, -0.2], "stop", [0, 0]),
                   Completion([], [], None, [])]
        async with InferenceClient(url) as client:
            done = await client.complete([1], SAMPLING, n=3, partial=partial)
        assert [c.token_ids for c in done] == [[5, 1, 2], [6, 7], [1, 2]]  # the finished one is kept as it was
        assert [c.policy_versions for c in done] == [[0, 0, 0], [0, 0], [0, 0]]

    bodies = run_with_stub(test).completions
    assert sorted((b["prompt"], b["n"], b["max_tokens"], b["seed"]) for b in bodies) == [
        ([1], 1, 7, 1234 + 2), ([1, 5], 1, 6, 1234)]


# -- API keys --------------------------------------------------------------------------------------------


def test_the_api_key_goes_in_the_authorization_header_and_never_in_a_message():
    async def test(stub: StubVLLM, url: str) -> None:
        async with InferenceClient(url, api_key="s3cret-key") as client:
            await client.complete([1], SAMPLING)
            stub.plan = [401]
            with pytest.raises(InferenceAuthError) as info:
                await client.complete([1], SAMPLING)
            assert "s3cret-key" not in str(info.value) + repr(client)
            assert not info.value.retryable  # one refused key is not worth a stream of retries

    stub = run_with_stub(test)
    assert stub.headers[0]["Authorization"] == "Bearer s3cret-key" and len(stub.completions) == 2


def test_weight_version_spans_replace_the_stamps_of_the_tokens_this_request_brought():
    # Two tokens came from an earlier request; this one (a continuation, its tokens stamped unknown while
    # it ran) ends with vLLM's spans, which count from its own first token.
    choice = Completion([7, 8], [-0.1, -0.2], None, [3, 3])
    labels = {"default": 0, "4": 4}
    request = LiveRequest([choice], [0], UNKNOWN_VERSION, 3, True, label_version=labels.__getitem__)

    def bad(reason: str) -> InferenceBadResponse:
        return InferenceBadResponse(reason, "http://server")

    def chunk(tokens: list[int], **fields) -> dict:
        content = [{"token_id": t, "logprob": -1.0, "top_logprobs": []} for t in tokens]
        return {"choices": [{"index": 0, "token_ids": tokens, "logprobs": {"content": content}, **fields}]}

    request.add_chunk(chunk([1, 2]), bad)
    assert choice.policy_versions == [3, 3, UNKNOWN_VERSION, UNKNOWN_VERSION]
    spans = [{"version": "default", "start": 0, "end": 1}, {"version": "4", "start": 1, "end": 3}]
    request.add_chunk(chunk([5], finish_reason="length", weight_versions=spans), bad)
    assert choice.token_ids == [7, 8, 1, 2, 5] and choice.logprobs == [-0.1, -0.2, -1.0, -1.0, -1.0]
    assert choice.policy_versions == [3, 3, 0, 4, 4] and choice.finish_reason == "length"
    # A span past the tokens it came with is a broken answer, not a guess.
    with pytest.raises(InferenceBadResponse, match="outside its 1 tokens"):
        other = LiveRequest([Completion([], [], None)], [0], 0, 0, True, label_version=labels.__getitem__)
        other.add_chunk(chunk([9], finish_reason="stop", weight_versions=[{"version": "4", "start": 0, "end": 2}]),
                        bad)


def test_a_load_refused_on_the_generate_route_gives_the_old_weights_their_label_back(tmp_path):
    """Label and load go at once while paused: when the load fails, the label set beside it must not
    name the old weights as the new version once they sample again."""
    from beam_rl.standin.server import EmbeddedServer
    from beam_rl.model.tiny import tiny_model_dir

    server = EmbeddedServer(tiny_model_dir(), mode="instant")
    server.start()

    async def main() -> None:
        async with InferenceClient(server.url, route="generate") as client:
            await client.update_weights(tiny_model_dir(), 1, "keep")
            assert await client.weight_version() == "1"
            with pytest.raises(InferenceHTTPError) as refused:
                await client.update_weights(tmp_path, 2, "keep")  # no weights there
            assert refused.value.status == 400
            assert await client.weight_version() == "1"
            (choice,) = await client.complete([5, 6, 7], SamplingParams(max_tokens=4))
            assert len(choice.token_ids) == 4 and choice.policy_versions == [1] * 4  # resumed

    try:
        asyncio.run(main())
        assert server.backend.weights.loads == 1
    finally:
        server.stop()


@pytest.mark.parametrize(("route", "mode", "stream", "held"), [
    ("generate", "keep", False, False), ("generate", "continue", False, False),
    ("completions", "continue", True, False), ("completions", "continue", False, True),
    ("completions", "keep", True, True)])
def test_a_busy_requests_loop_holds_the_server_paused_only_to_read_what_came_before(monkeypatch, route, mode, stream,
                                                                                   held):
    """The requests' loop stops for 0.5 s just after the pause is answered (as when hundreds of streams end
    at once). The pause, the load and the resume run on a loop of their own, so the server is paused for a
    moment. On the completions route, keep waits for the streams to drain on the requests' loop, and so
    does continue for answers that are not streamed (docs/weight-updates.md, "Where the pause runs")."""
    from beam_rl.standin.server import EmbeddedServer
    from beam_rl.model.tiny import tiny_model_dir

    server = EmbeddedServer(tiny_model_dir(), mode="instant")
    server.start()
    pause = InferenceClient.pause

    async def pause_then_stall_the_requests_loop(self: InferenceClient, mode: str = "keep") -> None:
        await pause(self, mode)
        requests_loop.call_soon_threadsafe(time.sleep, 0.5)

    monkeypatch.setattr(InferenceClient, "pause", pause_then_stall_the_requests_loop)

    async def main() -> None:
        nonlocal requests_loop
        requests_loop = asyncio.get_running_loop()
        async with InferenceClient(server.url, route=route, stream=stream) as client:
            await client.update_weights(tiny_model_dir(), 1, mode)
            assert await client.weight_version() == "1"
            (choice,) = await client.complete([5, 6, 7], SamplingParams(max_tokens=4))
            assert choice.policy_versions == [1] * 4

    requests_loop: asyncio.AbstractEventLoop | None = None
    try:
        asyncio.run(main())
        assert server.backend.weights.loads == 1
        paused_s = server.gate.paused_seconds
    finally:
        server.stop()
    assert (paused_s >= 0.5) == held, paused_s


@pytest.mark.parametrize("mode", ["keep", "continue"])
def test_requests_held_back_by_an_update_go_out_in_the_first_pass_after_the_resume(monkeypatch, mode):
    """The server samples nothing from the pause to its resume; requests that would only queue are held back
    meanwhile (continue's continuations among them). Every pass of a busy requests' loop costs the engine
    time, so they are released from the pause's loop at the resume's answer, not a chain of passes later:
    the pause's thread, once the resume has answered, hands the release to the requests' loop itself, and the
    held request goes out in the pass after the one that runs it. Asserted as that order of events, which
    holds however late the OS schedules either thread on a busy machine."""
    from beam_rl.standin.server import EmbeddedServer
    from beam_rl.model.tiny import tiny_model_dir

    server = EmbeddedServer(tiny_model_dir(), mode="instant")
    server.start()
    passes, resumed, handed, ran, released = 0, [], [], [], []
    resume, update_finished = InferenceClient.resume, InferenceClient._update_finished

    async def counted_resume(self: InferenceClient) -> None:
        await resume(self)
        resumed.append(threading.current_thread())

    async def counted_update_finished(self: InferenceClient) -> None:
        held = self._updates.over is not None and not self._updates.over.is_set()
        await update_finished(self)
        if held:
            released.append(passes)

    monkeypatch.setattr(InferenceClient, "resume", counted_resume)
    monkeypatch.setattr(InferenceClient, "_update_finished", counted_update_finished)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        call_soon_threadsafe = loop.call_soon_threadsafe

        def traced(callback, *args, **kwargs):  # what another thread hands this loop
            if isinstance(getattr(callback, "__self__", None), asyncio.Event):
                handed.append((threading.current_thread(), list(resumed)))
                release = callback

                def callback(*a):
                    ran.append(passes)
                    release(*a)

            return call_soon_threadsafe(callback, *args, **kwargs)

        loop.call_soon_threadsafe = traced  # type: ignore[method-assign]

        def busy_pass() -> None:  # one callback per pass of the loop, each pass 5 ms long
            nonlocal passes
            passes += 1
            time.sleep(0.005)
            loop.call_soon(busy_pass)

        async with InferenceClient(server.url, stream=True) as client:
            busy_pass()
            updating = asyncio.ensure_future(client.update_weights(tiny_model_dir(), 1, mode))
            await asyncio.sleep(0)  # the update has begun: what is sent now waits for its resume
            (choice,) = await client.complete([5, 6, 7], SamplingParams(max_tokens=4))
            await updating
        assert choice.policy_versions == [1] * 4
        # The release was handed over once, by the thread whose resume had answered, and only after it had.
        ((by, resumes_by_then),) = handed
        assert by is not threading.main_thread() and resumes_by_then == [by]
        assert len(ran) == 1 and len(released) == 1
        assert released[0] - ran[0] <= 1, (ran, released)

    try:
        asyncio.run(main())
    finally:
        server.stop()


@pytest.mark.parametrize(("url", "local"), [
    ("http://127.0.0.1:8000", True), ("http://127.9.9.9:8000/", True), ("http://localhost:8000", True),
    ("http://[::1]:8000", True), ("http://10.1.2.3:8000", False), ("https://vllm.example.com", False),
    ("http://[2001:db8::1]:8000", False)])
def test_a_server_on_this_machine_is_told_by_its_address(url, local):
    assert is_loopback(urlsplit(url).hostname or "") is local


@pytest.mark.parametrize("on_this_machine", [True, False])
def test_the_drains_quiet_is_a_margin_for_servers_across_a_network(on_this_machine):
    """A server answers a keep pause once it has sent every token sampled before it: one on this machine has
    put them in the client's sockets by then, one across a network may still have some on their way."""
    from beam_rl.standin.server import EmbeddedServer
    from beam_rl.model.tiny import tiny_model_dir

    server = EmbeddedServer(tiny_model_dir(), mode="instant")
    server.start()

    async def main() -> None:
        async with InferenceClient(server.url, stream=True) as client:
            client._on_this_machine = on_this_machine  # as if the same server were elsewhere
            await client.update_weights(tiny_model_dir(), 1, "keep", drain_quiet_s=0.5)
            (choice,) = await client.complete([5, 6, 7], SamplingParams(max_tokens=4))
            assert choice.policy_versions == [1] * 4

    try:
        asyncio.run(main())
        paused_s = server.gate.paused_seconds
    finally:
        server.stop()
    assert (paused_s >= 0.5) != on_this_machine, paused_s


def test_a_drain_waits_for_bytes_its_loop_has_read_but_the_stream_has_not_yet_taken():
    """The loop reads its sockets at the start of a pass and wakes each stream's reader to take what it read in
    the next: a drain's timer running after such a read, in a long quiet, must wait for that reader."""

    async def test(stub: StubVLLM, url: str) -> None:
        stub.plan = ["held"]
        async with InferenceClient(url, stream=True, version=2) as client:
            completing = asyncio.ensure_future(client.complete([1, 2], SAMPLING))
            while not any(r.choices[0].token_ids for r in client._live):
                await asyncio.sleep(0.005)
            (request,) = client._live
            drained = concurrent.futures.Future()
            token = {"choices": [{"index": 0, "token_ids": [77], "logprobs": {"token_logprobs": [-0.7]},
                                  "finish_reason": None}]}

            def read_then_timer() -> None:  # one pass of the loop
                # As the protocol of its socket does with what a read brought:
                request.body.feed_data(b"data: " + json.dumps(token).encode() + b"\n\n")
                now = time.monotonic()
                request.last_data_at = now - 1.0  # quiet for a second, as far as the stream has taken
                client._updates.check_drained(drained, 0.05, now - 1.0, now + 5.0)

            asyncio.get_running_loop().call_soon(read_then_timer)
            await asyncio.sleep(0.01)
            assert not drained.done() and request.choices[0].token_ids == [30, 77]
            await asyncio.wrap_future(drained)  # once quiet again
            stub.release.set()
            (completion,) = await completing
        assert completion.token_ids == [30, 77, 31, 32, 33, 34, 35, 36]

    run_with_stub(test)


def test_tails_read_after_a_continue_update_keep_the_version_that_sampled_them(monkeypatch):
    """A continue update while the requests' loop is busy: tokens sampled before the pause are read only after
    the load, when what arrives may come from either side of it. A request the pause aborted, and one that
    finished just before it (it had tokens before the resume), were sampled before: their tokens say so."""
    from beam_rl.standin.faults import FaultConfig
    from beam_rl.standin.server import EmbeddedServer
    from beam_rl.model.tiny import tiny_model_dir
    from tests.support.server_helpers import metrics, served_versions

    server = EmbeddedServer(tiny_model_dir(), faults=FaultConfig(step_delay_s=0.02))
    server.start()
    pause, resume = InferenceClient.pause, InferenceClient.resume
    stalled, released, stall_over, resumed_while_stalled = threading.Event(), threading.Event(), threading.Event(), []

    def stall() -> None:
        stalled.set()
        released.wait(30)  # till the update is over: a pause or resume that waits for this loop would hang
        stall_over.set()

    async def stall_the_requests_loop_then_pause(self: InferenceClient, mode: str = "keep") -> None:
        requests_loop.call_soon_threadsafe(stall)
        # Tokens pile up unread; the server finishes the short request meanwhile (one left running).
        while not stalled.is_set() or (await asyncio.to_thread(metrics, server.url))["vllm:num_requests_running"] > 1:
            await asyncio.sleep(0.01)
        await pause(self, mode)

    async def resume_then_release(self: InferenceClient) -> None:
        await resume(self)
        resumed_while_stalled.append(not stall_over.is_set())
        released.set()

    monkeypatch.setattr(InferenceClient, "pause", stall_the_requests_loop_then_pause)
    monkeypatch.setattr(InferenceClient, "resume", resume_then_release)

    async def main() -> list[tuple[list[int], list[int]]]:
        nonlocal requests_loop
        requests_loop = asyncio.get_running_loop()
        long, short = Progress(), Progress()
        async with InferenceClient(server.url, stream=True, extra_body={"return_weight_versions": True, "ignore_eos": True}) as client:
            with served_versions() as served:
                generating = [asyncio.ensure_future(client.complete(
                    [5, 6, 7], SamplingParams(max_tokens=max_tokens), progress=progress))
                    for max_tokens, progress in ((64, long), (6, short))]
                while long.total < 2 or short.total < 2:
                    await asyncio.sleep(0.005)
                await client.update_weights(tiny_model_dir(), 1, "continue")
                choices = [choice for request in generating for choice in await request]
        assert resumed_while_stalled == [True]  # the update did not wait for the requests' loop
        return [(c.policy_versions, served[id(c.policy_versions)]) for c in choices]

    requests_loop: asyncio.AbstractEventLoop | None = None
    try:
        (long_recorded, long_truth), (short_recorded, short_truth) = asyncio.run(main())
    finally:
        released.set()
        server.stop()
    assert long_truth.count(0) >= 4 and long_truth.count(1) > 0 and long_truth == sorted(long_truth), long_truth
    assert short_truth == [0] * 6
    assert (long_recorded, short_recorded) == (long_truth, short_truth)


def test_a_choice_the_server_ends_is_told_once_and_one_a_pause_aborts_is_not():
    """What frees a group call's permit early (Dispatcher._choice_ended): each choice's first stop or length,
    by its index in the caller's choices; an abort (a continue-mode pause: the choice will be sent again) is
    not an end."""
    from beam_rl.inference.inflight import ABORT, Progress

    ended: list[int] = []
    progress = Progress(3, on_choice_end=ended.append)
    request = LiveRequest([Completion([], [], None), Completion([], [], None)], [2, 0], 0, 0, True, progress=progress)
    request.add(0, [5], [-0.1], None)
    request.add(1, [6], [-0.1], ABORT)
    assert ended == []
    request.add(0, [7], [-0.1], "stop")
    request.add(1, [8], [-0.1], "length")
    request.add(0, [], [], "stop")  # told again: not a second end
    assert ended == [2, 0]
