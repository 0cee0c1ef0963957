"""Start the embedded server as a subprocess (`python -m beam_rl.standin.server`) and wait until
it prints `READY <url>`.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import threading
from typing import Any

from beam_rl import processes


def start_subprocess_server(
    model_dir: str | os.PathLike | None = None,
    *,
    mode: str = "model",
    max_num_seqs: int | None = None,
    extra_args: tuple[str, ...] | list[str] = (),
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 120.0,
    die_with_parent: bool = False,
    api_key: str | None = None,
) -> tuple[subprocess.Popen, str]:
    """Returns (process, base url). The caller owns the process: terminate() and wait() it.

    `extra_args` are more server flags, e.g. ("--fault-latency-s", "0.1", "--served-model-name", "m").
    `die_with_parent`: the server ends with the calling thread (`beam_rl.processes.die_with_parent`).
    `api_key`: the key the server requires (`security.needs_key`), handed over in its environment.
    """
    proc = spawn_subprocess_server(
        model_dir,
        mode=mode,
        max_num_seqs=max_num_seqs,
        extra_args=extra_args,
        env=env,
        die_with_parent=die_with_parent,
        api_key=api_key,
    )
    return proc, wait_until_ready(proc, ready_timeout_s)


def spawn_subprocess_server(
    model_dir: str | os.PathLike | None = None,
    *,
    mode: str = "model",
    max_num_seqs: int | None = None,
    extra_args: tuple[str, ...] | list[str] = (),
    env: dict[str, str] | None = None,
    die_with_parent: bool = False,
    api_key: str | None = None,
) -> subprocess.Popen:
    """Start a server without waiting for it (`wait_until_ready`), so several can start side by side."""
    cmd = [sys.executable, "-m", "beam_rl.standin.server", "--port", "0", "--mode", mode]
    if model_dir is not None:
        cmd += ["--model-dir", str(model_dir)]
    if max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(max_num_seqs)]
    cmd += list(extra_args)
    child_env = dict(os.environ if env is None else env)
    if api_key is not None:
        child_env["VLLM_API_KEY"] = api_key  # not `--api-key`: every local user can read a command line
    # Make this checkout importable in the child even when beam_rl is not pip-installed.
    root = str(pathlib.Path(__file__).resolve().parents[2])
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (root, child_env.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env,
        preexec_fn=processes.die_with_parent if die_with_parent else None,
    )


def wait_until_ready(proc: subprocess.Popen, ready_timeout_s: float = 120.0) -> str:
    """The server's base URL once it prints `READY <url>`; kills it if it does not within the timeout."""
    stdout = proc.stdout
    assert stdout is not None
    first_line: list[str] = []
    # readline() has no timeout; a reader thread lets a server that never gets ready fail cleanly.
    reader = threading.Thread(target=lambda: first_line.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(ready_timeout_s)
    line = first_line[0].strip() if first_line else ""
    if not line.startswith("READY "):
        proc.kill()
        proc.wait()
        raise RuntimeError(
            f"inference server not ready within {ready_timeout_s:g}s (exit code {proc.returncode}, "
            f"first line {line!r}); command: {_command(proc.args)}"
        )
    return line.split(" ", 1)[1]


def _command(args: Any) -> str:
    """Popen's `args` as a shell line: a list of words, or one string or path."""
    return " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
