"""The inference proxy and the black-box agent environment: what a program samples through the proxy is
the rollout's turns token for token (through the dispatcher against real servers, with per-token versions and
failover: tests/integration/test_agents.py)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError

from beam_rl.envs import make_env
from beam_rl.envs.agent import BlackBoxAgent
from beam_rl.envs.base import SamplingParams, chat_prompt_ids
from beam_rl.envs.loop_local import close_loop_locals
from beam_rl.envs.proxy import Endpoint, Episode, InferenceProxy, shared_proxy
from tests.support.fakes import ScriptedClient
from tests.support.paths import AGENTS

pytestmark = pytest.mark.timeout(180)

AGENT = AGENTS / "two_turn_agent.py"
ROWS = [{"prompt": f"Say something about the number {i}.", "answer": str(i), "max_tokens": 8} for i in range(4)]


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return tmp_path


def agent_env(tok: Any, dataset: Path, **kwargs: Any) -> BlackBoxAgent:
    return make_env("agent", tok, command=[sys.executable, str(AGENT)], dataset=str(dataset), **kwargs)


def run_episode(env: BlackBoxAgent, client: ScriptedClient, calls, sampling: SamplingParams | None = None) -> Episode:
    """Serves one episode on a fresh proxy and runs `calls(endpoint)` against it."""

    async def main() -> Episode:
        proxy = InferenceProxy()
        await proxy.start()
        episode = Episode(env, client, sampling or SamplingParams(max_tokens=16, seed=5), env.follow_ups)
        try:
            with proxy.serve(episode) as endpoint:
                await calls(endpoint)
        finally:
            await proxy.close()
        return episode

    return asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_through_the_proxy_trains_the_sampled_ids_and_the_templates_ids_of_what_the_program_added(
        tok, dataset, stream):
    env = agent_env(tok, dataset)
    client = ScriptedClient(tok, "  spaced  text ", "second", version=7)
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    tool = {"role": "tool", "name": "count", "content": "42"}
    seen: list[str] = []

    async def calls(endpoint: Endpoint) -> None:
        openai = AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.secret)
        for messages in (first, None):
            if messages is None:  # the program writes the reply back in its own words: the sampled ids stand
                messages = [*first, {"role": "assistant", "content": seen[0].strip()}, tool]
            if stream:
                chunks = [c async for c in await openai.chat.completions.create(
                    model="m", messages=messages, max_tokens=100, stream=True)]
                seen.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
            else:
                answer = await openai.chat.completions.create(model="m", messages=messages, max_tokens=100)
                seen.append(answer.choices[0].message.content)

    episode = run_episode(env, client, calls)
    prompt = chat_prompt_ids(tok, first)
    (first_context, first_sampling, _), (second_context, second_sampling, _) = client.calls
    turns = episode.turns
    assert seen == [env.decode(t.completion_ids) for t in turns] == ["  spaced  text ", "second"]
    assert episode.prompt_ids == prompt == first_context and turns[0].env_ids == []
    # The completion closed its turn with EOS; the tool message is the template's rendering after it.
    assert turns[1].env_ids == env.follow_ups.ids([tool], closed=True)
    assert second_context == prompt + turns[0].completion_ids + turns[1].env_ids
    assert tok.decode(turns[1].env_ids) == (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert all(t.policy_versions == [7] * len(t.completion_ids) for t in turns)
    # The run's sampling rules: the program's larger max_tokens does not raise the budget; seeds step per turn.
    assert (first_sampling.max_tokens, first_sampling.seed, second_sampling.seed) == (16, 5, 6)
    trajectory = episode.trajectory({})
    assert trajectory.prompt_ids == prompt and trajectory.turns == turns


def test_calls_that_do_not_extend_the_conversation_or_exceed_its_bounds_are_refused_with_the_reason(tok, dataset):
    env = agent_env(tok, dataset, max_turns=2)
    client = ScriptedClient(tok, "one", "two", version=7)
    user = {"role": "user", "content": "Hi"}
    errors: list[tuple[int, str]] = []

    async def calls(endpoint: Endpoint) -> None:
        base_url = endpoint.base_url
        openai = AsyncOpenAI(base_url=base_url, api_key=endpoint.secret, max_retries=0)

        async def refused(**kwargs: Any) -> None:
            with pytest.raises(BadRequestError) as caught:
                await openai.chat.completions.create(model="m", **kwargs)
            errors.append((caught.value.status_code, caught.value.body["message"]))

        await openai.chat.completions.create(model="m", messages=[user])
        await refused(messages=[{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "one"}, user])
        await refused(messages=[user, {"role": "assistant", "content": "one"}])  # nothing added
        await openai.chat.completions.create(model="m", messages=[user, {"role": "assistant", "content": "1"}, user])
        await refused(messages=[user, {"role": "assistant", "content": "1"}, user,
                                {"role": "assistant", "content": "two"}, user])
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {endpoint.secret}"}) as http:
            gone = await http.post(base_url.replace("/rollouts/", "/rollouts/x") + "/chat/completions",
                                   json={"messages": [user]})
            errors.append((gone.status_code, gone.json()["error"]["message"]))
            other_route = await http.post(base_url + "/completions", json={"prompt": [1, 2]})
            errors.append((other_route.status_code, other_route.json()["error"]["message"]))

    episode = run_episode(env, client, calls)
    assert len(client.calls) == len(episode.turns) == 2  # no refused call reached the server
    assert [status for status, _ in errors] == [400, 400, 400, 404, 400]
    assert "do not extend the conversation" in errors[0][1] and "do not extend" in errors[1][1]
    assert "out of turns (max_turns = 2)" in errors[2][1]
    assert "no rollout runs under this URL" in errors[3][1]
    assert "one route per rollout" in errors[4][1]


def test_the_token_routes_take_ids_that_extend_the_context_and_text_prompts_tokenize_only_what_they_add(tok, dataset):
    env = agent_env(tok, dataset)
    results: dict[str, Any] = {}

    async def token_calls(endpoint: Endpoint) -> None:
        root = endpoint.base_url.removesuffix("/v1")
        async with httpx.AsyncClient(headers={"X-Beam-RL-Secret": endpoint.secret}) as http:
            one = (await http.post(root + "/inference/v1/generate",
                                   json={"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4}})).json()
            ids = [5, 6, 7, *one["choices"][0]["token_ids"], 9]
            results["two"] = (await http.post(root + "/inference/v1/generate",
                                              json={"token_ids": ids, "sampling_params": {}})).json()
            results["bad"] = (await http.post(root + "/inference/v1/generate",
                                              json={"token_ids": [5, 6, 8, 1], "sampling_params": {}})).status_code

    client = ScriptedClient(tok, "a", "b", version=7)
    episode = run_episode(env, client, token_calls)
    assert client.calls[0][0] == [5, 6, 7] and client.calls[0][1].max_tokens == 4
    assert client.calls[1][0] == [5, 6, 7, *episode.turns[0].completion_ids, 9]
    assert episode.turns[1].env_ids == [9] and results["bad"] == 400
    assert results["two"]["choices"][0]["token_ids"] == episode.turns[1].completion_ids

    async def text_calls(endpoint: Endpoint) -> None:
        openai = AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.secret)
        first = await openai.completions.create(model="m", prompt="Q: 2+2?\nA:")
        results["text"] = await openai.completions.create(
            model="m", prompt="Q: 2+2?\nA:" + first.choices[0].text + "\nQ: why?\nA:")

    client = ScriptedClient(tok, " 4", " because", version=7)
    episode = run_episode(env, client, text_calls)
    assert client.calls[0][0] == tok.encode("Q: 2+2?\nA:", add_special_tokens=False)
    assert episode.turns[1].env_ids == tok.encode("\nQ: why?\nA:", add_special_tokens=False)
    assert client.calls[1][0] == client.calls[0][0] + episode.turns[0].completion_ids + episode.turns[1].env_ids
    assert results["text"].choices[0].text == " because"


def test_one_client_serves_many_rollouts_with_the_rollout_named_in_a_header(tok, dataset):
    env = agent_env(tok, dataset)
    clients = [ScriptedClient(tok, "first", version=7), ScriptedClient(tok, "second", version=7)]

    async def main() -> list[Episode]:
        proxy = InferenceProxy()
        await proxy.start()
        episodes = [Episode(env, c, SamplingParams(), env.follow_ups) for c in clients]
        try:
            with proxy.serve(episodes[0]) as one, proxy.serve(episodes[1]) as two:
                assert one.shared_base_url == two.shared_base_url
                openai = AsyncOpenAI(base_url=one.shared_base_url, api_key="not the rollouts' secret")
                for endpoint, text in ((two, "to two"), (one, "to one")):
                    await openai.chat.completions.create(model="m", messages=[{"role": "user", "content": text}],
                                                         extra_headers=endpoint.headers)
        finally:
            await proxy.close()
        return episodes

    episodes = asyncio.run(main())
    assert [env.decode(e.turns[0].completion_ids) for e in episodes] == ["first", "second"]
    assert [e.prompt_ids for e in episodes] == [chat_prompt_ids(tok, [{"role": "user", "content": t}])
                                                for t in ("to one", "to two")]


def test_one_proxy_serves_an_event_loops_episodes_and_another_loop_gets_its_own():
    async def main() -> tuple[InferenceProxy, InferenceProxy, int | None]:
        first, second = await asyncio.gather(shared_proxy(), shared_proxy())
        port = first.port
        await close_loop_locals()
        return first, second, port

    first, second, port = asyncio.run(main())
    other, _, other_port = asyncio.run(main())
    assert first is second and other is not first
    assert port is not None and other_port is not None


def test_a_proxy_for_a_harness_on_another_host_listens_where_told_and_names_the_advertised_address():
    """127.0.0.2 stands for this host's address on a network, 127.0.0.3 for another name of it."""

    async def main() -> tuple[str, str, str]:
        told = await shared_proxy("127.0.0.2", "127.0.0.3")
        default = await shared_proxy()
        with told.serve(None) as far, default.serve(None) as near:  # type: ignore[arg-type]
            bound = told._runner.addresses[0][0]
            roots = far.root, near.root
        await close_loop_locals()
        return bound, *roots

    bound, far, near = asyncio.run(main())
    assert bound == "127.0.0.2" and far.startswith("http://127.0.0.3:") and near.startswith("http://127.0.0.1:")
    with pytest.raises(ValueError, match="a proxy bound to '0.0.0.0' needs the address to advertise"):
        InferenceProxy("0.0.0.0")


