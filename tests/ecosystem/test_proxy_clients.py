"""The client libraries users bring, through the inference proxy: the `openai` SDK (beam-rl's own venv),
openai-agents and litellm (a side venv of their own, built once and cached under the project's cache
dir). Each, as a black-box agent run by the dispatcher against an embedded server, lists the models (the
policy with its context window as vLLM's `max_model_len`) and makes a chat completion that is the
rollout's turn; openai-agents' default model (the Responses API) is refused with a 400 saying to use chat
completions."""

from __future__ import annotations

import fcntl
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from beam_rl.cache import cache_root
from beam_rl.envs import make_env
from beam_rl.envs.proxy import RESPONSES_REFUSED
from beam_rl.standin.faults import FaultConfig
from tests.support.dispatching import dispatcher_thread, group_requests, run_groups
from tests.integration.test_agents import start_server  # noqa: F401 (a fixture)
from tests.unit.envs.test_proxy import dataset  # noqa: F401 (a fixture)
from tests.support.paths import AGENTS

pytestmark = pytest.mark.timeout(600)

AGENT = AGENTS / "client_agent.py"
# The side venv's libraries, pinned: litellm to a release from before its compromised ones.
CLIENT_PINS = ("openai-agents==0.24.0", "litellm==1.80.0")
MAX_CONTEXT = 1024
_NETWORK_ERRORS = ("failed to fetch", "error sending request", "dns error", "connect error", "connection refused",
                   "network is unreachable", "timed out")


@pytest.fixture(scope="module")
def client_python() -> str:
    """The interpreter of a venv holding CLIENT_PINS, made with this venv's uv the first time (one process
    at a time, under a lock) and kept; skips when the package index cannot be reached."""
    digest = hashlib.sha256(" ".join(CLIENT_PINS).encode()).hexdigest()[:12]
    venv = cache_root() / "test-venvs" / f"proxy-clients-{digest}"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / "complete").exists():
            _build(venv)
    return str(venv / "bin" / "python")


def _build(venv: Path) -> None:
    uv = str(Path(sys.executable).parent / "uv")
    subprocess.run([uv, "venv", "-q", "--clear", "--python", sys.executable, str(venv)], check=True,
                   capture_output=True)
    done = subprocess.run([uv, "pip", "install", "-q", "--python", str(venv / "bin" / "python"), *CLIENT_PINS],
                          capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"status {done.returncode}"]
        if any(word in done.stderr.lower() for word in _NETWORK_ERRORS):
            pytest.skip(f"the package index is unreachable, so {' '.join(CLIENT_PINS)} cannot be installed: "
                        f"{lines[-1]}")
        pytest.fail(f"uv pip install {' '.join(CLIENT_PINS)} failed: {lines[-1]}")
    (venv / "complete").write_text(" ".join(CLIENT_PINS) + "\n")


def run_client_agent(tok, dataset, start_server, python: str, client: str):  # noqa: F811
    env = make_env("agent", tok, command=[python, str(AGENT), client], dataset=str(dataset), max_turns=2,
                   max_context=MAX_CONTEXT, timeout_s=120, env={"LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    server = start_server(faults=FaultConfig(replies=["Hello from the policy."]))
    with dispatcher_thread([server.url], env, "rollout", max_inflight=2, max_tokens=16) as thread:
        rollouts = run_groups(thread, group_requests(env, 1, 1), deadline_s=180.0)
    (rollout,) = rollouts
    assert rollout.ok, rollout.errors
    info = rollout.info["agent"]
    (turn,) = rollout.turns  # listing the models is no turn; the chat completion is the one
    assert info["reply"] == env.decode(turn.completion_ids) and info["reply"]
    return info


def test_the_openai_sdk_lists_the_policy_with_its_context_window_and_chats_through_the_proxy(
        tok, dataset, start_server):  # noqa: F811
    info = run_client_agent(tok, dataset, start_server, sys.executable, "openai")
    (model,) = info["models"]
    assert (model["id"], model["object"], model["max_model_len"]) == ("policy", "model", MAX_CONTEXT)


@pytest.mark.parametrize("client", ["openai-agents", "litellm"])
def test_agent_libraries_from_the_index_list_the_model_and_chat_through_the_proxy(
        tok, dataset, start_server, client_python, client):  # noqa: F811
    info = run_client_agent(tok, dataset, start_server, client_python, client)
    assert info["version"] == next(p.split("==")[1] for p in CLIENT_PINS if p.startswith(client + "=="))
    if client == "litellm":  # litellm lists names only
        assert info["models"] == ["policy"]
        return
    (model,) = info["models"]
    assert (model["id"], model["max_model_len"]) == ("policy", MAX_CONTEXT)
    assert info["responses_api"] == f"400: {RESPONSES_REFUSED}"
