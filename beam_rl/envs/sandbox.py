"""Runs untrusted Python programs (model-written code) in a sandbox and reports what they did: the one
home of code execution for rewards and tools.

Why this shape: bubblewrap (`bwrap`, Debian package `bubblewrap`) builds the sandbox from kernel
namespaces with no daemon and no image. Where the orchestrator runs as root, bwrap itself runs as the
unprivileged uid 65534 ("nobody") and creates a user namespace, so nothing in the sandbox ever holds a
capability on the host. It adds a PID namespace (the program sees only the sandbox's processes and
cannot signal or ptrace anything outside), a network namespace with only its own loopback (unless
`SandboxLimits.network`), and a mount namespace whose filesystem is `/usr` read-only, a fresh `/proc`,
a read-only `/dev` (its `/dev/shm` a tmpfs capped at `file_size_mb`), and a tmpfs workdir `/sandbox`
(also `/tmp`) capped at `memory_mb`; the rest of the root is read-only. So the program cannot write
anywhere else, sees none of the host's files (the run directory, secrets), and its directory
disappears with the namespace: nothing is left on the host. The environment is cleared.

Inside, a small launcher is the namespace's init (the program's parent, which it cannot kill): it sets
the rlimits (CPU seconds, address space, processes, file size, no core files), runs the program, reaps
what ends, and reports the program's exit status and CPU time through a pipe only it holds.
RLIMIT_NPROC is set inside the user namespace, so it counts only that sandbox's processes (threads
included): concurrent sandboxes do not share the budget, and it is enforced because the uid is not
root. The wall-clock timeout kills the init, which takes the whole PID namespace with it.

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
_READY = b"R"  # the launcher's first byte: the sandbox is up and the program's code runs next
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
    for the CPU limit; "SIGKILL" for the wall-clock timeout, with `timed_out` and no `cpu_s`)."""

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    signal: str | None
    wall_s: float
    output_truncated: bool = False  # stdout or stderr went past OUTPUT_LIMIT
    cpu_s: float | None = None  # CPU of the sandbox's processes that ended before the program did

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
        status_r, status_w = os.pipe()
        stack.callback(os.close, status_r)
        os.set_blocking(status_r, False)
        child_fds = [status_w]
        try:
            input_fds = {}
            for name, text in inputs.items():
                input_fds[name] = _memfd(name, text)
                child_fds.append(input_fds[name])
            argv = [
                bwrap, *_namespace_args(unshare_net), *_filesystem_args(limits, input_fds),
                "--", python, "-I", "-c", _LAUNCHER, str(status_w), json.dumps(_rlimits(limits)), MAIN,
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
        return await _finish(proc, stdin, limits, started, status_r)


async def _finish(
    proc: asyncio.subprocess.Process, stdin: str, limits: SandboxLimits, started: float, status_r: int
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
            await _end_sandbox(proc)
    wall_s = time.monotonic() - started
    # Every holder of the pipes died with the PID namespace; the bound only guards against surprises.
    done, pending = await asyncio.wait([feed, out, err], timeout=5)
    for task in pending:
        task.cancel()
    (stdout, cut_out), (stderr, cut_err) = (t.result() if t in done else (b"", True) for t in (out, err))
    ready, report = _read_status(status_r)
    if not ready or (report is None and not timed_out):
        why = (
            f"did not start within {limits.wall_s} s" if timed_out and not ready
            else f"failed (exit status {proc.returncode})" if not ready
            else "ended without reporting the program's exit"
        )
        detail = stderr.decode(errors="replace").strip()
        raise SandboxUnavailable(f"the sandbox {why}" + (f": {detail}" if detail else ""))
    exit_code, signal_name = _status(report["returncode"]) if report else (None, "SIGKILL")
    return SandboxResult(
        exit_code=exit_code,
        stdout=stdout.decode(errors="replace"),
        stderr=stderr.decode(errors="replace"),
        timed_out=timed_out,
        signal=signal_name,
        wall_s=wall_s,
        output_truncated=cut_out or cut_err,
        cpu_s=report["cpu_s"] if report else None,
    )


async def _end_sandbox(proc: asyncio.subprocess.Process) -> None:
    """Kill the sandbox's init (bwrap's child): its PID namespace dies with it, and bwrap reaps it
    and exits. Killing bwrap instead would leave the init to whoever adopts orphans here."""
    killed = False
    for pid in _children(proc.pid):
        with contextlib.suppress(OSError):
            pidfd = os.pidfd_open(pid)
            try:
                if _parent(pid) == proc.pid:  # still bwrap's: the pid was not reused meanwhile
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    killed = True
            finally:
                os.close(pidfd)
    if killed:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.wait(), 5)
    if proc.returncode is None:  # no init yet (bwrap still setting up), or bwrap did not follow it
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except OSError:
        return []


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _read_status(status_r: int) -> tuple[bool, dict | None]:
    """What the launcher wrote: (whether the program was started, its report once it ended)."""
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(status_r, 1 << 16):
            data += chunk
    if not data.startswith(_READY):
        return False, None
    try:
        report = json.loads(data[len(_READY):])
    except ValueError:
        return True, None
    return True, report


def _status(returncode: int) -> tuple[int | None, str | None]:
    if returncode >= 0:
        return returncode, None
    try:
        return None, signal.Signals(-returncode).name
    except ValueError:
        return None, f"SIG{-returncode}"


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
        "--as-pid-1",  # the launcher is the namespace's init (bwrap's own leaves a zombie behind)
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


# Runs first inside the sandbox, as its PID namespace's init: `python3 -I -c _LAUNCHER <status fd>
# <rlimits> main.py`. It sets the limits, closes every inherited descriptor, writes the ready byte (a
# failure before it is the sandbox's, after it the program's), and forks the program, which runs
# main.py as __main__ with a traceback that shows only its own frames. The init then reaps whatever
# ends (the program, and orphans handed to it) and, once the program has, writes its exit status and
# CPU time after the ready byte. Being init and not dumpable, it is out of the program's reach: the
# kernel drops a SIGKILL from inside the namespace, and /proc hides its descriptors from the program.
_LAUNCHER = r"""
def _launch():
    import builtins, ctypes, json, os, resource, signal, sys
    status, limits, path = int(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
    for name, (soft, hard) in limits.items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
        if fd > 2 and fd != status:
            try:
                os.close(fd)
            except OSError:
                pass  # the directory listing's own descriptor, already closed
    with open(path, "rb") as f:
        source = f.read()
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    if prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0)")
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # init ignores what it has no handler for
    os.write(status, b"R")
    program = os.fork()
    if program == 0:
        os.close(status)
        prctl(4, 1, 0, 0, 0)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _run(source, path)
        return
    while True:
        pid, wait_status = os.wait()
        if pid == program:
            break
    used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cpu_s = sum(u.ru_utime + u.ru_stime for u in used)
    report = {"returncode": os.waitstatus_to_exitcode(wait_status), "cpu_s": cpu_s}
    os.write(status, json.dumps(report).encode())
    os._exit(0)

def _run(source, path):
    import builtins, os, sys
    sys.argv = [path]
    sys.path.insert(0, os.getcwd())
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