def test_an_agent_that_fails_times_out_or_never_calls_the_model_errors_its_rollout_naming_why(tok, tmp_path, dataset):
    scripts = {
        "fails": "import sys; print('bad input', file=sys.stderr); sys.exit(3)",
        "sleeps": "import time; time.sleep(30)",
        "silent": "print('{\"reward\": 1}')",
    }
    client = ScriptedClient(tok, version=7)
    messages = {}
    for name, code in scripts.items():
        script = tmp_path / f"{name}.py"
        script.write_text(code)
        env = make_env("agent", tok, command=[sys.executable, str(script)], dataset=str(dataset), timeout_s=2)
        with pytest.raises(Exception) as caught:
            asyncio.run(env.run(client, ROWS[0], env.render_prompt(ROWS[0]), SamplingParams()))
        messages[name] = str(caught.value)
    assert messages["fails"].endswith("exited with status 3: bad input")
    assert "still running after timeout_s = 2 s" in messages["sleeps"]
    assert "exited without calling the model" in messages["silent"]
    with pytest.raises(ValueError, match="is not an executable"):
        make_env("agent", tok, command="/no/such/agent --flag", dataset=str(dataset))
    with pytest.raises(ValueError, match="needs `dataset`"):
        make_env("agent", tok, command=[sys.executable])
