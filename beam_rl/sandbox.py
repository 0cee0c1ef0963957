"""Runs untrusted Python programs (model-written code) in a sandbox and reports what they did: the one
home of code execution for rewards and tools.

Why this shape: bubblewrap (`bwrap`, Debian package `bubblewrap`) builds the sandbox from kernel
namespaces with no daemon and no image. Where the orchestrator runs as root, bwrap itself runs as the
unprivileged uid 65534 ("nobody") and creates a user namespace, so nothing in the sandbox ever holds a
capability on the host. It adds a PID namespace (the program sees only the sandbox's processes: it
cannot signal or ptrace the orchestrator or anything else outside, and the sandbox's init, its parent
there, ignores its SIGKILL), a network namespace with only its own loopback
(unless `SandboxLimits.network`), and a mount namespace whose filesystem is `/usr` read-only, a fresh
`/proc`, a read-only `/dev` (its `/dev/shm` a tmpfs capped at `file_size_mb`), and a tmpfs workdir
`/sandbox` (also `/tmp`) capped at `memory_mb`; the rest of the root is read-only. So the program
cannot write anywhere else, sees none of the host's files (the run directory, secrets), and its
directory disappears with the namespace, so nothing is left on the host. The environment is cleared.
Inside, a small launcher sets the rlimits (CPU seconds, address space, processes, file size, no core
files) before it runs the program. RLIMIT_NPROC is set inside the user namespace, so it counts only
that sandbox's processes (and threads): concurrent sandboxes do not share the budget, and it is
enforced because the uid is not root. The wall-clock timeout kills bwrap, which takes its whole PID
namespace with it.

The program is the system's `python3` (under /usr: the project's interpreter may live in a home
directory the sandbox's uid cannot enter), started with `-I`: it sees the standard library and what the
system installed under /usr, never the project's virtualenv.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, fields
from pathlib import PurePosixPath

log = logging.getLogger(__name__)

SANDBOX_UID = 65534  # "nobody": bwrap runs as it when the orchestrator is root
WORKDIR = "/sandbox"
MAIN = "main.py"  # the program's file name in WORKDIR
OUTPUT_LIMIT = 1 << 20  # bytes kept of each of stdout and stderr; the rest is read and dropped
OPEN_FILES = 1024  # RLIMIT_NOFILE inside the sandbox
_READY = b"R"  # the launcher's byte: the sandbox is up and the program's code runs next
_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. cpu_s is per process, rounded up to whole seconds (RLIMIT_CPU); memory_mb
    is each process's address space and also the size of the tmpfs workdir; processes counts the
    sandbox's tasks, threads included; file_size_mb is the largest file it may write."""

    cpu_s: float = 5
    wall_s: float = 10
    memory_mb: int = 512
    processes: int = 32
    file_size_mb: int = 16
    network: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "network" and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"SandboxLimits.{f.name} must be a positive number, got {value!r}")


@dataclass
class SandboxResult:
    """What a run did. A program killed by a signal has `exit_code` None and `signal` set ("SIGXCPU"
    for the CPU limit; "SIGKILL" for the wall-clock timeout, with `timed_out`). bwrap reports a
    signal as exit status 128 + its number, so a program that exits with such a status reads as
    that signal."""

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    signal: str | None
    wall_s: float
    output_truncated: bool = False  # stdout or stderr went past OUTPUT_LIMIT

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class SandboxUnavailable(Exception):
    """No sandbox could be run at all (bwrap or python3 missing, namespaces refused, the sandbox did
    not start in time): an infrastructure failure, never the program's."""


async def run_python(
    source: str,
    *,
    stdin: str = "",
    files: dict[str, str] | None = None,
    limits: SandboxLimits = SandboxLimits(),
) -> SandboxResult:
    """Run `source` as `main.py` in a fresh sandbox with `files` (relative path -> text) beside it.

    Raises SandboxUnavailable for infrastructure failures; whatever the program does (loop, crash,
    exhaust a limit) is reported in the result.
    """
    inputs = {MAIN: source, **_checked_files(files or {})}
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("bubblewrap (`bwrap`) is not on PATH: install the Debian package bubblewrap")
    python = _system_python()
    unshare_net = not limits.network and await _network_namespaces_allowed(bwrap, python)
    with contextlib.ExitStack() as stack:
        ready_r, ready_w = os.pipe()
        stack.callback(os.close, ready_r)
        os.set_blocking(ready_r, False)
        child_fds = [ready_w]
        try:
            input_fds = {}
            for name, text in inputs.items():
                input_fds[name] = _memfd(name, text)
                child_fds.append(input_fds[name])
            argv = [
                bwrap, *_namespace_args(unshare_net), *_filesystem_args(limits, input_fds),
                "--", python, "-I", "-c", _LAUNCHER, str(ready_w), json.dumps(_rlimits(limits)), MAIN,
            ]
            started = time.monotonic()
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE, pass_fds=child_fds, env={"PATH": _PATH}, **_sandbox_user(),
                )
            except OSError as err:
                raise SandboxUnavailable(f"could not start bwrap: {err}") from err
        finally:
            for fd in child_fds:  # the sandbox holds its own copies now
                os.close(fd)
        return await _finish(proc, stdin, limits, started, ready_r)


