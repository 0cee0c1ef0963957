"""An environment from the verifiers repository (tests/fixtures/glossary, vendored as its users have it) with
its default harness, verifiers' `bash` chat program: its set-up (uv and the program's packages, synced from
the package index) is done once, when the environment is built, within `setup_timeout_s`, into the
project's cache rather than `~/.local` and `~/.cache/uv`; then its episodes run inline and in an env server
beam-rl starts. A harness that cannot set up (its package index unreachable) is one line, before any episode.

The first run fetches the program's packages from PyPI into the cache (`cache_root()/verifiers`); later
runs reuse it."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest

from beam_rl.cache import cache_root
from beam_rl.envs import make_env
from beam_rl.processes import free_port
from beam_rl.standin.faults import FaultConfig
from beam_rl.standin.simulated import SimulatedParams
from tests.support.dispatching import dispatcher_thread, group_requests, run_groups
from tests.support.paths import FIXTURES

pytestmark = pytest.mark.timeout(600)

PACKAGE = FIXTURES / "glossary"
# The server's answers, in turn: the tool call (the proxy hands the chat program `tool_calls`), the answer.
REPLIES = ['<tool_call>{"name": "facts_lookup", "arguments": {"name": "ada lovelace"}}</tool_call>',
           "<answer>the first computer programmer</answer>"]
# The bash harness's first prompt (its system prompt, the bash, edit and facts_lookup tools' schemas, the task)
# is ~1,200 tokens in the tiny tokenizer's template (998 without the edit tool), past the tiny model's 1,024:
# the server is the simulated engine, the tiny tokenizer's with a context of 4,096.
SIMULATED = {"max_model_len": 4096, "time_scale": 0.01}


def answers(tok) -> list[list[int]]:
    """REPLIES as the completion ids the server samples for them."""
    return [tok.encode(text, add_special_tokens=False) + [tok.eos_token_id] for text in REPLIES]


@pytest.fixture
def glossary_on_path(monkeypatch) -> Path:
    """The package importable here and in every process started from here; a HOME of the tests' own, so what
    a harness would install into ~/.local or ~/.cache/uv is seen. It and the cache stay from run to run:
    verifiers keeps its programs under HOME, and uv's environment for one is keyed by its path."""
    monkeypatch.setenv("BEAM_RL_CACHE", str(cache_root()))
    monkeypatch.syspath_prepend(str(PACKAGE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(PACKAGE), os.environ.get("PYTHONPATH")])))
    home = cache_root() / "tests" / "home"
    for installed in (home / ".local", home / ".cache" / "uv"):
        shutil.rmtree(installed, ignore_errors=True)
    home.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("HOME", str(home))
    return home


def _script_environments() -> list[Path]:
    return sorted((cache_root() / "verifiers" / "uv").glob("environments-v2/*/bin/python"))


@pytest.mark.parametrize("server", ["inline", "process"])
def test_an_ecosystem_environment_runs_with_its_default_harness_set_up_in_the_cache(
        tok, glossary_on_path, start_embedded, server):
    env = make_env("verifiers", tok, max_turns=4, env="glossary", server=server)
    # Set up when built, before any episode: the chat program's environment is in the project's cache.
    assert _script_environments(), "the harness was not set up when the environment was built"
    harness = env.config["agent"]["harness"]  # the taskset's default, pinned with the cache for its installs
    assert harness["id"] == "bash" and harness["env"]["UV_CACHE_DIR"] == str(cache_root() / "verifiers" / "uv")
    inference = start_embedded(None, mode="simulated", simulated=SimulatedParams(**SIMULATED),
                               faults=FaultConfig(replies=REPLIES))
    with dispatcher_thread([inference.url], env, "rollout", max_inflight=4, max_tokens=96) as thread:
        rollouts = run_groups(thread, group_requests(env, 1, 2), deadline_s=300)
    assert len(rollouts) == 2
    assert all(r.ok for r in rollouts), [r.errors for r in rollouts if not r.ok][:2]
    call, answer = answers(tok)
    tool = env.follow_ups.ids([{"role": "tool", "content": "the first computer programmer"}], closed=True)
    for rollout in rollouts:
        # The replies go round the episodes in flight: each called the tool until it was answered.
        *calls, last = rollout.turns
        assert [t.completion_ids for t in calls] == [call] * len(calls) and last.completion_ids == answer
        # The tool ran: what it returned is the tool message after each call, the template's ids.
        assert [t.env_ids for t in rollout.turns[1:]] == [tool] * len(calls)
        assert rollout.info["stop_condition"] == "agent_completed"
        # The task is the first, Ada Lovelace's: the answer is hers.
        assert rollout.row["answer"] == "the first computer programmer"
        assert rollout.info["rewards"] == {"looked_up": 1.0} and env.reward(rollout.row, rollout) == 1.0
    assert any(len(r.turns) > 1 for r in rollouts)  # the first reply the server gave was a tool call
    print(f"{server}: turns {[len(r.turns) for r in rollouts]}, rewards {[r.info['reward'] for r in rollouts]}, "
          f"first prompt {len(rollouts[0].prompt_ids)} tokens")
    # Nothing was installed into the user's home.
    home = glossary_on_path
    assert not (home / ".local").exists() and not (home / ".cache" / "uv").exists()


def test_a_harness_that_cannot_set_up_is_one_line_when_the_environment_is_built(tok, glossary_on_path, monkeypatch):
    """A package index nobody runs, and one that never answers (past `setup_timeout_s`), for a process that has
    not prepared the chat program yet (verifiers records what it prepared per process: a new one's record)."""
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    monkeypatch.setattr(SubprocessRuntime, "_interpreters", {})

    def built(index: str, **args) -> str:
        config = {"agent": {"harness": {"id": "bash", "env": {"UV_DEFAULT_INDEX": index}}}}
        with pytest.raises(ValueError) as raised:
            make_env("verifiers", tok, env="glossary", config=config, **args)
        assert "\n" not in str(raised.value), raised.value
        return str(raised.value)

    refused = f"http://127.0.0.1:{free_port()}/simple"
    message = built(refused)
    assert message.startswith("verifiers env 'glossary': its harness 'bash' could not be set up: "), message
    assert refused in message and "Connection refused" in message, message
    with socket.socket() as silent:  # listens, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        index = f"http://127.0.0.1:{silent.getsockname()[1]}/simple"
        message = built(index, setup_timeout_s=2)
    assert message == "verifiers env 'glossary': its harnesses were not set up within setup_timeout_s = 2 s"
