"""What comes from outside is checked where it enters, and each refusal is one typed line naming its source:
token ids a server answers outside the model's vocabulary (the rollout errs, counted against the server),
answers past `inference.max_response_mb` (refused before they are held), and rewards that are no finite
number (the run stops naming the env and the row). The servers are real HTTP servers answering garbage."""

from __future__ import annotations

import asyncio
import math
from fractions import Fraction
from typing import Any

import orjson
import pytest
from aiohttp import web

from beam_rl.wiring import inference_client
from beam_rl.model.location import vocab_size
from beam_rl.config import RunConfig, config_from_dict
from beam_rl.dispatch import Dispatcher
from beam_rl.envs.base import Environment, Trajectory
from beam_rl.envs.plugins import PluginEnvironment, PluginFailure
from beam_rl.inference.client import InferenceBadResponse, InferenceCorruptResponse, InferenceError
from beam_rl.inference.types import SamplingParams
from beam_rl.scoring.rewards import RewardFailed, assign_rewards
from beam_rl.types import Rollout, RolloutStatus, Turn
from tests.unit.inference.test_client import serve
from tests.unit.dispatch.test_dispatcher import SAMPLING, FakeEnv, Outbox, collect, groups

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def config(url: str, **inference: Any) -> RunConfig:
    """A run's config with one server at `url`: its clients are built the way the dispatcher's are."""
    return config_from_dict({"envs": [{"name": "reverse_text"}],
                             "inference": {"urls": [url], "max_retries": 0, **inference}})


