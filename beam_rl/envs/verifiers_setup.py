"""A verifiers environment's harnesses set up before its first episode: what each seat's harness installs
on the local subprocess runtime (the default `bash` harness: `uv`, then its chat program's packages, synced
from the package index into a script environment) is installed once, within a set-up budget of its own,
into the directories `install_env` names, rather than by the first episodes, inside their timeout, into
`~/.local` and `~/.cache/uv`.

Each seat's harness is pinned to the resolved one (the seat's own, else the taskset's default) with those
directories in its `env`, so every episode's harness (inline, or in an env server) finds what was installed.

It needs verifiers, not beam-rl: an env server's Python runs this file as a script (`python THIS CONFIG
TIMEOUT`), printing one JSON line: {"harnesses": {seat: config}} or {"error": "one line"}.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import sys
from typing import Any


class SetUpError(RuntimeError):
    """A harness that could not be set up: one line, naming it."""


def install_env(root: str, path: str, uv: str | None) -> dict[str, str]:
    """The variables that send a harness's installs under `root`: uv's cache (packages and script
    environments) and its Pythons, and pip's `--user` installs (verifiers' fallback for a missing uv),
    whose `bin`, first on PATH, also holds a link to `uv` where one was found."""
    from pathlib import Path

    bin_dir = Path(root) / "user" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    link = bin_dir / "uv"
    if uv is not None and not link.exists():  # none yet, or a link to a uv since removed
        link.unlink(missing_ok=True)
        with contextlib.suppress(FileExistsError):  # another process linked one first
            link.symlink_to(uv)
    return {
        "UV_CACHE_DIR": f"{root}/uv",
        "UV_PYTHON_INSTALL_DIR": f"{root}/python",
        "PYTHONUSERBASE": f"{root}/user",
        "PATH": f"{bin_dir}:{path}",
    }


def one_line(error: BaseException) -> str:
    """The error, its first cause (uv's names the URL) and its deepest on one line (uv writes `error: ...`,
    then a `cause: ...` line each)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    errors = [line for line in lines if line.startswith("error:")]
    head = errors[0] if errors else lines[0]
    causes = [line.partition(":")[2].strip() for line in lines if line.startswith(("cause:", "Caused by:"))]
    if not causes:
        return head
    return f"{head} ({causes[0]}: {causes[-1]})" if len(causes) > 1 else f"{head} ({causes[0]})"


async def set_up(config: dict[str, Any], env: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Each seat's harness config with `env` under its own, after running its set-up on a subprocess
    runtime; a seat on another runtime (a container, a sandbox) sets up in its box, per episode, as
    verifiers does, and keeps its harness as given."""
    import verifiers.v1 as vf
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.runtimes import SubprocessConfig, make_runtime
    from verifiers.v1.utils.loaders import load_harness

    resolved = vf.resolve_env_config(config)
    seats = agent_config_fields(resolved)
    pinned = {}
    for seat, harness in resolved.agent_harnesses().items():
        if not isinstance(seats[seat].runtime, SubprocessConfig):
            continue
        harness = harness.model_copy(update={"env": {**env, **harness.env}})
        runtime = make_runtime(SubprocessConfig(), name=f"beam-rl-setup-{seat}")
        try:
            await runtime.start()
            await load_harness(harness).setup(runtime)
        except Exception as exc:  # verifiers' RuntimeError with uv's output, a harness that does not load, ...
            raise SetUpError(f"its harness {harness.id!r} could not be set up: {one_line(exc)}") from exc
        finally:
            await runtime.stop()
        pinned[seat] = harness.model_dump(mode="json")
    return pinned


def set_up_within(config: dict[str, Any], env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """set_up bounded by `timeout_s`, in an event loop of its own: {"harnesses": ...} or {"error": ...}."""

    async def bounded() -> dict[str, dict[str, Any]]:
        try:
            return await asyncio.wait_for(set_up(config, env), timeout_s)
        except TimeoutError:
            # verifiers killed the program it waited on and let go of it: its pipes close here, on this loop,
            # not at the next collection, after the loop is closed ("Event loop is closed").
            gc.collect()
            raise

    try:
        return {"harnesses": asyncio.run(bounded())}
    except TimeoutError:
        return {"error": f"its harnesses were not set up within setup_timeout_s = {timeout_s:g} s"}
    except SetUpError as exc:
        return {"error": str(exc)}
    except Exception as exc:  # the config's harnesses do not resolve
        return {"error": f"its harnesses could not be set up: {one_line(exc)}"}


if __name__ == "__main__":
    print(json.dumps(set_up_within(json.loads(sys.argv[1]), json.loads(sys.argv[2]), float(sys.argv[3]))))
