"""The inference proxy's sessions: a rollout's endpoint answers only calls that carry its own secret, so a
program that knows (or guesses) another rollout's URL can neither add turns to that rollout nor read its
replies; each agent program is handed its own secret as its API key."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, PermissionDeniedError

from beam_rl.envs import make_env
from beam_rl.envs.base import SamplingParams
from beam_rl.envs.proxy import ROLLOUT_HEADER, SECRET_HEADER, Episode, InferenceProxy
from tests.support.fakes import ScriptedClient
from tests.unit.envs.test_proxy import ROWS, agent_env, dataset  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(180)

USER = [{"role": "user", "content": "Hi"}]


def test_a_rollouts_endpoint_answers_only_its_own_secret(tok, dataset):  # noqa: F811
    env = agent_env(tok, dataset)
    mine, theirs = ScriptedClient(tok, "mine", version=7), ScriptedClient(tok, "theirs", version=7)
    refused: dict[str, tuple[int, str]] = {}

    async def main() -> list[Episode]:
        proxy = InferenceProxy()
        await proxy.start()
        episodes = [Episode(env, client, SamplingParams(), env.follow_ups) for client in (mine, theirs)]
        try:
            with proxy.serve(episodes[0]) as me, proxy.serve(episodes[1]) as them:
                assert me.secret not in me.base_url and me.secret != them.secret
                # With my secret, their URL: writing a turn and listing their models are refused.
                sdk = AsyncOpenAI(base_url=them.base_url, api_key=me.secret, max_retries=0)
                with pytest.raises(PermissionDeniedError) as caught:
                    await sdk.chat.completions.create(model="policy", messages=USER)
                refused["sdk chat"] = caught.value.status_code, caught.value.response.text
                with pytest.raises(PermissionDeniedError):
                    await sdk.models.list()
                async with httpx.AsyncClient() as http:
                    async def post(url: str, headers: dict[str, str]) -> None:
                        answer = await http.post(url, json={"messages": USER}, headers=headers)
                        refused[f"{url} {sorted(headers)}"] = answer.status_code, answer.text

                    await post(them.base_url + "/chat/completions", {})  # no secret at all
                    await post(them.base_url + "/chat/completions", {"Authorization": "Bearer guessed"})
                    await post(them.shared_base_url + "/chat/completions",  # their name, my secret
                               {ROLLOUT_HEADER: them.key, SECRET_HEADER: me.secret})
                    await post(them.shared_base_url + "/chat/completions", {"Authorization": "Bearer guessed"})
                    await post(them.base_url.rsplit("/v1", 1)[0] + "/inference/v1/generate", {})
                # Each with its own secret: both rollouts go on, each with its own turn only.
                for endpoint in (me, them):
                    await AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.secret).chat.completions.create(
                        model="policy", messages=USER)
                # On the shared root the secret alone names its rollout (litellm lists models there).
                listed = await AsyncOpenAI(base_url=me.shared_base_url, api_key=me.secret).models.list()
                assert [m.id for m in listed.data] == ["policy"]
        finally:
            await proxy.close()
        return episodes

    episodes = asyncio.run(main())
    assert [env.decode(e.turns[0].completion_ids) for e in episodes] == ["mine", "theirs"]
    assert [len(e.turns) for e in episodes] == [1, 1] and len(theirs.calls) == 1  # nothing refused was sampled
    statuses = sorted(status for status, _ in refused.values())
    assert statuses == [401, 401, 403, 403, 403, 403], refused
    for status, body in refused.values():
        message = json.loads(body)["error"]["message"]
        assert "\n" not in body and "theirs" not in body
        assert ("carries no rollout secret" if status == 401 else "not this rollout's") in message


def test_each_agent_program_gets_its_own_rollouts_secret_as_its_api_key(tok, tmp_path, dataset):  # noqa: F811
    script = tmp_path / "env_agent.py"
    script.write_text(
        "import json, os, sys\n"
        "from openai import OpenAI\n"
        "json.load(sys.stdin)\n"
        "OpenAI().chat.completions.create(model='policy', messages=[{'role': 'user', 'content': 'Hi'}])\n"
        "print(json.dumps({'reward': 1, 'url': os.environ['OPENAI_BASE_URL'], 'key': os.environ['OPENAI_API_KEY']}))\n")
    env = make_env("agent", tok, command=[sys.executable, str(script)], dataset=str(dataset))

    async def main() -> list[Any]:
        clients = [ScriptedClient(tok, "one", version=7), ScriptedClient(tok, "two", version=7)]
        return await asyncio.gather(*(env.run(c, ROWS[0], env.render_prompt(ROWS[0]), SamplingParams())
                                      for c in clients))

    seen = [t.info["agent"] for t in asyncio.run(main())]
    assert seen[0]["key"] != seen[1]["key"] and seen[0]["url"] != seen[1]["url"]
    assert all(len(s["key"]) >= 40 and s["key"] not in s["url"] for s in seen)
