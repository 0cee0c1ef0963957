"""A verifiers v1 environment run whole (`kind = "verifiers"`, `env = ...`): its harness calls the model twice
and uses a tool (tests/fixtures/vf_toy_mt, a pip-installable package), inline in the dispatch worker, as an
env server beam-rl starts (`process`), and as one at an address (`tcp://`); its model calls go through the
inference proxy, so the rollouts carry exactly the tokens the server sampled."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import pytest

from beam_rl.envs import make_env
from beam_rl.envs.base import chat_prompt_ids
from beam_rl.envs.verifiers_episodes import task_messages
from beam_rl.standin.faults import FaultConfig
from tests.support.dispatching import dispatcher_thread, group_requests, run_groups
from tests.support.vf_toy import PACKAGE, REPLIES, answers, external_server, free_port, own_virtualenv, toy_config, toy_env

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def toy_env_on_path(monkeypatch) -> None:
    """The package importable here and, through PYTHONPATH, in every process started from here."""
    monkeypatch.syspath_prepend(str(PACKAGE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(PACKAGE), os.environ.get("PYTHONPATH")])))


@pytest.fixture
def start_server(start_embedded):
    return lambda **kwargs: start_embedded(None, mode="instant", **kwargs)


def _check_rollouts(env: Any, tok: Any, rollouts: list) -> None:
    """Two turns each, every completion one of the server's answers token for token, the tool message
    between them the template's ids, versions known, and the reward verifiers gave."""
    sampled = answers(tok)
    assert all(r.ok for r in rollouts), [r.errors for r in rollouts if not r.ok][:3]
    for rollout in rollouts:
        first, second = rollout.turns
        assert first.completion_ids in sampled and second.completion_ids in sampled
        # The rollout's prompt is the harness's first call: the task's messages with the tool it offers.
        from vf_toy_mt import ADD

        assert first.env_ids == [] and rollout.prompt_ids == chat_prompt_ids(tok, task_messages(rollout.row),
                                                                             tools=[ADD])
        tool_result = "41" if first.completion_ids == sampled[0] else str(rollout.row["a"] + rollout.row["b"])
        assert second.env_ids == env.follow_ups.ids([{"role": "tool", "content": tool_result}], closed=True)
        assert all(t.policy_versions == [0] * len(t.completion_ids) for t in rollout.turns)
        # verifiers reads the reply's content: a tool call's text is its tool_calls, not content.
        content = env.decode(second.completion_ids).split("<tool_call>")[0]
        expected = float(str(rollout.row["a"] + rollout.row["b"]) in content)
        assert rollout.info["rewards"] == {"correct": expected} and rollout.info["metrics"] == {"turns": 2.0}
        assert rollout.info["reward"] == expected and rollout.info["stop_condition"] == "agent_completed"


@pytest.mark.parametrize("server", ["inline", "process", "tcp", "tcp-advertised"])
def test_a_verifiers_environment_runs_whole_and_its_turns_are_the_sampled_tokens(
        tok, toy_env_on_path, tmp_path, start_server, server):
    external, proxy = None, {}
    if server == "tcp-advertised":  # the proxy on every address, the env server handed another of them
        proxy = {"proxy_host": "0.0.0.0", "proxy_advertise": "127.0.0.2"}
    if server.startswith("tcp"):
        external, server = external_server(tmp_path)
    try:
        env = make_env("verifiers", tok, max_turns=4, env="vf_toy_mt", server=server, **proxy)
        inference = start_server(faults=FaultConfig(replies=REPLIES))
        with dispatcher_thread([inference.url], env, "rollout", max_inflight=8, max_tokens=96) as thread:
            rollouts = run_groups(thread, group_requests(env, 4, 2))
    finally:
        if external is not None:
            external.terminate()
            external.wait()
    assert len(rollouts) == 8
    _check_rollouts(env, tok, rollouts)


