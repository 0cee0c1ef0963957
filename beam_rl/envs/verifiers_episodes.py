"""A verifiers v1 environment run whole: its taskset's tasks are the rows, and each rollout is one of its
episodes (its harness, turns, tools, runtime, rewards and metrics), run the way verifiers runs them.

The episode's model calls go to the inference proxy (beam_rl/envs/proxy.py) as verifiers' own eval client
sends them, so each is a turn of the rollout, sampled by the dispatcher's client and kept token for token
(what the harness or a tool wrote is the template's ids between turns, masked out of the loss). The
environment runs in the dispatch worker (`server = "inline"`), or in an env server: one beam-rl starts in
a process of its own, with its own Python if given (`"process"`), or one at an address (`"tcp://..."`),
spoken to with verifiers' env-server protocol (beam_rl/envs/env_servers.py). Its harnesses are set up
(what they install, into the project's cache) when it is built, not by its first episodes
(beam_rl/envs/verifiers_setup.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from beam_rl.cache import cache_root
from beam_rl.envs import verifiers_setup
from beam_rl.envs.base import (
    CompletionClient,
    DatasetEnvironment,
    RewardUnavailable,
    SamplingParams,
    Trajectory,
    chat_prompt_ids,
)
from beam_rl.envs.env_servers import (
    EnvServerError,
    EnvServerRestarted,
    describe_env,
    env_server,
    interpreter_env,
    proxy_client,
)
from beam_rl.envs.loop_local import loop_local
from beam_rl.envs.multi_turn import FollowUps
from beam_rl.envs.proxy import Endpoint, Episode, check_address, shared_proxy
from beam_rl.listeners import LOOPBACK


class VerifiersEpisodeError(RuntimeError):
    """A verifiers episode that ended in error (its harness failed, a task hook raised)."""


def verifiers_module() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise ImportError(
            f"the verifiers environment needs verifiers>=0.4 importable in this process ({type(exc).__name__}: "
            f"{exc}); see docs/environments.md"
        ) from exc
    return vf


def task_messages(data: dict[str, Any]) -> list[dict[str, Any]]:
    """A task's system prompt and prompt (its TaskData, as JSON) as chat messages."""
    messages: list[dict[str, Any]] = []
    if data.get("system_prompt"):
        messages.append({"role": "system", "content": data["system_prompt"]})
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    else:
        messages += [{k: v for k, v in m.items() if v is not None} for m in prompt or []]
    return messages


def harness_install_env(python: str | None = None) -> dict[str, str]:
    """Where the harnesses' installs go: `cache_root()/verifiers` (uv, the packages, the script environments),
    with the `uv` found on PATH or beside `python` (this one's by default) linked in, so none is installed."""
    beside = Path(python or sys.executable).parent / "uv"
    uv = shutil.which("uv") or (str(beside) if beside.exists() else None)
    return verifiers_setup.install_env(str(cache_root() / "verifiers"), os.environ.get("PATH", os.defpath), uv)


def set_up_harnesses(
    env_id: str, config: dict[str, Any], python: str | None, timeout_s: float, pass_env: tuple[str, ...] = ()
) -> dict[str, dict[str, Any]]:
    """Each seat's harness (on the subprocess runtime) set up within `timeout_s`, here or under `python` (in the
    environment its env server gets), once a process: {seat: its pinned harness config}. ValueError, one line,
    naming the harness, when it cannot be."""
    try:
        return copy.deepcopy(_set_up(json.dumps(config, sort_keys=True), python, timeout_s, pass_env))
    except ValueError as exc:
        raise ValueError(f"verifiers env {env_id!r}: {exc}") from None


