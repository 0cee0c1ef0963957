"""The embedded server's three backends (model, instant, simulated) behind one HTTP API, over real
loopback HTTP: vLLM 0.32's pause modes, the weights version of every token across a reload that
lands mid-request, streamed completions, and cache_salt.

Tokens are seeded, so a request interrupted (paused, aborted) is compared token for token with the
same request run undisturbed. `vllm:generation_tokens_total` counts tokens as they are sampled: it
says exactly how far a request had got when a pause returned.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from beam_rl.standin.server import EmbeddedServer, FaultConfig
from beam_rl.standin.simulated import SimulatedParams
from beam_rl.model.tiny import tiny_model_dir
from tests.support.server_helpers import metrics, parse_metrics, sse_data, wait_for_metrics

pytestmark = pytest.mark.timeout(120)

BACKENDS = ["model", "instant", "simulated"]
STEP_S = 0.02  # every decode step takes at least this long, so requests are caught mid-generation
PROMPT = [1, 396, 201, 19, 20, 264, 223, 25, 2, 201, 1, 67, 474, 201]
MAX_TOKENS = 24  # at STEP_S a request runs ~0.5 s: pauses and reloads land well inside it
REQUEST = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "seed": 7, "ignore_eos": True, "logprobs": 0,
           "return_token_ids": True, "return_weight_versions": True}
GENERATED = "vllm:generation_tokens_total"


@pytest.fixture(scope="module")
def other_weights(cache_dir):
    return tiny_model_dir(1, cache_dir=cache_dir)


@pytest.fixture
def start(model_dir, start_embedded):
    """start(backend, slow=True, **kwargs): a started server; slow ones take >= STEP_S per step."""
    def make(backend: str, slow: bool = True, **kwargs) -> EmbeddedServer:
        if backend == "simulated":
            # ignore_eos and no stop ids: every choice runs to max_tokens, like the other backends.
            step = STEP_S if slow else 0.001
            kwargs["simulated"] = SimulatedParams(decode_base_s=step, decode_s_per_seq=0.0, prefill_s_per_token=0.0)
        elif slow:
            kwargs["faults"] = FaultConfig(step_delay_s=STEP_S)
        return start_embedded(model_dir if backend == "model" else None, mode=backend, **kwargs)

    return make


def complete(s: EmbeddedServer, **payload) -> dict:
    response = httpx.post(s.url + "/v1/completions", json=payload, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def generated(s: EmbeddedServer) -> int:
    return int(metrics(s.url)[GENERATED])


async def generated_async(client: httpx.AsyncClient, s: EmbeddedServer) -> int:
    return int(parse_metrics((await client.get(s.url + "/metrics")).text)[GENERATED])


def reload(s: EmbeddedServer, path) -> None:
    body = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
    assert httpx.post(s.url + "/collective_rpc", json=body, timeout=30).status_code == 200


def only_choice(body: dict) -> dict:
    (choice,) = body["choices"]
    return choice


# -- pause modes ---------------------------------------------------------------------------------


def reference_and_base(s) -> tuple[list[int], float]:
    """The tokens REQUEST gets from an undisturbed server, and the server's generated-token count after."""
    return only_choice(complete(s, **REQUEST))["token_ids"], generated(s)


async def running_request(client: httpx.AsyncClient, s, base: float) -> asyncio.Task:
    """REQUEST in flight, once the server has sampled 3 of its tokens."""
    request = asyncio.create_task(client.post(s.url + "/v1/completions", json=REQUEST))
    await wait_for_metrics(s.url, lambda m: m[GENERATED] >= base + 3)
    return request


@pytest.mark.parametrize("backend", BACKENDS)
def test_pause_keep_freezes_running_requests_and_resume_continues_them(start, backend):
    s = start(backend)
    reference, base = reference_and_base(s)

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as client:
            request = await running_request(client, s, base)
            assert (await client.post(s.url + "/pause?mode=keep")).status_code == 200
            frozen = await generated_async(client, s)
            await asyncio.sleep(10 * STEP_S)  # ten steps' time: a running engine would sample ten tokens
            still = await generated_async(client, s)
            in_flight = not request.done()
            await client.post(s.url + "/resume")
            return frozen, still, in_flight, await request

    frozen, still, in_flight, response = asyncio.run(scenario())
    assert in_flight and frozen == still and base + 3 <= frozen < base + MAX_TOKENS
    choice = only_choice(response.json())
    assert choice["token_ids"] == reference and choice["finish_reason"] == "length"