def test_a_killed_env_server_is_started_again_and_its_episodes_run_again(tok, toy_env_on_path, start_server):
    env = make_env("verifiers", tok, max_turns=4, env="vf_toy_mt", server="process")
    # Slow turns: the kill lands while episodes are in flight.
    inference = start_server(faults=FaultConfig(replies=[{"text": t, "latency_s": 0.3} for t in REPLIES]))
    requests = group_requests(env, 4, 2)
    with dispatcher_thread([inference.url], env, "rollout", max_inflight=8, max_tokens=96) as thread:
        thread.add_groups(requests)
        out: list = []
        deadline = time.monotonic() + 60
        server = None
        while server is None or server.process is None or not server.episodes.tasks:
            assert time.monotonic() < deadline, "no episode started on the env server"
            out += thread.poll(0.05)
            server = _started_server(thread)
        os.killpg(server.process.pid, signal.SIGKILL)  # with episodes in flight on it
        while len(out) < 8 or server.restarts == 0:
            assert time.monotonic() < deadline + 60, f"only {len(out)} rollouts came out"
            out += thread.poll(0.2)
        restarts, recoveries = server.restarts, list(server.recoveries_s)
    print(f"env server restarted {restarts} time(s); back after {', '.join(f'{s:.2f} s' for s in recoveries)}")
    assert restarts == 1 and len(recoveries) == 1
    assert sorted(r.rollout_id for r in out) == sorted(f"{q.group_id}/{a}" for q in requests for a in range(2))
    assert sum(r.info["env_server_restarts"] for r in out) >= 1  # some episodes were on it, and ran again
    _check_rollouts(env, tok, out)


def test_an_env_server_killed_while_it_starts_is_started_again(tok, toy_env_on_path):
    """A signal is not the environment failing: the server is started again (an exit status is an error)."""
    import asyncio

    env = make_env("verifiers", tok, env="vf_toy_mt", server="process")

    async def main() -> tuple[int, int]:
        server = env._server()
        starting = asyncio.create_task(server.start())
        while server.process is None:
            await asyncio.sleep(0.01)
        killed = server.process.pid
        os.killpg(killed, signal.SIGKILL)
        await starting
        try:
            return killed, server.process.pid
        finally:
            await server.close()

    killed, serving = asyncio.run(main())
    assert serving != killed


def _started_server(thread) -> Any:
    from beam_rl.envs import loop_local

    for held in list(loop_local._LOOPS.values()):
        for future in list(held.started.values()):
            if future.done() and not future.exception() and hasattr(future.result(), "restarts"):
                return future.result()
    return None


def test_bad_environments_and_servers_are_named_with_what_is_wrong(tok, toy_env_on_path, start_server, monkeypatch):
    with pytest.raises(ValueError, match=r"verifiers env 'no_such_env' cannot be loaded: .*no_such_env"):
        make_env("verifiers", tok, env="no_such_env")
    with pytest.raises(ValueError, match=r"give `env` .* or `taskset`"):
        make_env("verifiers", tok)
    with pytest.raises(ValueError, match=r"verifiers env 'vf_toy_mt' cannot be loaded: python '/no/python' is not"):
        make_env("verifiers", tok, env="vf_toy_mt", server="process", python="/no/python")
    with pytest.raises(ValueError, match=r"server must be \"inline\", \"process\" or \"tcp://HOST:PORT\""):
        make_env("verifiers", tok, env="vf_toy_mt", server="udp://x")
    with pytest.raises(ValueError, match=r"'vf_toy_mt': an inline harness reaches the proxy on loopback"):
        make_env("verifiers", tok, env="vf_toy_mt", proxy_host="0.0.0.0", proxy_advertise="h")
    with pytest.raises(ValueError, match=r"'vf_toy_mt': a proxy bound to '0.0.0.0' needs the address to advertise"):
        make_env("verifiers", tok, env="vf_toy_mt", server="tcp://127.0.0.1:1", proxy_host="0.0.0.0")

    inference = start_server(faults=FaultConfig(replies=REPLIES))
    # Nothing answers at the address: every rollout fails, naming the server, within its startup timeout.
    silent = make_env("verifiers", tok, env="vf_toy_mt", server=f"tcp://127.0.0.1:{free_port()}",
                      startup_timeout_s=1)
    # A harness that raises: the episode's error, naming the environment. The server sees the switch only
    # because pass_env names it: it is given none of the worker's environment but the scrubbed one.
    monkeypatch.setenv("BEAM_RL_TOY_RAISE", "1")
    failing = make_env("verifiers", tok, env="vf_toy_mt", server="process", pass_env=["BEAM_RL_TOY_RAISE"])
    for env, message in ((silent, "did not answer its health check within 1 s"),
                         (failing, "verifiers env 'vf_toy_mt': the episode failed")):
        with dispatcher_thread([inference.url], env, "rollout", max_inflight=4, max_tokens=96) as thread:
            rollouts = run_groups(thread, group_requests(env, 1, 2))
        assert [r.ok for r in rollouts] == [False, False]
        assert all(message in r.errors[-1] for r in rollouts), [r.errors for r in rollouts]