class Faulty:
    """A server answering `/v1/completions` with `chunks` of token ids (each one event when streamed, all of them
    in one answer when not), or with a body of `body_bytes` when set; `sent` counts the body bytes it wrote
    before the client went away."""

    def __init__(self) -> None:
        self.chunks: list[list[Any]] = [[5, 6]]
        self.body_bytes = 0
        self.declared_bytes: int | None = None
        self.sent = 0

    async def completions(self, request: web.Request) -> web.StreamResponse:
        payload = await request.json()
        if self.body_bytes:
            return await self._huge(request, payload)
        choices = range(payload["n"])
        if not payload.get("stream"):
            ids = [t for chunk in self.chunks for t in chunk]
            return web.json_response({"choices": [
                {"index": i, "token_ids": ids, "logprobs": {"token_logprobs": [-0.5] * len(ids)},
                 "finish_reason": "stop"} for i in choices]}, dumps=lambda o: orjson.dumps(o).decode())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for k, chunk in enumerate(self.chunks):
            last = k == len(self.chunks) - 1
            event = {"choices": [{"index": i, "token_ids": chunk, "logprobs": {"token_logprobs": [-0.5] * len(chunk)},
                                  "finish_reason": "stop" if last else None} for i in choices]}
            await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async def _huge(self, request: web.Request, payload: dict[str, Any]) -> web.StreamResponse:
        """A body of `body_bytes`: JSON whitespace, then a valid answer (an event with no end when streamed), so a
        client that reads it all would take it."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream" if payload.get("stream")
                                               else "application/json"})
        if self.declared_bytes is not None:
            response.content_length = self.declared_bytes
        await response.prepare(request)
        block = b"data: " + b"x" * (64 * 1024 - 6) if payload.get("stream") else b" " * (64 * 1024)
        try:
            while self.sent < self.body_bytes:
                await response.write(block)
                self.sent += len(block)
                if self.declared_bytes is not None:
                    await asyncio.sleep(3600)  # the rest of the declared body never comes
            ids = {"index": 0, "token_ids": [5], "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "stop"}
            await response.write(orjson.dumps({"choices": [ids]}))
        except ConnectionError:
            pass  # the client refused the rest
        return response

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/health", lambda _: web.Response(text=""))
        app.router.add_get("/metrics", lambda _: web.Response(text=""))
        return app


def one_line(text: str) -> str:
    assert "\n" not in text, text
    return text


# -- token ids -------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("garbage", [10**9, -5], ids=["1e9", "negative"])
def test_token_ids_outside_the_vocabulary_make_the_rollout_an_error_counted_against_the_server(stream, garbage):
    server = Faulty()
    server.chunks = [[5, 6], [garbage]]

    async def main() -> tuple[list[Rollout], int, str]:
        async with serve(server) as url:
            client = inference_client(config(url, stream=stream), url, None)  # as the run builds its clients
            outbox = Outbox()
            dispatcher = Dispatcher([client], {"math": FakeEnv()}, {"math": "rollout"}, SAMPLING, 4, lambda: 0,
                                    outbox.append, max_redispatches=0)
            dispatcher.outbox = outbox
            dispatcher.add(groups(2, 1))
            try:
                rollouts = await collect(dispatcher, 2)
            finally:
                await client.aclose()
            return rollouts, dispatcher.pool.servers[0].consecutive_failures, url

    rollouts, failures, url = asyncio.run(main())
    vocab = vocab_size(config("http://x"))
    for rollout in rollouts:
        assert rollout.status == RolloutStatus.ERROR
        error = one_line(rollout.errors[-1])
        assert error.startswith("InferenceCorruptResponse: ") and f"{url}/v1/completions: choice 0: " in error
        assert f"token id {garbage} outside the model's vocabulary [0, {vocab})" in error
    assert failures == 2  # each counted against the server, as a 5xx or a dropped connection is


@pytest.mark.parametrize("garbage", [2**40, -1, "x"], ids=["2**40", "negative", "not a number"])
def test_a_streamed_choice_keeps_the_tokens_before_the_garbage_for_another_server(garbage):
    server = Faulty()
    server.chunks = [[5], [6, garbage], [7]]

    async def main() -> InferenceBadResponse:
        async with serve(server) as url:
            async with inference_client(config(url), url, None) as client:
                with pytest.raises(InferenceBadResponse) as caught:
                    await client.complete([1, 2], SamplingParams(max_tokens=8))
        return caught.value

    err = asyncio.run(main())
    one_line(str(err))
    # Out of the vocabulary: the server is sick (counted, and the rollout moves on); not a number: a bad answer.
    assert isinstance(err, InferenceCorruptResponse) == isinstance(garbage, int) == err.server_fault
    assert not err.retryable
    assert err.partial is not None and err.partial[0].token_ids == [5]  # what a re-dispatch continues from


# -- body size ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["whole body", "declared length", "one streamed event"])
def test_an_answer_past_max_response_mb_is_refused_before_it_is_all_read(shape):
    server = Faulty()
    server.body_bytes = 64 * MiB
    if shape == "declared length":
        server.declared_bytes = 8 << 30

    async def main() -> tuple[str, InferenceError]:
        async with serve(server) as url:
            settings = {"max_response_mb": 1, "stream": shape == "one streamed event", "request_timeout_s": 20.0}
            async with inference_client(config(url, **settings), url, None) as client:
                with pytest.raises(InferenceError) as caught:
                    await client.complete([1, 2], SamplingParams(max_tokens=8))
        return url, caught.value

    url, err = asyncio.run(main())
    assert isinstance(err, InferenceCorruptResponse), err
    assert err.server_fault
    text = one_line(str(err))
    assert text.startswith(f"POST {url}/v1/completions: ") and "larger than inference.max_response_mb (1 MiB)" in text
    # The client hung up: the server could not send the rest (socket buffers hold a few MiB at most).
    assert server.sent < server.body_bytes / 2, server.sent


def test_the_default_cap_is_the_configs():
    client = inference_client(config("http://127.0.0.1:1"), "http://127.0.0.1:1", None)
    assert client.max_response_bytes == 256 * MiB
    assert client.vocab_size == vocab_size(config("http://127.0.0.1:1"))


# -- rewards ----------------------------------------------------------------------------------------


class _Returns(Environment):
    """An environment whose reward is `value`, whatever it is."""

    name = "returns"

    def __init__(self, value: Any) -> None:
        super().__init__(tokenizer=None)
        self.value = value

    def load_rows(self, split: str = "train") -> list[dict[str, Any]]:
        return []

    def render_prompt(self, row: dict[str, Any]) -> list[int]:
        return [1]

    def reward(self, row: dict[str, Any], trajectory: Trajectory) -> Any:
        return self.value


NOT_REWARDS = {
    "10**400": 10**400,
    "10**5000": 10**5000,  # past the digits Python prints: the message must still be written
    "huge Fraction": Fraction(10**400, 3),
    "True": True,
    "nan": math.nan,
    "-inf": -math.inf,
    "a string": "1.0",
    "None": None,
}


@pytest.mark.parametrize("value", NOT_REWARDS.values(), ids=NOT_REWARDS.keys())
def test_a_reward_that_is_no_finite_float_stops_the_run_naming_the_env_and_the_row(value):
    rollout = Rollout("g", "arith-a", 0, 0, prompt_ids=[1], turns=[Turn([5], [0.0], "stop")], row={"q": "row-17"})
    with pytest.raises(RewardFailed) as caught:
        assign_rewards([rollout], _Returns(value))
    text = one_line(str(caught.value))
    assert text.startswith("env 'arith-a': reward returned ") and "not a finite number" in text
    assert "row {'q': 'row-17'}" in text and len(text) < 400

    guarded = PluginEnvironment(_Returns(value), "arith-b", "pkg.mod:Returns")
    with pytest.raises(PluginFailure) as caught_plugin:
        guarded.reward({"q": "row-18"}, Trajectory([Turn([5], [0.0], "stop")]))
    text = one_line(str(caught_plugin.value))
    assert text.startswith("env 'arith-b' (plug-in 'pkg.mod:Returns'): reward returned ")
    assert "not a finite number; row {'q': 'row-18'}" in text


def test_finite_rewards_of_every_numeric_type_are_floats():
    for value in (1, 0.25, Fraction(1, 4), 10**300):
        rollout = Rollout("g", "arith", 0, 0, prompt_ids=[1], turns=[Turn([5], [0.0], "stop")], row={"q": 1})
        assign_rewards([rollout], _Returns(value))
        assert type(rollout.reward) is float and rollout.reward == float(value)
