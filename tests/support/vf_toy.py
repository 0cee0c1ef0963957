"""The toy verifiers environment the tests train on (tests/fixtures/vf_toy_mt, a pip-installable two-turn
environment with an `add` tool), the embedded server's scripted answers to it, and the ways to serve it:
a virtualenv of its own, a verifiers env server someone else starts on a TCP port."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from beam_rl.processes import free_port
from tests.support.paths import FIXTURES

PACKAGE = FIXTURES / "vf_toy_mt"
# The embedded server's answers, in turn: a tool call the proxy hands the harness as `tool_calls`, an answer.
REPLIES = ['<tool_call>{"name": "add", "arguments": {"a": 1, "b": 40}}</tool_call>', "It is 41."]


def answers(tok) -> list[list[int]]:
    """REPLIES as the completion ids the server samples for them."""
    return [tok.encode(text, add_special_tokens=False) + [tok.eos_token_id] for text in REPLIES]


def package_env() -> dict[str, str]:
    """This process's environment with the package importable (PYTHONPATH)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE), os.environ.get("PYTHONPATH")]))}


def external_server(log_dir: Path, num_tasks: int = 4) -> tuple[subprocess.Popen, str]:
    """A verifiers env server someone else runs: verifiers' own serve_env, started by hand on a TCP port."""
    address = f"tcp://127.0.0.1:{free_port()}"
    config = {"taskset": {"id": "vf_toy_mt", "num_tasks": num_tasks},
              "agent": {"runtime": {"type": "subprocess"}, "max_turns": 4}}
    code = ("import json, sys; import verifiers.v1 as vf; from verifiers.v1.serve import serve_env; "
            "serve_env(config=vf.resolve_env_config(json.loads(sys.argv[1])), address=sys.argv[2], max_workers=1)")
    log = open(log_dir / "external.log", "wb")
    return subprocess.Popen([sys.executable, "-c", code, json.dumps(config), address], stdout=log, stderr=log,
                            env=package_env(), start_new_session=True), address


_VIRTUALENVS: dict[str, Path] = {}


def own_virtualenv(directory: Path) -> Path:
    """A virtualenv of the environment's own, with verifiers and the package pip-installed and no beam-rl,
    built offline by uv from the versions in the project's virtualenv (its cache holds them). Built once a
    session (the first caller's `directory` holds it). Returns its python."""
    if "python" in _VIRTUALENVS:
        return _VIRTUALENVS["python"]
    uv = Path(sys.executable).parent / "uv"
    if not uv.exists():
        pytest.skip("needs uv beside the project's python (scripts/setup.sh installs it)")
    venv = directory / "env-venv"
    pins = directory / "pins.txt"
    frozen = subprocess.run([str(uv), "pip", "freeze", "--python", sys.executable], capture_output=True, text=True,
                            check=True).stdout
    pins.write_text("".join(line + "\n" for line in frozen.splitlines() if "==" in line and "beam-rl" not in line))
    subprocess.run([str(uv), "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    package = shutil.copytree(PACKAGE, directory / "package")  # building it writes build/ beside its sources
    subprocess.run([str(uv), "pip", "install", "-q", "--offline", "--python", str(venv / "bin" / "python"),
                    "-c", str(pins), "verifiers==0.4.0", str(package)], check=True)
    python = venv / "bin" / "python"
    without = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    assert subprocess.run([sys.executable, "-c", "import vf_toy_mt"], env=without,
                          capture_output=True).returncode != 0, "the package must be importable only there"
    # Bytecode for what an env server imports, written once: importing verifiers.v1 from source costs ~20 s
    # a process on this machine (PYTHONDONTWRITEBYTECODE is set here), from bytecode ~8 s.
    compiling = {k: v for k, v in without.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([str(python), "-c", "import verifiers.v1, verifiers.v1.serve, vf_toy_mt"], env=compiling,
                   check=True)
    _VIRTUALENVS["python"] = python
    return python


def serve_processes(python: Path) -> dict[int, str]:
    """pid -> address of every env server beam-rl started under `python` (its command line names both)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        except OSError:
            continue
        if len(argv) >= 4 and argv[0] == str(python).encode() and b"serve_env" in argv[2]:
            found[int(entry.name)] = argv[-1].decode()
    return found


def toy_config(run_dir: Path, envs: list[dict], *, rollouts_per_step: int, runner: dict, max_inflight: int = 8,
               **sections) -> dict:
    """The tiny run on the toy environment(s): the prompt with its tool schema is ~410 tokens."""
    return {
        "run": {"dir": str(run_dir), "max_steps": 1000},  # to the taskset's end
        "envs": envs,
        "model": {"max_context": 1024},
        "batch": {"rollouts_per_step": rollouts_per_step, "seq_len": 1024},
        "filters": {"zero_advantage": {"mode": "monitor"}},  # every group trains or is counted
        "inference": {"max_tokens": 96, "max_inflight": max_inflight},
        "runner": runner,
        **sections,
    }


def toy_env(name: str, num_tasks: int, **args) -> dict:
    return {"name": name, "kind": "verifiers", "group_size": 2, "mode": "rollout",
            "args": {"env": "vf-toy-mt", "config": {"taskset": {"num_tasks": num_tasks}}, **args}}
