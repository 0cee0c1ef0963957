"""The embedded vLLM-compatible server, over real loopback HTTP: completions, metrics, admission,
weight reloads, pause/resume, fault injection (scripted replies and a server that dies mid-request
included), chat completions, instant mode and the subprocess launcher.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import re
import socket
import time

import httpx
import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from beam_rl.standin.faults import add_fault_args, fault_config_from_args
from beam_rl.standin.generator import Weights
from beam_rl.standin.responses import label_spans, visible_text
from beam_rl.standin.server import EmbeddedServer, FaultConfig, start_subprocess_server
from beam_rl.model.tiny import load_tiny_model, tiny_model_dir
from beam_rl.model.tokenizer import load_tokenizer
from tests.support.server_helpers import metrics, parse_metrics, sse_data, wait_for_metrics

PROMPT = [1, 396, 201, 19, 20, 264, 223, 25, 2, 201, 1, 67, 474, 201]  # a short ChatML-ish prompt


@pytest.fixture(scope="module")
def server(model_dir):
    with EmbeddedServer(model_dir) as s:
        yield s


@pytest.fixture
def make_server(model_dir, start_embedded):
    """Servers whose state a test may change (faults, pause, weights); stopped afterwards."""

    def make(**kwargs) -> EmbeddedServer:
        return start_embedded(kwargs.pop("model_dir", model_dir), **kwargs)

    return make


def post(s: EmbeddedServer, path: str = "/v1/completions", timeout: float = 30, **payload) -> httpx.Response:
    return httpx.post(s.url + path, json=payload, timeout=timeout)


def complete(s: EmbeddedServer, **payload) -> dict:
    payload = {"prompt": PROMPT, "max_tokens": 8, "logprobs": 0, "return_token_ids": True, **payload}
    response = post(s, **payload)
    assert response.status_code == 200, response.text
    return response.json()


def tokens_of(body: dict) -> list[list[int]]:
    return [c["token_ids"] for c in body["choices"]]


# Every decode step takes a while, so a request is reliably observed mid-generation.
SLOW_STEPS = FaultConfig(step_delay_s=0.02)


def reference_logprobs(model_dir, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """Logprobs of `tokens` from one full forward pass, with no KV cache: an independent check."""
    model = load_tiny_model(model_dir)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    logprobs = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
    return logprobs, logprobs[torch.arange(len(tokens)), torch.tensor(tokens)]


# -- completions -------------------------------------------------------------------------------


def test_completion_shape_and_logprobs_alignment(server):
    body = complete(server, n=1, temperature=1.0, seed=11, ignore_eos=True)
    assert body["object"] == "text_completion" and body["model"] == server.served_model_name
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 8
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 8
    assert lp["top_logprobs"] is None
    assert all(v <= 0 for v in lp["token_logprobs"])
    tokenizer = load_tokenizer("tiny")
    # The text is what vLLM's detokenizer emits: a trailing incomplete UTF-8 character is held back.
    assert choice["text"] == visible_text(tokenizer, choice["token_ids"], skip_special_tokens=True)
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True).startswith(choice["text"])
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    assert choice["prompt_token_ids"] == PROMPT
    assert body["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 8, "total_tokens": len(PROMPT) + 8}


def test_sampled_logprobs_match_a_full_forward_pass(server, model_dir):
    choice = complete(server, temperature=0.7, seed=5, ignore_eos=True)["choices"][0]
    _, expected = reference_logprobs(model_dir, PROMPT, choice["token_ids"], 0.7)
    assert torch.allclose(torch.tensor(choice["logprobs"]["token_logprobs"]), expected, atol=1e-4)


def test_greedy_picks_argmax_and_reports_unscaled_logprobs(server, model_dir):
    choice = complete(server, temperature=0.0, ignore_eos=True)["choices"][0]
    all_logprobs, expected = reference_logprobs(model_dir, PROMPT, choice["token_ids"], 0.0)
    assert choice["token_ids"] == all_logprobs.argmax(dim=-1).tolist()
    assert torch.allclose(torch.tensor(choice["logprobs"]["token_logprobs"]), expected, atol=1e-4)


def test_top_logprobs_include_the_sampled_token(server):
    choice = complete(server, logprobs=3, seed=2)["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["top_logprobs"]) == len(choice["token_ids"])
    for token, logprob, alternatives in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert alternatives[token] == pytest.approx(logprob)
        assert 1 <= len(alternatives) <= 4


def test_same_seed_same_tokens_different_seed_different(server):
    a = complete(server, n=2, seed=123, max_tokens=12)
    b = complete(server, n=2, seed=123, max_tokens=12)
    c = complete(server, n=2, seed=124, max_tokens=12)
    assert tokens_of(a) == tokens_of(b)
    assert [x["logprobs"]["token_logprobs"] for x in a["choices"]] == [x["logprobs"]["token_logprobs"] for x in b["choices"]]
    assert tokens_of(a) != tokens_of(c)


def test_n_choices_are_distinct_samples(server):
    body = complete(server, n=4, seed=9, max_tokens=8)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert len({tuple(t) for t in tokens_of(body)}) == 4
    assert body["usage"]["completion_tokens"] == sum(len(t) for t in tokens_of(body))


def test_stop_token_ends_choice_and_is_kept(server):
    first = complete(server, temperature=0.0, max_tokens=4)["choices"][0]["token_ids"]
    stop_at = first[2]
    choice = complete(server, temperature=0.0, max_tokens=4, stop_token_ids=[stop_at])["choices"][0]
    cut = first.index(stop_at) + 1
    assert choice["token_ids"] == first[:cut]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_at


def test_eos_stops_unless_ignored(make_server):
    s = make_server()
    first = complete(s, temperature=0.0, max_tokens=4)["choices"][0]["token_ids"][0]
    s.backend.generator.eos_token_ids = frozenset({first})  # pretend the greedy first token is EOS
    choice = complete(s, temperature=0.0, max_tokens=4)["choices"][0]
    assert (choice["token_ids"], choice["finish_reason"], choice["stop_reason"]) == ([first], "stop", None)
    ignored = complete(s, temperature=0.0, max_tokens=4, ignore_eos=True)["choices"][0]
    assert len(ignored["token_ids"]) == 4 and ignored["finish_reason"] == "length"


def test_defaults_follow_vllm(server):
    response = post(server, prompt=PROMPT, seed=1, ignore_eos=True)
    choice = response.json()["choices"][0]
    assert choice["token_ids"] is None and choice["logprobs"] is None  # only when asked for
    assert response.json()["usage"]["completion_tokens"] == 16  # max_tokens defaults to 16


def test_text_prompt_is_tokenized(server):
    text = "<|im_start|>user\nhi<|im_end|>\n"
    body = complete(server, prompt=text, max_tokens=2)
    assert body["usage"]["prompt_tokens"] == len(load_tokenizer("tiny").encode(text))


@pytest.mark.parametrize(
    "payload, fragment",
    [
        ({"prompt": [1, 512]}, "outside [0, 512)"),
        ({"prompt": []}, "empty"),
        ({"prompt": [5] * 1020, "max_tokens": 8}, "maximum context length is 1024"),
        ({"prompt": PROMPT, "n": 0}, "invalid completion request"),
        ({"prompt": PROMPT, "echo": True}, "not supported"),
        ({"prompt": PROMPT, "stream_options": {"include_usage": True}}, "only be defined when `stream=True`"),
        ({"prompt": PROMPT, "cache_salt": ""}, "invalid completion request"),
        ({"prompt": PROMPT, "top_p": 0.5}, "not supported"),
        ({"prompt": "x", "max_tokens": "many"}, "invalid completion request"),
    ],
)
def test_bad_requests_are_400(server, payload, fragment):
    response = post(server, **payload)
    assert response.status_code == 400
    assert fragment in response.json()["error"]["message"]


def test_model_name_enforced_only_when_given(make_server, server):
    assert post(server, prompt=PROMPT, max_tokens=1, model="anything").status_code == 200
    strict = make_server(served_model_name="policy")
    assert post(strict, prompt=PROMPT, max_tokens=1, model="policy").status_code == 200
    response = post(strict, prompt=PROMPT, max_tokens=1, model="other")
    assert response.status_code == 404 and "does not exist" in response.json()["error"]["message"]
    assert httpx.get(strict.url + "/v1/models").json()["data"][0]["id"] == "policy"


# -- metrics and admission ---------------------------------------------------------------------


def test_metrics_while_a_request_is_in_flight(make_server):
    s = make_server(kv_cache_tokens=160, faults=SLOW_STEPS)  # 10 blocks of 16 tokens
    prompt = list(range(3, 23))  # 20 tokens: 2 blocks per sequence until 12 generated, then 3

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as client:
            request = asyncio.create_task(
                client.post(s.url + "/v1/completions", json={"prompt": prompt, "n": 2, "max_tokens": 16, "ignore_eos": True})
            )
            during = await wait_for_metrics(s.url, lambda m: m["vllm:kv_cache_usage_perc"] > 0)
            assert (await request).status_code == 200
            return during

    during = asyncio.run(scenario())
    assert during["vllm:num_requests_running"] == 2  # sequences: n=2
    assert during["vllm:num_requests_waiting"] == 0
    assert during["vllm:kv_cache_usage_perc"] in (pytest.approx(0.4), pytest.approx(0.6))
    after = metrics(s.url)
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0
    assert after["beam_rl:requests_total"] == 1
    assert after["beam_rl:max_concurrent_requests"] == 2
    assert after["vllm:generation_tokens_total"] == 32 and after["vllm:prompt_tokens_total"] == 20


def test_prefix_cache_counts_repeated_prompts(make_server):
    s = make_server()
    complete(s, max_tokens=1)
    complete(s, max_tokens=1, n=3)
    complete(s, max_tokens=1, prompt=PROMPT[:5])
    m = metrics(s.url)
    assert m["vllm:prefix_cache_queries_total"] == 2 * len(PROMPT) + 5
    assert m["vllm:prefix_cache_hits_total"] == len(PROMPT)  # only the second request was seen before


def test_requests_beyond_max_num_seqs_wait(make_server):
    s = make_server(max_num_seqs=2, faults=FaultConfig(latency_s=0.5))

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as client:
            requests = [
                asyncio.create_task(client.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}))
                for _ in range(5)
            ]
            queued = await wait_for_metrics(s.url, lambda m: m["vllm:num_requests_waiting"] > 0)
            return queued, await asyncio.gather(*requests)

    queued, responses = asyncio.run(scenario())
    assert queued["vllm:num_requests_running"] == 2
    assert all(r.status_code == 200 for r in responses)
    after = metrics(s.url)
    assert after["beam_rl:max_concurrent_requests"] == 2
    assert after["vllm:num_requests_waiting"] == 0 and after["beam_rl:requests_total"] == 5


# -- weights and pause -------------------------------------------------------------------------


def reload(s: EmbeddedServer, path) -> httpx.Response:
    return post(s, "/collective_rpc", method="reload_weights", kwargs={"weights_path": str(path)})


def test_reload_weights_changes_generations(make_server, cache_dir):
    s = make_server()
    # Seeded sampling, not greedy: a random-init tied-embedding model greedily repeats its last token.
    sampled = {"temperature": 1.0, "seed": 3, "max_tokens": 8, "ignore_eos": True}
    before = tokens_of(complete(s, **sampled))
    other = tiny_model_dir(1, cache_dir=cache_dir)
    response = reload(s, other)
    assert response.status_code == 200 and response.json()["results"][0]["weights_version"] == 1
    after = tokens_of(complete(s, **sampled))
    assert after != before
    assert after == tokens_of(complete(make_server(model_dir=other), **sampled))  # same as serving seed 1
    assert httpx.get(s.url + "/v1/models").json()["data"][0]["weights_version"] == 1
    assert metrics(s.url)["beam_rl:weights_version"] == 1


def test_weight_version_label_is_reported_as_set_and_refused_when_malformed(make_server):
    s = make_server(mode="instant")
    assert httpx.get(s.url + "/weight_info").json() == {"weight_version": "default"}  # vLLM's initial label
    answer = httpx.post(s.url + "/update_weight_version", json={"new_version": "7"})
    assert answer.status_code == 200 and answer.json() == {"success": True, "new_version": "7"}
    assert httpx.get(s.url + "/weight_info").json() == {"weight_version": "7"}
    for body in ({}, {"new_version": 7}, {"version": "8"}):
        assert httpx.post(s.url + "/update_weight_version", json=body).status_code == 400
    assert httpx.get(s.url + "/weight_info").json() == {"weight_version": "7"}


def _generate(s: EmbeddedServer, stream: bool = False, **sampling) -> list[dict]:
    """A generate request's choices, merged from its chunks when streamed (token ids, logprobs, the last
    finish reason and weight_versions)."""
    body = {"token_ids": PROMPT, "stream": stream,
            "sampling_params": {"max_tokens": 8, "logprobs": 0, "seed": 3, "ignore_eos": True, **sampling}}
    response = httpx.post(s.url + "/inference/v1/generate", json=body, timeout=30)
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()["choices"]
    events = sse_data(response.text.split("\n"))
    assert events[-1] == "[DONE]"
    merged: dict[int, dict] = {}
    for event in events[:-1]:
        for c in event["choices"]:
            m = merged.setdefault(c["index"], {"index": c["index"], "token_ids": [], "logprobs": {"content": []}})
            assert m.get("weight_versions") is None  # spans come once, on a choice's last chunk
            m["token_ids"] += c["token_ids"]
            m["logprobs"]["content"] += c["logprobs"]["content"]
            m["finish_reason"], m["weight_versions"] = c["finish_reason"], c["weight_versions"]
    return [merged[i] for i in sorted(merged)]


@pytest.mark.parametrize("stream", [False, True])
def test_generate_route_samples_as_completions_do_and_names_the_weights_of_every_token(make_server, model_dir,
                                                                                     stream):
    s = make_server()
    (reference,) = complete(s, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)["choices"]
    (choice,) = _generate(s, stream)
    assert choice["token_ids"] == reference["token_ids"] and choice["finish_reason"] == "length"
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == reference["logprobs"]["token_logprobs"]
    assert [e["token_id"] for e in choice["logprobs"]["content"]] == reference["token_ids"]
    assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": 8}]  # vLLM's first label
    # Loaded and labelled: the tokens it samples now carry the new label.
    assert post(s, "/collective_rpc", method="reload_weights", kwargs={"weights_path": str(model_dir)}).status_code == 200
    assert post(s, "/update_weight_version", new_version="1").status_code == 200
    (choice,) = _generate(s, stream, n=1)
    assert choice["weight_versions"] == [{"version": "1", "start": 0, "end": 8}]
    bad = httpx.post(s.url + "/inference/v1/generate", json={"token_ids": [], "sampling_params": {}})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"


def test_the_routes_prime_rl_drives_answer_as_its_inference_server_does(make_server):
    """prime-rl's renderer client checks each sampled id against its logprob entry's `token` (`token_id:N`, as
    vLLM writes it without a tokenizer), and its orchestrator loads each step's weights with `/update_weights`."""
    s = make_server()
    (choice,) = _generate(s, stream=False, n=1)
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
    answer = httpx.post(s.url + "/update_weights", json={"weight_dir": "/runs/broadcasts/step_1"})
    assert answer.status_code == 200 and answer.json() == {"status": "ok"}


