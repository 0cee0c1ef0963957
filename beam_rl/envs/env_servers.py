"""Environment servers: verifiers' env-server protocol (`verifiers.v1.serve`, ZMQ: `health`, `run` with
streamed deltas, `cancel`) spoken to a server beam-rl starts in a process of its own, or to one at an
address someone else runs.

A server beam-rl starts (`ProcessEnvServer`) runs verifiers' own `serve_env` under any Python that has
verifiers and the environment installed (`python`, e.g. another virtualenv's), bound to an ipc socket in a
temporary directory. Its process is watched: when it dies, every episode in flight on it fails at once
with `EnvServerRestarted` (the protocol's client alone would wait for their replies forever) and the
server is started again; the caller runs those episodes again. A server at an address
(`RemoteEnvServer`) cannot be restarted: while episodes are in flight it is health-checked, and when it
stops answering they fail with `EnvServerDown` instead of hanging.

Each episode's model calls go to its own endpoint on the inference proxy, with its session's secret in the
episode's client config (`proxy_client`), never in the server's environment: a harness of one episode cannot
call into another's rollout.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from beam_rl.envs.proxy import Endpoint
from beam_rl.processes import scrubbed_env

log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 2.0
HEALTH_TIMEOUT_S = 2.0
START_ATTEMPTS = 3  # a server killed by a signal while it starts is started again, this many times in all
TRACE_VERSION = 1  # the verifiers trace layout this reads (verifiers.v1.trace.TRACE_VERSION)

# Runs under the server's own Python: it needs verifiers and the environment, not beam-rl.
_SERVE = """
import json, sys
import verifiers.v1 as vf
from verifiers.v1.serve import serve_env
serve_env(config=vf.resolve_env_config(json.loads(sys.argv[1])), address=sys.argv[2], max_workers=1)
"""


# Also under the server's Python: the resolved config and the taskset's rows, which the client owns (verifiers'
# servers never load a taskset), without importing the environment into beam-rl's worker.
_DESCRIBE = """
import json, sys
import verifiers.v1 as vf
try:
    config = vf.resolve_env_config(json.loads(sys.argv[1]))
    env = vf.load_environment(config)
    rows = [task.data.model_dump(mode="json") for task in env.taskset]
    print(json.dumps({"config": config.model_dump(mode="json"), "rows": rows}))
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
"""


def proxy_client(endpoint: Endpoint) -> Any:
    """verifiers' eval client config for one episode's endpoint on the inference proxy. Its Authorization
    carries the key of `api_key_var` (unset: "EMPTY"), so the session's secret travels in the proxy's own
    header, per episode."""
    import verifiers.v1 as vf

    return vf.EvalClientConfig(base_url=endpoint.base_url, api_key_var="BEAM_RL_PROXY_KEY", headers=endpoint.headers)


def interpreter_env(python: str | None, pass_env: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment of a process under `python` that runs the environment's code: an agent's (no credential
    of the worker's) plus the variables `pass_env` names. Another interpreter (another virtualenv's) is not
    handed this one's PYTHONPATH, so the Beam worker's packages never shadow the environment's own."""
    other = python is not None and python != sys.executable
    return scrubbed_env(pass_env, drop=("PYTHONPATH",) if other else ())