async def _finish(
    proc: asyncio.subprocess.Process, stdin: str, limits: SandboxLimits, started: float, ready_r: int
) -> SandboxResult:
    assert proc.stdin and proc.stdout and proc.stderr
    feed = asyncio.create_task(_feed(proc.stdin, stdin.encode()))
    out = asyncio.create_task(_read_capped(proc.stdout))
    err = asyncio.create_task(_read_capped(proc.stderr))
    timed_out = False
    try:
        await asyncio.wait_for(proc.wait(), limits.wall_s)
    except asyncio.TimeoutError:
        timed_out = True
    finally:
        if proc.returncode is None:  # timed out, or this coroutine was cancelled: end the namespace
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    wall_s = time.monotonic() - started
    # Every holder of the pipes died with the PID namespace; the bound only guards against surprises.
    done, pending = await asyncio.wait([feed, out, err], timeout=5)
    for task in pending:
        task.cancel()
    (stdout, cut_out), (stderr, cut_err) = (
        t.result() if t in done else (b"", True) for t in (out, err)
    )
    if not _was_ready(ready_r):
        why = f"did not start within {limits.wall_s} s" if timed_out else f"failed (exit status {proc.returncode})"
        detail = stderr.decode(errors="replace").strip()
        raise SandboxUnavailable(f"the sandbox {why}" + (f": {detail}" if detail else ""))
    exit_code, signal_name = _status(proc.returncode)
    return SandboxResult(
        exit_code=exit_code,
        stdout=stdout.decode(errors="replace"),
        stderr=stderr.decode(errors="replace"),
        timed_out=timed_out,
        signal=signal_name,
        wall_s=wall_s,
        output_truncated=cut_out or cut_err,
    )


def _status(returncode: int | None) -> tuple[int | None, str | None]:
    if returncode is None:
        return None, None
    number = -returncode if returncode < 0 else returncode - 128 if 128 < returncode <= 128 + 64 else 0
    if not number:
        return returncode, None
    try:
        return None, signal.Signals(number).name
    except ValueError:
        return None, f"SIG{number}"


async def _feed(writer: asyncio.StreamWriter, data: bytes) -> None:
    # A program that never reads its stdin, or exits first, is not an error.
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        if data:
            writer.write(data)
            await writer.drain()
        writer.close()
        await writer.wait_closed()


async def _read_capped(reader: asyncio.StreamReader) -> tuple[bytes, bool]:
    kept = bytearray()
    truncated = False
    while chunk := await reader.read(1 << 16):
        room = OUTPUT_LIMIT - len(kept)
        kept += chunk[:room]
        truncated |= len(chunk) > room
    return bytes(kept), truncated


def _was_ready(ready_r: int) -> bool:
    try:
        return os.read(ready_r, 16).startswith(_READY)
    except BlockingIOError:
        return False


def _checked_files(files: dict[str, str]) -> dict[str, str]:
    for name in files:
        path = PurePosixPath(name)
        if not name or path.is_absolute() or ".." in path.parts or str(path) != name:
            raise ValueError(f"sandbox file name {name!r} must be a plain relative path (no '..', no leading '/')")
        if name == MAIN:
            raise ValueError(f"sandbox file name {MAIN!r} is taken by the program itself")
    return files


def _memfd(name: str, text: str) -> int:
    fd = os.memfd_create(name.replace("/", "_"))
    os.write(fd, text.encode())
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _system_python() -> str:
    python = shutil.which("python3", path=_PATH)
    if python is None or not os.path.realpath(python).startswith("/usr/"):
        raise SandboxUnavailable("no python3 under /usr for the sandbox: install the Debian package python3-minimal")
    return python


def _sandbox_user() -> dict:
    """Run bwrap as nobody when we are root: then no process of the sandbox is root on the host."""
    if os.geteuid() != 0:
        return {}
    return {"user": SANDBOX_UID, "group": SANDBOX_UID, "extra_groups": []}


def _namespace_args(unshare_net: bool) -> list[str]:
    args = [
        "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--disable-userns",  # no nested user namespace: no way to regain capabilities inside
        "--die-with-parent", "--new-session", "--hostname", "sandbox",
    ]
    return args + (["--unshare-net"] if unshare_net else [])