def test_inline_process_and_tcp_env_servers_train_on_prism(tok, tmp_path, monkeypatch):
    """The tiny run on Prism with the environment three ways at once: inline in the worker, in a process of
    its own under its own virtualenv's Python (the package importable there, not in this process's
    environment), and at a TCP address: the rank files hold the tokens the server sampled, for each."""
    from beam_rl.config import config_from_dict
    from beam_rl.rundir import RunDir
    from beam_rl.standin.server import EmbeddedServer
    from beam_rl.job.rollouts import run_rollouts
    from tests.support.run_checks import assert_rank_files_hold_the_windows_tokens

    python = own_virtualenv(tmp_path)
    external, address = external_server(tmp_path)
    monkeypatch.syspath_prepend(str(PACKAGE))  # for the inline one: Prism's loopback workers are this process
    config = config_from_dict(toy_config(tmp_path / "run", [
        toy_env("inline", 4), toy_env("process", 4, server="process", python=str(python)),
        toy_env("tcp", 4, server=address)], rollouts_per_step=4, runner={"name": "direct"}))
    server = EmbeddedServer(mode="instant", served_model_name="tiny", max_num_seqs=16,
                            faults=FaultConfig(replies=REPLIES))
    try:
        run_rollouts(config, [server.start()], with_trainer=False)
    finally:
        server.stop()
        external.terminate()
        external.wait()
    rollouts = assert_rank_files_hold_the_windows_tokens(RunDir(tmp_path / "run"))
    assert RunDir(tmp_path / "run").committed_steps() == list(range(1, 7))
    assert sorted(r["env"] for r in rollouts) == ["inline"] * 8 + ["process"] * 8 + ["tcp"] * 8
    sampled = answers(tok)
    for rollout in rollouts:
        assert [t["completion_ids"] for t in rollout["turns"]] in ([a, b] for a in sampled for b in sampled)


def test_an_environment_under_another_python_is_described_once_a_process(tok, toy_env_on_path, tmp_path):
    """A worker's stages each build the environment; the taskset is read, and its harness set up, under its
    python once, not once each (every run there is an interpreter importing verifiers)."""
    from beam_rl.envs.env_servers import _described_under
    from beam_rl.envs.verifiers_episodes import _set_up

    calls = tmp_path / "calls"
    python = tmp_path / "counting-python"
    python.write_text(f'#!/bin/sh\necho x >> "{calls}"\nPYTHONPATH="{PACKAGE}" exec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    _described_under.cache_clear()
    _set_up.cache_clear()
    envs = [make_env("verifiers", tok, max_turns=4, env="vf_toy_mt", server="process", python=str(python),
                     config={"taskset": {"num_tasks": 3}}) for _ in range(2)]
    assert calls.read_text().count("x") == 2  # one read, one set-up
    assert envs[0].load_rows() == envs[1].load_rows() and len(envs[0].load_rows()) == 3
    envs[0].load_rows()[0]["a"] = -1  # each environment's rows are its own
    assert envs[1].load_rows()[0]["a"] != -1