def describe_env(
    config: dict[str, Any], python: str | None = None, pass_env: tuple[str, ...] = ()
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the resolved config, the taskset's rows) of a verifiers env config, loaded under `python` (a process
    of its own) or, without it, in this process. Raises ValueError with verifiers' reason. Under `python`,
    once a process: a worker's stages each build the environment, and each load there is a new interpreter
    importing verifiers (seconds)."""
    if python is None:
        return _describe(config, None)
    described = _described_under(json.dumps(config, sort_keys=True), python, pass_env)
    return copy.deepcopy(described)


@functools.lru_cache(maxsize=16)
def _described_under(
    config: str, python: str, pass_env: tuple[str, ...]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    return _describe(json.loads(config), python, pass_env)


def _describe(
    config: dict[str, Any], python: str | None, pass_env: tuple[str, ...] = ()
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    if python is None:
        import verifiers.v1 as vf

        try:
            resolved = vf.resolve_env_config(config)
            env = vf.load_environment(resolved)
            return resolved.model_dump(mode="json"), [task.data.model_dump(mode="json") for task in env.taskset]
        except Exception as exc:
            raise ValueError(f"{type(exc).__name__}: {exc}") from exc
    if shutil.which(python) is None:
        raise ValueError(f"python {python!r} is not an executable")
    done = subprocess.run(
        [python, "-c", _DESCRIBE, json.dumps(config)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=interpreter_env(python, pass_env),
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = done.stderr.strip().splitlines()
        raise ValueError(f"{python} could not load it (status {done.returncode})" + (f": {tail[-1]}" if tail else ""))
    described = json.loads(lines[-1])
    if "error" in described:
        raise ValueError(described["error"])
    return described["config"], described["rows"]


class EnvServerError(RuntimeError):
    """An environment server could not be started, or would not answer."""


class EnvServerRestarted(EnvServerError):
    """The server died under an episode and was started again: the episode is to run again."""


class EnvServerKilled(EnvServerError):
    """An env server a signal ended while it started (not its environment failing): started again."""


class EnvServerDown(EnvServerError):
    """A server beam-rl does not run stopped answering while an episode was in flight on it."""


class _Episodes:
    """The episodes in flight on one server, and how to fail them all at once."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[Any]] = set()
        self.failure: dict[asyncio.Task[Any], EnvServerError] = {}

    async def run(self, coroutine: Any) -> Any:
        task = asyncio.ensure_future(coroutine)
        self.tasks.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            failure = self.failure.pop(task, None)
            if failure is not None and not _cancelling():
                raise failure from None
            raise
        finally:
            self.tasks.discard(task)
            self.failure.pop(task, None)

    def fail_all(self, failure: EnvServerError) -> int:
        for task in self.tasks:
            self.failure[task] = failure
            task.cancel()
        return len(self.tasks)


def _cancelling() -> bool:
    # Whether this task itself is being cancelled (the rollout was), not only the episode under it.
    task = asyncio.current_task()
    return task is not None and getattr(task, "cancelling", lambda: 0)() > 0  # Task.cancelling: Python 3.11+


class _Server:
    """What both kinds share: the protocol's client, the trace-version check, the episodes in flight."""

    name: str
    address: str

    def __init__(self) -> None:
        self.client: Any = None
        self.episodes = _Episodes()

    async def run(self, *, task_data: dict[str, Any], endpoint: Endpoint, timeout_s: float) -> Any:
        """One episode of `task_data`, its model calls sent to `endpoint` on the inference proxy; returns
        verifiers' WireEpisode."""
        import verifiers.v1 as vf

        versions: list[Any] = []

        def on_delta(delta: dict[str, Any]) -> None:
            if "open" in delta:
                versions.append(delta["open"].get("version"))

        call = self.client.run(
            client=proxy_client(endpoint),
            model="policy",
            sampling=vf.SamplingConfig(),
            task_data=task_data,
            on_delta=on_delta,
        )
        try:
            episode = await asyncio.wait_for(self.episodes.run(call), timeout_s)
        except TimeoutError:
            raise EnvServerError(
                f"env server {self.name}: the episode ran past timeout_s = {timeout_s:g} s; cancelled"
            ) from None
        except RuntimeError as exc:  # the server answered success = false
            if isinstance(exc, EnvServerError):
                raise
            raise EnvServerError(f"env server {self.name}: the episode failed: {exc}") from exc
        unknown = [v for v in versions if v != TRACE_VERSION]
        if unknown:
            raise EnvServerError(
                f"env server {self.name} sends traces of version {unknown[0]}; beam-rl reads "
                f"version {TRACE_VERSION} (verifiers 0.4)"
            )
        return episode

    async def _healthy(self) -> bool:
        try:
            return bool(await self.client.health(timeout=HEALTH_TIMEOUT_S))
        except TimeoutError:
            return False