def test_label_spans_are_runs_of_tokens_under_one_label():
    sampled_by = [Weights(0), Weights(0), Weights(1, "1"), Weights(2, "1"), Weights(2, "3")]
    assert label_spans(sampled_by) == [{"version": "default", "start": 0, "end": 2},
                                       {"version": "1", "start": 2, "end": 4},
                                       {"version": "3", "start": 4, "end": 5}]
    assert label_spans([]) == []


@pytest.mark.parametrize("label_first", [True, False])
def test_a_label_names_the_tokens_sampled_after_it_whichever_comes_first_in_a_pause(make_server, model_dir,
                                                                                     label_first):
    """As vLLM's engine does: a token carries the label set when it was sampled, so while paused the
    label and the load may come in either order (or at once) and name the same tokens."""
    s = make_server(faults=SLOW_STEPS)

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as client:
            body = {"token_ids": PROMPT,
                    "sampling_params": {"max_tokens": 12, "ignore_eos": True, "return_weight_versions": True}}
            request = asyncio.create_task(client.post(s.url + "/inference/v1/generate", json=body))
            await wait_for_metrics(s.url, lambda m: m["vllm:kv_cache_usage_perc"] > 0)  # mid-generation
            assert (await client.post(s.url + "/pause?mode=keep")).status_code == 200
            label = client.post(s.url + "/update_weight_version", json={"new_version": "7"})
            load = client.post(s.url + "/collective_rpc",
                               json={"method": "reload_weights", "kwargs": {"weights_path": str(model_dir)}})
            for call in (label, load) if label_first else (load, label):
                assert (await call).status_code == 200
            assert (await client.post(s.url + "/resume")).status_code == 200
            return (await request).json()["choices"][0]

    choice = asyncio.run(scenario())
    loads = choice["token_weight_versions"]
    switch = loads.index(1)
    assert 0 < switch < 12 and loads == [0] * switch + [1] * (12 - switch)  # the load landed mid-request
    assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": switch},
                                         {"version": "7", "start": switch, "end": 12}]
    assert httpx.get(s.url + "/weight_info").json()["weight_version"] == "7"


