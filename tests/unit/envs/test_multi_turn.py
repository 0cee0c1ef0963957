"""The multi-turn loop (beam_rl.envs.multi_turn.Conversation), through the example in docs/environments.md
run as it is written there."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

from beam_rl.envs.base import SamplingParams
from tests.support.fakes import ScriptedClient
from tests.support.paths import REPO

DOC = REPO / "docs" / "environments.md"
ROW = {"word": "blue"}


@pytest.fixture(scope="module")
def say_the_word() -> type:
    """The class the docs' "The turn loop" section defines, from its one Python block."""
    section = DOC.read_text().split("### The turn loop: `Conversation`")[1].split("\n### ")[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    namespace: dict[str, Any] = {}
    exec(compile(code, str(DOC), "exec"), namespace)
    return namespace["SayTheWord"]


def play(env: Any, client: ScriptedClient, sampling: SamplingParams | None = None):
    prompt = env.render_prompt(ROW)
    return prompt, asyncio.run(env.run(client, ROW, prompt, sampling or SamplingParams(max_tokens=16, seed=5)))


def test_the_documented_example_runs_turns_until_the_word(tok: Any, say_the_word: type) -> None:
    env = say_the_word(tok, max_turns=4)
    client = ScriptedClient(tok, "red", ("green green", False), "blue", "never asked")
    prompt, trajectory = play(env, client)
    assert len(client.prompts) == 3 and trajectory.info == {"said_on_turn": 3}
    assert env.reward(ROW, trajectory) == 1.0
    again = tok.encode(say_the_word.AGAIN, add_special_tokens=False)
    first, second, third = trajectory.turns
    assert first.env_ids == [] and second.env_ids == again
    assert third.env_ids == [tok.eos_token_id] + again  # the cut turn is closed once
    # Each prompt is the last one + its completion + the reply: token ids, never re-tokenized text.
    assert client.prompts == [
        prompt,
        prompt + first.completion_ids + second.env_ids,
        prompt + first.completion_ids + second.env_ids + second.completion_ids + third.env_ids,
    ]
    assert [s.seed for s in client.samplings] == [5, 6, 7]


def test_out_of_turns_and_out_of_context(tok: Any, say_the_word: type) -> None:
    env = say_the_word(tok, max_turns=2)
    _, trajectory = play(env, ScriptedClient(tok, "red", "green", "blue"))
    assert len(trajectory.turns) == 2 and env.reward(ROW, trajectory) == 0.0
    assert trajectory.turns[1].env_ids != []  # a reply before the last turn; none after it

    prompt_len = len(env.render_prompt(ROW))
    env = say_the_word(tok, max_turns=5, max_context=prompt_len + 4)
    client = ScriptedClient(tok, "red", "green", "blue")
    _, trajectory = play(env, client)
    # Turn 1 may write 4 tokens; its reply leaves no room, so there is no turn 2.
    assert [s.max_tokens for s in client.samplings] == [4] and len(trajectory.turns) == 1