class ProcessEnvServer(_Server):
    """A verifiers env server in a process beam-rl starts, watched and restarted when it dies."""

    def __init__(
        self,
        name: str,
        config: dict[str, Any],
        *,
        python: str | None = None,
        startup_timeout_s: float = 120.0,
        env: dict[str, str] | None = None,
        pass_env: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self.name = name
        self.config = config
        self.python = python or sys.executable
        self._python_env = interpreter_env(python, pass_env)
        if shutil.which(self.python) is None:
            raise EnvServerError(f"env server {name}: python {self.python!r} is not an executable")
        self.startup_timeout_s = startup_timeout_s
        self.env = env
        self._dir = Path(tempfile.mkdtemp(prefix="beam-rl-env-"))
        self.address = f"ipc://{self._dir / 'server'}"
        self.log_path = self._dir / "server.log"
        self.process: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self.recoveries_s: list[float] = []
        self._watcher: asyncio.Task[None] | None = None
        self._closing = False

    async def start(self) -> None:
        from verifiers.v1.serve import EnvClient

        self.client = EnvClient(self.address)
        for attempt in range(START_ATTEMPTS):
            await self._spawn()
            try:
                await self._wait_healthy()
                break
            except EnvServerKilled as exc:  # a signal, not the environment: started again, as a death later is
                if attempt == START_ATTEMPTS - 1:
                    raise
                log.warning("%s; starting it again", exc)
        self._watcher = asyncio.create_task(self._watch(), name=f"env server {self.name}")

    async def _spawn(self) -> None:
        with open(self.log_path, "ab") as out:
            self.process = await asyncio.create_subprocess_exec(
                self.python,
                "-c",
                _SERVE,
                json.dumps(self.config),
                self.address,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
                env={**self._python_env, **(self.env or {})},
            )

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.returncode is not None:
                status = self.process.returncode
                if status < 0:
                    raise EnvServerKilled(f"env server {self.name} was killed by signal {-status} while starting")
                raise EnvServerError(f"env server {self.name} exited with status {status} at start{self._log_tail()}")
            if await self._healthy():
                return
            await asyncio.sleep(0.2)
        raise EnvServerError(
            f"env server {self.name} did not answer its health check within "
            f"{self.startup_timeout_s:g} s{self._log_tail()}"
        )

    def _log_tail(self) -> str:
        try:
            lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return ""
        return f": {lines[-1]}" if lines else ""

    async def _watch(self) -> None:
        while not self._closing:
            assert self.process is not None
            status = await self.process.wait()
            if self._closing:
                return
            died_at = time.monotonic()
            failed = self.episodes.fail_all(
                EnvServerRestarted(
                    f"env server {self.name} died (status {status}) under the episode; it is started again"
                )
            )
            log.warning(
                "env server %s died (status %s) with %d episodes in flight; starting it again",
                self.name,
                status,
                failed,
            )
            while not self._closing:
                try:
                    await self._spawn()
                    await self._wait_healthy()
                    break
                except EnvServerError as exc:
                    log.error("%s; trying again", exc)
                    await asyncio.sleep(1.0)
            self.restarts += 1
            self.recoveries_s.append(time.monotonic() - died_at)
            log.warning("env server %s is back after %.2f s", self.name, self.recoveries_s[-1])

    async def close(self) -> None:
        self._closing = True
        if self._watcher is not None:
            self._watcher.cancel()
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), 5.0)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                await self.process.wait()
        if self.client is not None:
            await self.client.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class RemoteEnvServer(_Server):
    """A verifiers env server at `address` (tcp://HOST:PORT) that beam-rl does not run."""

    def __init__(self, name: str, address: str, *, startup_timeout_s: float = 60.0) -> None:
        super().__init__()
        self.name = name
        self.address = address
        self.startup_timeout_s = startup_timeout_s
        self._watcher: asyncio.Task[None] | None = None

    async def start(self) -> None:
        from verifiers.v1.serve import EnvClient

        self.client = EnvClient(self.address)
        deadline = time.monotonic() + self.startup_timeout_s
        while not await self._healthy():
            if time.monotonic() > deadline:
                await self.client.close()
                raise EnvServerError(
                    f"env server {self.name} at {self.address} did not answer its health check "
                    f"within {self.startup_timeout_s:g} s"
                )
            await asyncio.sleep(0.5)
        self._watcher = asyncio.create_task(self._watch(), name=f"env server {self.name}")

    async def _watch(self) -> None:
        misses = 0
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            if not self.episodes.tasks:
                misses = 0
                continue
            misses = 0 if await self._healthy() else misses + 1
            if misses >= 2:
                failed = self.episodes.fail_all(
                    EnvServerDown(f"env server {self.name} at {self.address} stopped answering its health checks")
                )
                log.error("env server %s at %s stopped answering: %d episodes failed", self.name, self.address, failed)

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        await self.client.close()


def env_server(
    name: str,
    server: str,
    config: dict[str, Any],
    *,
    python: str | None,
    startup_timeout_s: float,
    pass_env: tuple[str, ...] = (),
) -> Callable[[], ProcessEnvServer | RemoteEnvServer]:
    """A factory of the server `server` names: "process" (given the variables `pass_env` names), or
    "tcp://HOST:PORT"."""
    if server == "process":
        return lambda: ProcessEnvServer(
            name, config, python=python, startup_timeout_s=startup_timeout_s, pass_env=pass_env
        )
    if server.startswith("tcp://"):
        return lambda: RemoteEnvServer(name, server, startup_timeout_s=startup_timeout_s)
    raise ValueError(f"env {name}: server must be \"inline\", \"process\" or \"tcp://HOST:PORT\", got {server!r}")