@functools.lru_cache(maxsize=16)
def _set_up(config: str, python: str | None, timeout_s: float, pass_env: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    env = harness_install_env(python)
    if python is None:
        # In a thread: the caller may be inside an event loop; the prepared programs stay known to this
        # process's subprocess runtimes (verifiers keeps them per process), so episodes reuse them.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(verifiers_setup.set_up_within, json.loads(config), env, timeout_s).result()
    else:
        done = subprocess.run(
            [python, verifiers_setup.__file__, config, json.dumps(env), str(timeout_s)],
            capture_output=True,
            text=True,
            timeout=timeout_s + 300,
            check=False,
            env=interpreter_env(python, pass_env),
        )
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            tail = done.stderr.strip().splitlines()
            raise ValueError(
                f"its harnesses could not be set up: {python} exited with status {done.returncode}"
                + (f": {tail[-1]}" if tail else "")
            )
        answer = json.loads(lines[-1])
    if "error" in answer:
        raise ValueError(answer["error"])
    return answer["harnesses"]


class _InlineEnv:
    """The environment in this process, serving (its tool servers and interception up) while the loop runs."""

    def __init__(self, name: str, config: dict[str, Any]) -> None:
        vf = verifiers_module()
        self.name = name
        self.env = vf.load_environment(vf.resolve_env_config(config))
        self.task_type = type(self.env.taskset).task_type()

    async def start(self, stack: contextlib.AsyncExitStack) -> _InlineEnv:
        await stack.enter_async_context(self.env.serving())
        return self

    async def run(self, *, task_data: dict[str, Any], endpoint: Endpoint, timeout_s: float) -> Any:
        vf = verifiers_module()
        task = self.task_type(self.task_type.data_type().model_validate(task_data), self.env.config.taskset.task)
        context = vf.ModelContext(model="policy", sampling=vf.SamplingConfig(), client=proxy_client(endpoint))
        (slot,) = self.env.slots(task)
        try:
            return await asyncio.wait_for(self.env.run_slot(slot, context), timeout_s)
        except TimeoutError:
            raise VerifiersEpisodeError(
                f"verifiers env {self.name}: the episode ran past timeout_s = {timeout_s:g} s; cancelled"
            ) from None


class VerifiersEpisodes(DatasetEnvironment):
    """`env` is the environment's id (its module: an installed package, or one on PYTHONPATH), `config` its
    verifiers config (`taskset`, `agent`, the env's own keys; the agent's runtime defaults to a local
    subprocess and its `max_turns` to this entry's). `server` is "inline", "process" (with `python`, the
    interpreter of another virtualenv) or "tcp://HOST:PORT"; each seat's harness is set up when this is built
    (inline, process: `setup_timeout_s`, into the project's cache; beam_rl/envs/verifiers_setup.py);
    `timeout_s` bounds an episode, and an episode whose server died under it runs again up to `max_restarts`
    times. An env server on another host reaches the inference proxy at `proxy_advertise` where it listens
    on `proxy_host`. A "process" server gets the environment an agent's program gets (no credential of the
    worker's) plus the variables `pass_env` names (a key the environment's own tools need)."""

    name = "verifiers"
    multi_turn = True

    def __init__(
        self,
        tokenizer: Any,
        max_turns: int = 4,
        *,
        env: str,
        config: dict[str, Any] | None = None,
        server: str = "inline",
        python: str | None = None,
        timeout_s: float = 600.0,
        setup_timeout_s: float = 600.0,
        startup_timeout_s: float = 120.0,
        max_restarts: int = 3,
        proxy_host: str = LOOPBACK,
        proxy_advertise: str | None = None,
        pass_env: list[str] | None = None,
        max_context: int | None = None,
    ) -> None:
        super().__init__(tokenizer, max_turns, max_context=max_context)
        self.env_id = env
        if server == "inline" and (proxy_host != LOOPBACK or proxy_advertise is not None):
            raise ValueError(
                f"verifiers env {env!r}: an inline harness reaches the proxy on loopback; "
                "proxy_host and proxy_advertise are for an env server on another host"
            )
        try:
            check_address(proxy_host, proxy_advertise)
        except ValueError as exc:
            raise ValueError(f"verifiers env {env!r}: {exc} (proxy_advertise)") from None
        self.proxy_address = (proxy_host, proxy_advertise)
        raw = dict(config or {})
        agent = {"runtime": {"type": "subprocess"}, "max_turns": max_turns, **raw.pop("agent", {})}
        raw = {**raw, "taskset": {**raw.get("taskset", {}), "id": env}, "agent": agent}
        if timeout_s <= 0 or setup_timeout_s <= 0 or max_restarts < 0:
            raise ValueError("timeout_s and setup_timeout_s must be > 0 and max_restarts >= 0")
        if server == "inline" and python is not None:
            raise ValueError(f"verifiers env {env!r}: `python` runs it in a process of its own (server = \"process\")")
        if server != "process" and pass_env:
            raise ValueError(
                f"verifiers env {env!r}: pass_env names variables for an env server beam-rl starts "
                "(server = \"process\"); inline, the environment has the worker's"
            )
        passed = tuple(str(name) for name in pass_env or ())
        self.timeout_s, self.max_restarts = timeout_s, max_restarts
        self.server = server
        # The client owns the taskset, as verifiers' does. Under `python`, the environment is loaded there:
        # its packages need not be importable here.
        try:
            self.config, self._rows = describe_env(raw, python if server != "inline" else None, passed)
        except ValueError as exc:
            raise ValueError(f"verifiers env {env!r} cannot be loaded: {exc}") from None
        if server in ("inline", "process"):  # a server at an address sets its harnesses up on its own host
            for seat, harness in set_up_harnesses(env, self.config, python, setup_timeout_s, passed).items():
                self.config[seat]["harness"] = harness
        self._server = (
            None
            if server == "inline"
            else env_server(
                env, server, self.config, python=python, startup_timeout_s=startup_timeout_s, pass_env=passed
            )
        )
        stops = self.stop_token_ids()
        if not stops:
            raise ValueError("the verifiers environment needs a tokenizer with an eos token (the end of a turn)")
        self.follow_ups = FollowUps(tokenizer, stops[0])

    def load_rows(self, split: str = "train") -> list[dict[str, Any]]:
        if split != "train":
            raise ValueError(
                f"verifiers env {self.env_id!r}: only its taskset's tasks are rows (split 'train'), not {split!r}"
            )
        return [dict(row) for row in self._rows]

    def render_prompt(self, row: dict[str, Any]) -> list[int]:
        # The group's prompt, for admission and prefix affinity; the rollout's own is its harness's first call.
        return chat_prompt_ids(self.tokenizer, task_messages(row))

    async def _runner(self) -> Any:
        async def start(stack: contextlib.AsyncExitStack) -> Any:
            if self._server is None:
                return await _InlineEnv(self.env_id, self.config).start(stack)
            server = self._server()
            await server.start()
            stack.push_async_callback(server.close)
            return server

        return await loop_local(("verifiers", id(self)), start)

    async def run(
        self, client: CompletionClient, row: dict[str, Any], prompt_ids: list[int], sampling: SamplingParams
    ) -> Trajectory:
        runner = await self._runner()
        proxy = await shared_proxy(*self.proxy_address)
        restarts = discarded = 0
        while True:
            episode = Episode(self, client, sampling, self.follow_ups)
            try:
                with proxy.serve(episode) as endpoint:
                    wire = await runner.run(task_data=row, endpoint=endpoint, timeout_s=self.timeout_s)
                break
            except EnvServerRestarted:
                discarded += sum(len(t.completion_ids) for t in episode.turns)
                restarts += 1
                if restarts > self.max_restarts:
                    raise EnvServerError(
                        f"verifiers env {self.env_id!r}: its server died under this episode {restarts} times"
                    ) from None
            finally:
                await episode.aclose()
        if episode.failure is not None:
            raise episode.failure  # the inference error itself: a server's fault counts as one
        return episode.trajectory(self._info(wire, episode, restarts, discarded))

    def _info(self, wire: Any, episode: Episode, restarts: int, discarded: int) -> dict[str, Any]:
        if len(wire.traces) != 1:
            raise VerifiersEpisodeError(
                f"verifiers env {self.env_id!r}: the episode has {len(wire.traces)} traces; a rollout trains one"
            )
        (trace,) = wire.traces
        if not wire.ok or not trace.ok:
            errors = [e.message for e in [*wire.errors, *trace.errors]] or [str(trace.stop_condition)]
            raise VerifiersEpisodeError(f"verifiers env {self.env_id!r}: the episode failed: {'; '.join(errors)}")
        sampled = sum(1 for node in trace.nodes if node.sampled)
        if sampled != len(episode.turns):
            raise VerifiersEpisodeError(
                f"verifiers env {self.env_id!r}: the trace has {sampled} sampled turns, "
                f"the proxy saw {len(episode.turns)}: a model call bypassed beam-rl"
            )
        unscored = sorted(name for name, value in trace.rewards.items() if value is None)
        return {
            "reward": None if unscored else trace.reward,
            "unscored": unscored,
            "rewards": {name: value.score for name, value in trace.rewards.items() if value is not None},
            "metrics": dict(trace.metrics),
            "stop_condition": trace.stop_condition,
            "env_server_restarts": restarts,
            "discarded_tokens": discarded,
        }

    def reward(self, row: dict[str, Any], trajectory: Trajectory) -> float:
        reward = trajectory.info.get("reward")
        if reward is None:
            raise RewardUnavailable(f"verifiers rewards {trajectory.info.get('unscored')} produced no score")
        return float(reward)