@pytest.mark.parametrize("backend", BACKENDS)
def test_pause_wait_returns_once_running_requests_finished_and_queues_new_ones(start, backend):
    s = start(backend)
    reference, base = reference_and_base(s)

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as client:
            running = await running_request(client, s, base)
            assert (await client.post(s.url + "/pause?mode=wait")).status_code == 200
            at_pause = metrics(s.url)
            queued = asyncio.create_task(client.post(s.url + "/v1/completions", json={**REQUEST, "seed": 8}))
            await wait_for_metrics(s.url, lambda m: m["vllm:num_requests_waiting"] == 1)
            queued_while_paused = not queued.done()
            await client.post(s.url + "/resume")
            return at_pause, queued_while_paused, await running, await queued

    at_pause, queued_while_paused, running, queued = asyncio.run(scenario())
    # When the pause returned, the running request had sampled all its tokens.
    assert at_pause["vllm:num_requests_running"] == 0 and at_pause[GENERATED] == base + MAX_TOKENS
    assert only_choice(running.json())["token_ids"] == reference
    assert queued_while_paused
    assert queued.status_code == 200 and len(only_choice(queued.json())["token_ids"]) == MAX_TOKENS


@pytest.mark.parametrize("backend", BACKENDS)
def test_pause_abort_answers_running_and_queued_requests_with_their_tokens_so_far(start, backend):
    s = start(backend, max_num_seqs=1)
    reference, base = reference_and_base(s)

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as client:
            running = await running_request(client, s, base)  # running before the other is sent: one slot
            queued = asyncio.create_task(client.post(s.url + "/v1/completions", json={**REQUEST, "seed": 8}))
            await wait_for_metrics(s.url, lambda m: m["vllm:num_requests_waiting"] == 1)
            assert (await client.post(s.url + "/pause?mode=abort")).status_code == 200
            after = metrics(s.url)
            answers = await asyncio.gather(running, queued)
            await client.post(s.url + "/resume")
            return after, answers

    after, (running, queued) = asyncio.run(scenario())
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    partial = only_choice(running.json())
    sampled = int(after[GENERATED]) - base
    # vLLM 0.32: HTTP 200, finish_reason "abort", and exactly the tokens sampled before the abort.
    assert running.status_code == 200 and partial["finish_reason"] == "abort"
    assert 3 <= sampled < MAX_TOKENS and partial["token_ids"] == reference[:sampled]
    assert partial["token_weight_versions"] == [0] * sampled
    assert len(partial["logprobs"]["token_logprobs"]) == sampled
    assert queued.status_code == 200
    assert (only_choice(queued.json())["token_ids"], only_choice(queued.json())["finish_reason"]) == ([], "abort")
    assert len(only_choice(complete(s, **REQUEST))["token_ids"]) == MAX_TOKENS  # resumed: serves again


# -- weights versions per token --------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_reload_under_pause_keep_splits_a_request_exactly_where_it_was_frozen(start, backend, model_dir, other_weights):
    s = start(backend)
    reference, base = reference_and_base(s)

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as client:
            request = await running_request(client, s, base)
            await client.post(s.url + "/pause?mode=keep")
            before_reload = await generated_async(client, s) - base
            await asyncio.to_thread(reload, s, other_weights if backend == "model" else model_dir)
            await client.post(s.url + "/resume")
            return before_reload, await request

    k, response = asyncio.run(scenario())
    choice = only_choice(response.json())
    assert 3 <= k < MAX_TOKENS
    assert choice["token_weight_versions"] == [0] * k + [1] * (MAX_TOKENS - k)
    assert choice["token_ids"][:k] == reference[:k]
    assert httpx.get(s.url + "/v1/models").json()["data"][0]["weights_version"] == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_reload_lands_between_two_steps_of_a_running_request(start, backend, model_dir, other_weights):
    s = start(backend)
    reference, base = reference_and_base(s)

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as client:
            request = await running_request(client, s, base)
            before = await generated_async(client, s) - base
            await asyncio.to_thread(reload, s, other_weights if backend == "model" else model_dir)
            after = await generated_async(client, s) - base
            return before, after, await request

    before, after, response = asyncio.run(scenario())
    versions = only_choice(response.json())["token_weight_versions"]
    old = versions.count(0)
    # One switch, from 0 to 1, at a token sampled while the reload call was in flight.
    assert versions == [0] * old + [1] * (MAX_TOKENS - old)
    assert 3 <= before <= old <= after < MAX_TOKENS
    assert only_choice(response.json())["token_ids"][:old] == reference[:old]