def test_bad_checkpoints_are_refused_and_model_untouched(make_server, model_dir, tmp_path):
    s = make_server()
    sampled = {"temperature": 1.0, "seed": 3, "max_tokens": 6, "ignore_eos": True}
    before = complete(s, **sampled)["choices"][0]["logprobs"]["token_logprobs"]
    tensors = load_file(str(model_dir / "model.safetensors"))

    def checkpoint(name: str, mutate) -> str:
        directory = tmp_path / name
        directory.mkdir()
        changed = dict(tensors)
        mutate(changed)
        save_file(changed, str(directory / "model.safetensors"))
        return directory

    wrong_shape = checkpoint("shape", lambda t: t.update({"model.norm.weight": torch.ones(64)}))
    missing = checkpoint("missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    extra = checkpoint("extra", lambda t: t.update({"model.layers.9.bogus": torch.zeros(2)}))
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    cases = {
        wrong_shape: "model.norm.weight: shape (64,) != expected (128,)",
        missing: "missing tensor model.layers.1.mlp.up_proj.weight",
        extra: "unexpected tensor model.layers.9.bogus",
        corrupt: "cannot read checkpoint",
        tmp_path / "nowhere": "no *.safetensors files",
    }
    for path, fragment in cases.items():
        response = reload(s, path)
        assert response.status_code == 400, path
        assert fragment in response.json()["error"]["message"]
    after = complete(s, **sampled)["choices"][0]["logprobs"]["token_logprobs"]
    assert after == before  # the model was never touched
    assert httpx.get(s.url + "/v1/models").json()["data"][0]["weights_version"] == 0
    bad_rpc = post(s, "/collective_rpc", method="sleep", kwargs={"weights_path": "x"})
    assert bad_rpc.status_code == 400 and "unsupported" in bad_rpc.json()["error"]["message"]


@pytest.mark.parametrize("mode", ["keep", "wait", "abort"])
def test_pause_queues_new_requests_until_resume(make_server, mode):
    """As in vLLM 0.32: every pause mode queues new requests (no 503); /health stays 200."""
    s = make_server()

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as client:
            before = time.monotonic()
            assert (await client.post(s.url + f"/pause?mode={mode}")).json() == {"status": "paused"}
            assert (await client.get(s.url + "/health")).status_code == 200
            assert (await client.get(s.url + "/is_paused")).json() == {"is_paused": True}
            # ignore_eos: an unseeded request may sample EOS first, and this one must run its two tokens.
            payload = {"prompt": PROMPT, "max_tokens": 2, "return_token_ids": True, "ignore_eos": True}
            queued = asyncio.create_task(client.post(s.url + "/v1/completions", json=payload))
            during = await wait_for_metrics(s.url, lambda m: m["vllm:num_requests_waiting"] == 1)
            assert not queued.done()
            assert (await client.post(s.url + "/resume")).json() == {"status": "resumed"}
            wall_s = time.monotonic() - before
            assert (await client.get(s.url + "/is_paused")).json() == {"is_paused": False}
            after = parse_metrics((await client.get(s.url + "/metrics")).text)
            return during, after, wall_s, await queued

    during, after, wall_s, response = asyncio.run(scenario())
    assert during["vllm:num_requests_running"] == 0 and during["beam_rl:paused"] == 1
    # The server's own count of the pause: from its pause call to its resume call, inside the client's.
    assert 0 < during["beam_rl:paused_seconds_total"] <= after["beam_rl:paused_seconds_total"] <= wall_s
    assert response.status_code == 200 and len(response.json()["choices"][0]["token_ids"]) == 2


def _pause_during_generation(s: EmbeddedServer, mode: str):
    """`s` was started with SLOW_STEPS."""

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as client:
            payload = {"prompt": PROMPT, "max_tokens": 12, "ignore_eos": True, "return_token_ids": True}
            request = asyncio.create_task(client.post(s.url + "/v1/completions", json=payload))
            await wait_for_metrics(s.url, lambda m: m["vllm:kv_cache_usage_perc"] > 0)  # mid-generation
            await client.post(s.url + f"/pause?mode={mode}")
            in_flight_after_pause = not request.done()
            await client.post(s.url + "/resume")
            return in_flight_after_pause, await request

    return asyncio.run(scenario())


def test_pause_keep_freezes_and_resume_finishes(make_server):
    in_flight, response = _pause_during_generation(make_server(faults=SLOW_STEPS), "keep")
    assert in_flight
    assert response.status_code == 200 and len(response.json()["choices"][0]["token_ids"]) == 12


def _open_stream(url: str, body: dict) -> socket.socket:
    """A streamed completion on a plain socket, so what has arrived can be read without waiting."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    data = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(data), data))
    sock.setblocking(False)
    return sock


def _arrived(sock: socket.socket) -> bytes:
    received = []
    with contextlib.suppress(BlockingIOError):
        while block := sock.recv(1 << 16):
            received.append(block)
    return b"".join(received)


@pytest.mark.parametrize("mode", ["model", "simulated", "instant"])
def test_a_keep_pause_is_answered_after_the_streams_sent_every_token_sampled_before_it(make_server, mode):
    """What a client's drain relies on (docs/weight-updates.md): once the pause is answered, every token
    sampled before it is on its way, so nothing a stream receives later comes from before the pause."""
    s = make_server(mode=mode, faults=FaultConfig(step_delay_s=0.005))
    body = {"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True, "return_token_ids": True}
    streams = [_open_stream(s.url, body) for _ in range(8)]
    try:
        wait = wait_for_metrics(s.url, lambda m: m["vllm:generation_tokens_total"] >= 80)  # all mid-generation
        asyncio.run(wait)
        received = [_arrived(sock) for sock in streams]
        assert post(s, "/pause?mode=keep").json() == {"status": "paused"}
        received = [before + _arrived(sock) for before, sock in zip(received, streams)]  # no wait
        sampled = metrics(s.url)["vllm:generation_tokens_total"]
        streamed = sum(len(ids.split(b",")) for r in received
                       for ids in re.findall(rb'(?<!prompt_)"token_ids":\[([0-9,]+)\]', r))
        assert streamed == sampled > 80
    finally:
        post(s, "/resume")
        for sock in streams:
            sock.close()


def test_pause_abort_ends_in_flight_requests_with_their_partial_tokens(make_server):
    s = make_server(faults=SLOW_STEPS)
    _, response = _pause_during_generation(s, "abort")
    assert response.status_code == 200  # vLLM 0.32: an aborted request is answered, not failed
    (choice,) = response.json()["choices"]
    assert choice["finish_reason"] == "abort" and 1 <= len(choice["token_ids"]) < 12
    assert metrics(s.url)["vllm:num_requests_running"] == 0
    assert post(s, prompt=PROMPT, max_tokens=2).status_code == 200


# -- faults ------------------------------------------------------------------------------------


def test_error_fault(make_server):
    s = make_server(faults=FaultConfig(error_rate=1.0))
    response = post(s, prompt=PROMPT, max_tokens=2)
    assert response.status_code == 500 and response.json()["error"]["type"] == "InternalServerError"


def test_drop_fault_closes_the_connection(make_server):
    s = make_server(faults=FaultConfig(drop_rate=1.0))
    with pytest.raises(httpx.RemoteProtocolError):
        post(s, prompt=PROMPT, max_tokens=2)
    post(s, "/faults", drop_rate=0.0)
    assert post(s, prompt=PROMPT, max_tokens=2).status_code == 200


def test_hang_fault_never_answers(make_server):
    s = make_server(faults=FaultConfig())  # faults enabled, none injected yet
    post(s, "/faults", hang_rate=1.0)
    with pytest.raises(httpx.ReadTimeout):
        post(s, prompt=PROMPT, max_tokens=2, timeout=0.3)
    post(s, "/faults", hang_rate=0.0)
    assert post(s, prompt=PROMPT, max_tokens=2).status_code == 200
    assert metrics(s.url)["vllm:num_requests_running"] == 0  # the hung request held no slot


def test_empty_fault_returns_no_tokens(make_server):
    s = make_server(faults=FaultConfig(empty_rate=1.0))
    body = complete(s, n=2)
    assert [(c["token_ids"], c["logprobs"]["token_logprobs"], c["text"]) for c in body["choices"]] == [([], [], "")] * 2
    assert body["usage"]["completion_tokens"] == 0


def test_faults_are_seeded_and_validated(make_server):
    s = make_server(faults=FaultConfig())

    def statuses() -> list[int]:
        post(s, "/faults", error_rate=0.5, seed=7)
        return [post(s, prompt=PROMPT, max_tokens=1).status_code for _ in range(12)]

    first = statuses()
    assert first == statuses()
    assert set(first) == {200, 500}
    assert post(s, "/faults", error_rate=2.0).status_code == 400
    assert post(s, "/faults", typo_rate=0.1).status_code == 400
    assert httpx.get(s.url + "/faults").json()["error_rate"] == 0.5


# -- instant mode and the subprocess launcher --------------------------------------------------


def test_instant_mode(make_server):
    s = make_server(model_dir=None, mode="instant")
    body = complete(s, n=3, max_tokens=10, seed=4)
    for choice in body["choices"]:
        assert len(choice["token_ids"]) == 10 and choice["finish_reason"] == "length"
        assert choice["logprobs"]["token_logprobs"] == [-1.0] * 10
        assert not {0, 1, 2} & set(choice["token_ids"])  # never a special token
    assert len({tuple(t) for t in tokens_of(body)}) == 3
    assert tokens_of(complete(s, n=3, max_tokens=10, seed=4)) == tokens_of(body)
    assert tokens_of(complete(s, n=3, max_tokens=10, seed=5)) != tokens_of(body)


def test_subprocess_server(model_dir):
    proc, url = start_subprocess_server(
        model_dir, max_num_seqs=4, extra_args=("--served-model-name", "policy"), ready_timeout_s=60
    )
    try:
        assert url.startswith("http://127.0.0.1:")
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        assert httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"] == "policy"
        response = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "return_token_ids": True}, timeout=30)
        assert response.status_code == 200 and len(response.json()["choices"][0]["token_ids"]) <= 3
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0  # SIGTERM is a clean shutdown


def test_start_stop_lifecycle(model_dir):
    s = EmbeddedServer(model_dir, mode="instant")
    url = s.start()
    with pytest.raises(RuntimeError, match="already started"):
        s.start()
    s.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=5)
    with pytest.raises(RuntimeError, match="stopped"):
        s.start()


# -- chat completions and scripted replies -----------------------------------------------------

MESSAGES = [{"role": "system", "content": "You grade answers."}, {"role": "user", "content": "Is 2 + 2 = 4?"}]


def chat(s: EmbeddedServer, timeout: float = 30, **payload) -> httpx.Response:
    return httpx.post(s.url + "/v1/chat/completions", json={"messages": MESSAGES, **payload}, timeout=timeout)


def test_chat_completion_renders_the_chat_template_and_answers_in_vllms_shape(server):
    response = chat(server, max_completion_tokens=6, seed=3, ignore_eos=True, return_token_ids=True,
                    logprobs=True, top_logprobs=2)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    tokenizer = load_tokenizer("tiny")
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert body["prompt_token_ids"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(body["prompt_token_ids"])
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 6
    assert choice["message"]["content"] == visible_text(tokenizer, choice["token_ids"], skip_special_tokens=True)
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [tokenizer.decode([t]) for t in choice["token_ids"]]
    assert all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)
    # The same seed through /v1/completions with the rendered prompt samples the same tokens.
    same = complete(server, prompt=body["prompt_token_ids"], max_tokens=6, seed=3, ignore_eos=True)
    assert same["choices"][0]["token_ids"] == choice["token_ids"]


def test_chat_completion_defaults_to_the_rest_of_the_context(make_server):
    s = make_server(model_dir=None, mode="instant")
    body = chat(s).json()
    prompt = body["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == 1024 - prompt  # vLLM: max_model_len - prompt
    assert chat(s, stream=True).status_code == 400
    assert chat(s, messages=[]).status_code == 400


def test_scripted_replies_are_cycled_with_their_own_latency(make_server):
    s = make_server(model_dir=None, mode="instant", faults=FaultConfig())
    replies = ["VERDICT: yes", "VERDICT: no", "I cannot decide ###", {"text": "VERDICT: yes", "latency_s": 2.0}]
    assert post(s, "/faults", replies=replies).json()["replies"][3] == {"text": "VERDICT: yes", "latency_s": 2.0}
    contents = [chat(s).json()["choices"][0]["message"]["content"] for _ in range(3)]
    assert contents == ["VERDICT: yes", "VERDICT: no", "I cannot decide ###"]
    with pytest.raises(httpx.ReadTimeout):
        chat(s, timeout=0.3)  # the slow one: a judge client's timeout fires
    tokenizer = load_tokenizer("tiny")
    body = complete(s, n=2, max_tokens=20)  # the cycle starts over; completions answer from it too
    expected_ids = tokenizer.encode("VERDICT: yes", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert [c["token_ids"] for c in body["choices"]][0] == expected_ids
    assert [(c["text"], c["finish_reason"]) for c in body["choices"]] == [("VERDICT: yes", "stop"), ("VERDICT: no", "stop")]
    cut = complete(s, max_tokens=2)["choices"][0]
    assert (len(cut["token_ids"]), cut["finish_reason"]) == (2, "length")
    post(s, "/faults", replies=[])
    assert len(complete(s, max_tokens=5, ignore_eos=True)["choices"][0]["token_ids"]) == 5  # generated again


# -- the die_after_tokens fault ----------------------------------------------------------------


def stream_lines(url: str, payload: dict) -> tuple[list[str], Exception | None]:
    """The lines of a streamed completion read until the server is gone, and how the stream ended."""
    lines: list[str] = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**payload, "stream": True}, timeout=30) as response:
            for line in response.iter_lines():
                lines.append(line)
    except httpx.HTTPError as exc:
        return lines, exc
    return lines, None


def streamed_tokens(lines: list[str]) -> list[int]:
    return [t for event in sse_data(lines) if event != "[DONE]" for t in event["choices"][0]["token_ids"]]


DYING = {"prompt": PROMPT, "max_tokens": 20, "seed": 5, "ignore_eos": True, "return_token_ids": True}


def test_an_in_process_server_dies_mid_stream_after_the_set_tokens(make_server):
    s = make_server(model_dir=None, mode="instant", faults=FaultConfig(step_delay_s=0.005))
    full = complete(s, **DYING)["choices"][0]["token_ids"]
    post(s, "/faults", die_after_tokens=5)  # counted from now
    lines, ended = stream_lines(s.url, DYING)
    assert isinstance(ended, httpx.RemoteProtocolError)  # the body broke off: no finish, no [DONE]
    assert streamed_tokens(lines) == full[:5]
    assert "[DONE]" not in sse_data(lines)
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.url + "/health", timeout=5)  # and the port is closed


def test_a_subprocess_server_exits_mid_request():
    args = ("--fault-step-delay-s", "0.005", "--fault-die-after-tokens", "7")
    proc, url = start_subprocess_server(mode="instant", extra_args=args, ready_timeout_s=60)
    try:
        lines, ended = stream_lines(url, DYING)
        assert proc.wait(timeout=30) == 70  # DIED_EXIT_CODE: the process is gone
    finally:
        proc.kill()
        proc.wait()
    assert isinstance(ended, httpx.RemoteProtocolError)
    assert len(streamed_tokens(lines)) == 7


def test_a_non_streamed_request_gets_no_answer_from_a_dying_server(make_server):
    s = make_server(model_dir=None, mode="instant", faults=FaultConfig(step_delay_s=0.005, die_after_tokens=3))
    with pytest.raises(httpx.RemoteProtocolError):
        post(s, **DYING)


# -- fault settings: one model, the command line derived from it -------------------------------


def test_fault_flags_are_derived_from_fault_config():
    parser = argparse.ArgumentParser()
    add_fault_args(parser)
    flags = {action.dest for action in parser._actions}
    assert flags == {"help", "enable_faults"} | {f"fault_{name}" for name in FaultConfig.model_fields}
    assert fault_config_from_args(parser.parse_args([])) is None  # the default: no faults, no /faults route
    assert fault_config_from_args(parser.parse_args(["--enable-faults"])) == FaultConfig()
    args = parser.parse_args(["--fault-error-rate", "0.5", "--fault-seed", "7", "--fault-die-after-tokens", "3",
                              "--fault-replies", "yes", "no", "--fault-step-delay-s", "0.01"])
    assert fault_config_from_args(args) == FaultConfig(error_rate=0.5, seed=7, die_after_tokens=3,
                                                       replies=["yes", "no"], step_delay_s=0.01)
    with pytest.raises(ValidationError):
        fault_config_from_args(parser.parse_args(["--fault-error-rate", "2"]))


def test_stream_with_continuous_usage_and_without_token_ids(make_server):
    s = make_server(model_dir=None, mode="instant", faults=FaultConfig(step_delay_s=0.001))
    payload = {"prompt": PROMPT, "max_tokens": 4, "stream": True,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", s.url + "/v1/completions", json=payload, timeout=30) as response:
        events = sse_data(list(response.iter_lines()))
    *chunks, last, done = events
    assert done == "[DONE]" and last["choices"] == []
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4]
    assert all(c["usage"]["prompt_tokens"] == len(PROMPT) for c in chunks)
    assert last["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 4, "total_tokens": len(PROMPT) + 4}
    choices = [c["choices"][0] for c in chunks]
    assert all(c["token_ids"] is None and c["prompt_token_ids"] is None and c["logprobs"] is None for c in choices)
    assert "token_weight_versions" not in choices[0]


def test_a_stream_whose_client_hung_up_ends_quietly_and_frees_its_slots(make_server, monkeypatch, caplog):
    """A client may close a stream it no longer wants (a rollout cancelled, or regenerated). A write can find
    the connection closing before the server has seen it lost: that ends the request, as vLLM aborts it, and
    is no error handling it."""
    from aiohttp import ClientConnectionResetError, web

    s = make_server(faults=FaultConfig(step_delay_s=0.01))
    write, writes = web.StreamResponse.write, collections.Counter()

    async def closing_after_the_first_event(self: web.StreamResponse, data: bytes) -> None:
        writes[id(self)] += 1
        if writes[id(self)] > 1:
            raise ClientConnectionResetError("Cannot write to closing transport")  # as aiohttp's writer does
        await write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", closing_after_the_first_event)
    with httpx.stream("POST", s.url + "/v1/completions", timeout=30,
                      json={"prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True}) as response:
        events = sse_data(list(response.iter_lines()))
    assert len(events) == 1 and "choices" in events[0]  # one event, then the stream ended
    asyncio.run(wait_for_metrics(s.url, lambda m: m["vllm:num_requests_running"] == 0))
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert not errors, [r.getMessage() for r in errors]


# -- stream_interval: tokens in chunks, as vLLM 0.32 streams them --------------------------------


def _streamed_chunks(s: EmbeddedServer, path: str, body: dict) -> dict[int, list[dict]]:
    """Each choice's chunks (their token ids, logprobs and finish reasons) of a streamed request."""
    with httpx.stream("POST", s.url + path, json={**body, "stream": True}, timeout=30) as response:
        assert response.status_code == 200, response.read()
        events = sse_data(list(response.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks: dict[int, list[dict]] = collections.defaultdict(list)
    for event in events[:-1]:
        for c in event["choices"]:
            logprobs = c["logprobs"]
            logprobs = ([e["logprob"] for e in logprobs["content"]] if "content" in logprobs
                        else logprobs["token_logprobs"])
            chunks[c["index"]].append({"ids": c["token_ids"], "logprobs": logprobs, "finish": c["finish_reason"]})
    return chunks


@pytest.mark.parametrize("route", ["completions", "generate"])
def test_stream_interval_chunks_the_per_token_stream_as_vllm_does(make_server, route):
    """The first token at once, then chunks of N, the rest with the finish reason: the same ids and logprobs
    as a token an event. On the generate route the interval is a sampling parameter, as in vLLM."""
    s = make_server()
    sampling = {"n": 2, "max_tokens": 20, "seed": 11, "ignore_eos": True, "logprobs": 0}

    def chunks(**extra: int) -> dict[int, list[dict]]:
        if route == "generate":
            return _streamed_chunks(s, "/inference/v1/generate", {"token_ids": PROMPT,
                                                                  "sampling_params": {**sampling, **extra}})
        return _streamed_chunks(s, "/v1/completions", {"prompt": PROMPT, "return_token_ids": True, **sampling, **extra})

    per_token, chunked = chunks(), chunks(stream_interval=8)
    for index in (0, 1):
        assert [len(c["ids"]) for c in per_token[index]] == [1] * 20
        assert [len(c["ids"]) for c in chunked[index]] == [1, 8, 8, 3]
        assert [c["finish"] for c in chunked[index]] == [None, None, None, "length"]
        for key in ("ids", "logprobs"):
            assert [x for c in chunked[index] for x in c[key]] == [x for c in per_token[index] for x in c[key]]
    bad = post(s, prompt=PROMPT, max_tokens=4, stream=True, stream_interval=0)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "BadRequestError"