def _filesystem_args(limits: SandboxLimits, input_fds: dict[str, int]) -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):  # merged-/usr links, or the real dirs
        host = f"/{name}"
        if os.path.islink(host):
            args += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            args += ["--ro-bind", host, host]
    args += [
        "--proc", "/proc", "--dev", "/dev",
        "--size", str(limits.file_size_mb << 20), "--tmpfs", "/dev/shm",
        "--remount-ro", "/dev",
        "--size", str(limits.memory_mb << 20), "--tmpfs", WORKDIR,
        "--dir", f"{WORKDIR}/.tmp", "--symlink", f"{WORKDIR}/.tmp", "/tmp",
    ]
    for name, fd in input_fds.items():
        for parent in reversed(PurePosixPath(name).parents[:-1]):
            args += ["--dir", f"{WORKDIR}/{parent}"]
        args += ["--file", str(fd), f"{WORKDIR}/{name}"]
    args += [
        "--remount-ro", "/",
        "--chdir", WORKDIR,
        "--clearenv", "--setenv", "PATH", _PATH, "--setenv", "HOME", WORKDIR, "--setenv", "TMPDIR", "/tmp",
        "--setenv", "LANG", "C.UTF-8",
    ]
    return args


def _rlimits(limits: SandboxLimits) -> dict[str, tuple[int, int]]:
    cpu = max(1, math.ceil(limits.cpu_s))
    return {
        "RLIMIT_CPU": (cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL a second later
        "RLIMIT_AS": (limits.memory_mb << 20,) * 2,
        "RLIMIT_NPROC": (limits.processes,) * 2,
        "RLIMIT_FSIZE": (limits.file_size_mb << 20,) * 2,
        "RLIMIT_CORE": (0, 0),
        "RLIMIT_NOFILE": (OPEN_FILES,) * 2,
    }


_netns_checked: dict[str, bool] = {}
_netns_lock = threading.Lock()  # not an asyncio lock: rewards may run each in its own event loop


async def _network_namespaces_allowed(bwrap: str, python: str) -> bool:
    """Whether this machine lets bwrap make a network namespace (checked once per bwrap). Where it
    does not, sandboxes keep the host's network, and we say so once."""
    if bwrap in _netns_checked:
        return _netns_checked[bwrap]
    return await asyncio.to_thread(_check_network_namespaces, bwrap, python)


def _check_network_namespaces(bwrap: str, python: str) -> bool:
    with _netns_lock:
        if bwrap not in _netns_checked:
            probe = [bwrap, *_namespace_args(unshare_net=False), *_filesystem_args(SandboxLimits(), {}),
                     "--", python, "-I", "-c", ""]
            with_net = _try(probe[:1] + ["--unshare-net"] + probe[1:])
            if with_net is None:
                _netns_checked[bwrap] = True
            else:
                without = _try(probe)
                if without is not None:  # no sandbox at all: not cached, the next run asks again
                    raise SandboxUnavailable(f"bwrap cannot create a sandbox here: {without}")
                log.warning("network namespaces are not allowed on this machine (bwrap: %s): sandboxed "
                            "programs can reach the network", with_net)
                _netns_checked[bwrap] = False
        return _netns_checked[bwrap]


def _try(argv: list[str]) -> str | None:
    """None if `argv` ran, else what went wrong."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, env={"PATH": _PATH}, **_sandbox_user())
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    return None if done.returncode == 0 else (done.stderr.strip() or f"exit status {done.returncode}")


# Runs first inside the sandbox, as `python3 -I -c _LAUNCHER <ready fd> <rlimits> main.py`: sets the
# limits, closes every inherited descriptor, writes the ready byte (so a failure before this point is
# the sandbox's, after it the program's), then runs main.py as __main__ in this same interpreter (one
# start-up, not two) with a traceback that shows only the program's frames.
_LAUNCHER = r"""
def _launch():
    import builtins, json, os, resource, sys
    ready, limits, path = int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
    for name, (soft, hard) in limits.items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
        if fd > 2 and fd != ready:
            try:
                os.close(fd)
            except OSError:
                pass  # the directory listing's own descriptor, already closed
    with open(path, "rb") as f:
        source = f.read()
    sys.argv = [path]
    sys.path.insert(0, os.getcwd())
    os.write(ready, b"R")
    os.close(ready)
    main = sys.modules["__main__"].__dict__
    main.clear()
    main.update(__name__="__main__", __file__=os.path.join(os.getcwd(), path), __builtins__=builtins)
    try:
        code = compile(source, path, "exec")
    except (SyntaxError, ValueError) as exc:
        sys.excepthook(type(exc), exc, None)
        sys.exit(1)
    try:
        exec(code, main)
    except SystemExit:
        raise
    except BaseException as exc:
        exc.__traceback__ = exc.__traceback__.tb_next  # this launcher's frame is not the program's
        sys.excepthook(type(exc), exc, exc.__traceback__)
        sys.exit(1)
_launch()
"""