def test_weight_versions_are_returned_only_when_asked(start):
    s = start("instant", slow=False)
    plain = only_choice(complete(s, prompt=PROMPT, max_tokens=3, return_token_ids=True))
    assert "token_weight_versions" not in plain  # the answer stays vLLM-shaped
    asked = only_choice(complete(s, prompt=PROMPT, max_tokens=3, return_weight_versions=True))
    assert asked["token_weight_versions"] == [0, 0, 0]


# -- streaming -------------------------------------------------------------------------------------


async def read_stream(client: httpx.AsyncClient, url: str, payload: dict, on_tokens=None) -> list:
    """The decoded events of a streamed completion; `on_tokens(total)` after every chunk."""
    lines, tokens = [], 0
    async with client.stream("POST", url + "/v1/completions", json={**payload, "stream": True}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            lines.append(line)
            if line.startswith("data: {") and on_tokens is not None:
                tokens += sum(len(c["token_ids"] or []) for c in sse_data([line])[0]["choices"])
                on_tokens(tokens)
    return sse_data(lines)


@pytest.mark.parametrize("backend", BACKENDS)
def test_streamed_chunks_reassemble_into_the_non_streamed_answer(start, backend):
    s = start(backend)
    payload = {**REQUEST, "n": 2, "logprobs": 2, "max_tokens": 10}
    whole = complete(s, **payload)

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as client:
            return await read_stream(client, s.url, {**payload, "stream_options": {"include_usage": True}})

    events = asyncio.run(scenario())
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    chunks = events[:-2]
    assert {c["id"] for c in chunks} == {usage["id"]} and all(c["object"] == "text_completion" for c in chunks)
    assert all(set(c) == {"id", "object", "created", "model", "choices"} and len(c["choices"]) == 1 for c in chunks)
    for index, expected in enumerate(whole["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert len(mine) == 10  # one token per step, one chunk per step
        assert [len(c["token_ids"]) for c in mine] == [1] * 10
        assert mine[0]["prompt_token_ids"] == PROMPT and all(c["prompt_token_ids"] is None for c in mine[1:])
        assert [c["finish_reason"] for c in mine] == [None] * 9 + [expected["finish_reason"]]
        assert mine[-1]["stop_reason"] == expected["stop_reason"]
        assert sum((c["token_ids"] for c in mine), []) == expected["token_ids"]
        assert sum((c["token_weight_versions"] for c in mine), []) == expected["token_weight_versions"]
        assert "".join(c["text"] for c in mine) == expected["text"]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert sum((c["logprobs"][key] for c in mine), []) == expected["logprobs"][key], key


@pytest.mark.parametrize("backend", BACKENDS)
def test_abort_mid_stream_keeps_the_partial_tokens(start, backend):
    s = start(backend, max_num_seqs=1)
    reference, base = reference_and_base(s)

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as client:
            three = asyncio.Event()
            running = asyncio.create_task(read_stream(client, s.url, REQUEST, lambda n: n >= 3 and three.set()))
            await three.wait()
            queued = asyncio.create_task(read_stream(client, s.url, {**REQUEST, "seed": 8}))
            await wait_for_metrics(s.url, lambda m: m["vllm:num_requests_waiting"] == 1)
            await client.post(s.url + "/pause?mode=abort")
            sampled = await generated_async(client, s) - base
            events = await asyncio.gather(running, queued)
            await client.post(s.url + "/resume")
            return sampled, events

    sampled, (running, queued) = asyncio.run(scenario())
    assert running[-1] == "[DONE]"
    *chunks, last = [e["choices"][0] for e in running[:-1]]
    tokens = sum((c["token_ids"] for c in chunks), [])
    assert 3 <= sampled < MAX_TOKENS and tokens == reference[:sampled]
    assert all(c["finish_reason"] is None for c in chunks)
    # The abort arrives as a last chunk with no new token, as vLLM streams it.
    assert (last["finish_reason"], last["token_ids"], last["text"]) == ("abort", [], "")
    assert queued == ["[DONE]"]  # aborted before its first token: vLLM sends no chunk for it


# -- cache_salt ------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_new_cache_salt_misses_the_prefix_cache(start, backend):
    s = start(backend, slow=False)
    prompt = list(range(3, 35))  # two full 16-token blocks, for the simulated block cache

    def hits_of(salt: str | None) -> int:
        before = metrics(s.url)["vllm:prefix_cache_hits_total"]
        extra = {} if salt is None else {"cache_salt": salt}
        complete(s, prompt=prompt, max_tokens=1, **extra)
        return int(metrics(s.url)["vllm:prefix_cache_hits_total"] - before)

    assert [hits_of(salt) for salt in (None, None, "v1", "v1", "v2", None)] == [0, 32, 0, 32, 0, 32]
