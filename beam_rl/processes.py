"""Processes of a run: which worker this is, and the children a run starts (tied to their parent's
life, their logs closed, stopped newest first)."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence, Set
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

_LOG = logging.getLogger(__name__)
T = TypeVar("T")
_PR_SET_PDEATHSIG = 1
_GPU_DEVICES = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA's driver, AMD's ROCm: the GPUs torch's triton compiles for


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
        tree.setdefault(ppid, []).append(int(name))
    return tree


def tree_pids(root: int, exclude: Set[int] = frozenset()) -> list[int]:
    """`root` and its descendants (from /proc, Linux), without the subtrees rooted at `exclude`."""
    tree, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        if pid in exclude:
            continue
        out.append(pid)
        todo.extend(tree.get(pid, []))
    return out


def worker_id() -> str:
    """host:pid of this process: which worker dispatched or scored a rollout."""
    return f"{socket.gethostname()}:{os.getpid()}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now, for a child process or a rendezvous to bind."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


# What a child running code beam-rl did not write (an agent's program, an env server) is given of this process's
# environment: enough to find programs and a Python, a home, the locale and the TLS trust roots (a host behind a
# TLS-inspecting proxy names its CA there: trust, not a credential); never the run's credentials (inference and
# judge API keys, a cloud's tokens).
PASSED_ON = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV", "PYTHONPATH", "SSL_CERT_FILE", "SSL_CERT_DIR")


def scrubbed_env(pass_env: Iterable[str] = (), drop: Iterable[str] = ()) -> dict[str, str]:
    """The environment of a child that runs third-party code: PASSED_ON but `drop`, plus the variables
    `pass_env` names (what the config asks it to have), each as this process has it (unset: left out)."""
    names = [name for name in PASSED_ON if name not in set(drop)] + list(pass_env)
    return {name: os.environ[name] for name in names if name in os.environ}


def keep_triton_out() -> None:
    """Have torch see no triton in this process, on a machine without a GPU triton could drive: called first
    by beam-rl's own processes (the CLI, the embedded servers, the trainer's ranks).

    torch's Linux wheel requires triton, and transformers' model code (and peft) import torch._dynamo,
    which imports triton whenever it is installed; triton's nanobind extension then printed 20-odd lines
    of "nanobind: leaked ..." at every such process's exit. Without an NVIDIA or AMD GPU (no /dev/nvidiactl,
    no /dev/kfd) triton can run nothing, so a None in sys.modules costs nothing: `import triton` fails and
    `importlib.util.find_spec("triton")` answers None, as if it were not installed. With a GPU, code the run
    loads (an environment's reward model, say) may want it, so it is left alone. A process that imported
    triton already keeps it; a user's own trainer importing beam_rl is not touched."""
    if not any(os.path.exists(device) for device in _GPU_DEVICES):
        sys.modules.setdefault("triton", None)  # type: ignore[arg-type]  # None: "not installed" to importlib


def die_with_parent() -> None:
    """A `preexec_fn`: the child gets SIGTERM when the thread that started it ends, so a killed parent
    (SIGKILL included) leaves no child behind. Linux only; start such children from a thread that
    lives as long as they should."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_processes(procs: Iterable[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """SIGTERM all at once (they shut down in parallel), then SIGKILL whoever outlives `timeout_s`."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ChildFailedError(RuntimeError):
    """A child process of a job ended with an error; the message names it and its log."""


@dataclass
class Child:
    """A part of a job that must be stopped: a child process, or anything with a stop function."""

    name: str
    stop: Callable[[], None]
    process: subprocess.Popen | None = None
    log: Path | None = None  # where a child process writes its output

    def exit_code(self) -> int | None:
        """The process's exit status once it has ended; None while it runs (or for a non-process)."""
        return None if self.process is None else self.process.poll()


class Supervisor:
    """The parts of one job, stopped in the reverse order of their start: a job starts its servers,
    then the rollout job, then the trainer, and stops the trainer first and the servers last."""

    def __init__(self, stop_timeout_s: float = 30.0) -> None:
        self.stop_timeout_s = stop_timeout_s
        self._children: list[Child] = []

    def start(self, name: str, cmd: Sequence[str], log: Path) -> Child:
        """Start `cmd` with its output appended to `log`; it dies with this process (`die_with_parent`)."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:  # the child keeps its own descriptor; ours closes here
            process = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        child = Child(name, lambda: stop_processes([process], self.stop_timeout_s), process, log)
        self._children.append(child)
        return child

    def add(self, name: str, stop: Callable[[], None]) -> Child:
        """A part started elsewhere (the rollout job, the run observer): stopped in its turn."""
        child = Child(name, stop)
        self._children.append(child)
        return child

    def enter(self, name: str, context: AbstractContextManager[T]) -> T:
        """A context started elsewhere (the servers' block): entered now, exited in its turn."""
        value = context.__enter__()

        def leave() -> None:
            context.__exit__(None, None, None)

        self.add(name, leave)
        return value

    def failed(self) -> Child | None:
        """The first child process that exited with a non-zero status."""
        return next((c for c in self._children if c.exit_code() not in (None, 0)), None)

    def raise_if_failed(self) -> None:
        child = self.failed()
        if child is not None:
            cause = (_last_line(child.log) or _full_disk(child.log)) if child.log else None
            raise ChildFailedError(
                f"the {child.name} exited with status {child.exit_code()}"
                + (f" ({cause})" if cause else "")
                + f"; see {child.log}"
            )

    def stop(self) -> None:
        """Stop every part, newest first; each is stopped even when an earlier stop raised, and the
        first error is raised at the end."""
        errors = self._stop_all()
        if errors:
            raise errors[0]

    def _stop_all(self) -> list[BaseException]:
        errors: list[BaseException] = []
        while self._children:
            child = self._children.pop()
            try:
                child.stop()
            except BaseException as err:  # Ctrl-C mid-stop included: the older parts still stop
                errors.append(err)
        return errors

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        errors = self._stop_all()
        if errors and exc is None:
            raise errors[0]
        for err in errors:  # the error that ended the block is the one to see; the traceback with -v
            _LOG.warning(
                "stopping a part of the job failed while handling %r: %s: %s",
                exc,
                type(err).__name__,
                str(err).strip().splitlines()[0] if str(err).strip() else "",
            )
            _LOG.info("stopping a part of the job failed", exc_info=err)


def _last_line(log: Path, tail_bytes: int = 4096) -> str | None:
    """The last line of a child's log when it names an exception (`OSError: [Errno 28] ...`): what stopped it."""
    try:
        with log.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return None
    last = lines[-1].strip() if lines else ""
    name = last.split(":", 1)[0]
    return last if ":" in last and name.isidentifier() and name[0].isupper() else None


def _full_disk(log: Path, below_bytes: int = 1 << 20) -> str | None:
    """Where a child's log says nothing, it may not have been able to: its filesystem is full."""
    try:
        free = shutil.disk_usage(log.parent).free
    except OSError:
        return None
    return f"the filesystem holding {log.parent} is full: {free} bytes free" if free < below_bytes else None
