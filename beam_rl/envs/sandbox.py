"""Runs untrusted Python programs (model-written code) in a sandbox and reports what they did: the one
home of code execution for rewards and tools.

Why this shape: bubblewrap (`bwrap`, Debian package `bubblewrap`) builds the sandbox from kernel
namespaces with no daemon and no image. Where the orchestrator runs as root, bwrap itself runs as the
unprivileged uid 65534 ("nobody") and creates a user namespace, so nothing in the sandbox ever holds a
capability on the host. It adds a PID namespace (the program sees only the sandbox's processes and
cannot signal or ptrace anything outside), a network namespace with only its own loopback (unless
`SandboxLimits.network`), and a mount namespace whose filesystem is `/usr` read-only, a fresh `/proc`,
a read-only `/dev` (its `/dev/shm` a tmpfs capped at `file_size_mb`), and a tmpfs workdir `/sandbox`
(also `/tmp`) capped at `file_size_mb` beyond its inputs; the rest of the root is read-only. So the program cannot write
anywhere else, sees none of the host's files (the run directory, secrets), and its directory
disappears with the namespace: nothing is left on the host. The environment is cleared.

Inside, a small launcher is the namespace's init (the program's parent, which it cannot kill): it sets
the rlimits (address space, processes, file size, no core files, a per-process CPU backstop), runs the
program, reaps what ends, adds up the CPU time of every process in the namespace and kills them all
past `cpu_s`, and reports the program's exit status, CPU time and the caps it ran into through a pipe
only it holds. RLIMIT_NPROC is set inside the user namespace, so it counts only that sandbox's
processes (threads included): concurrent sandboxes do not share the budget, and it is enforced
because the uid is not root. The wall-clock timeout kills the init, which takes the whole PID
namespace with it.

A program's caps hold all of its processes together. Memory: where this host lets us make a cgroup v2
per program (the memory and pids controllers delegable under the cgroup2 root; checked once, and
logged which way it went), the launcher is moved into the program's own cgroup before it starts the
program (memory.max = memory_mb with no swap, pids.max = processes, the whole program killed when out
of memory), and the cgroup is removed after. Elsewhere each process's address space is capped at
memory_mb / processes, so the processes RLIMIT_NPROC allows cannot together map more than memory_mb.

The program is the system's `python3` (under /usr: the project's interpreter may live in a home
directory the sandbox's uid cannot enter), started with `-I`: it sees the standard library and what the
system installed under /usr, never the project's virtualenv.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
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
from pathlib import Path, PurePosixPath

from beam_rl.printable import printable

log = logging.getLogger(__name__)

SANDBOX_UID = 65534  # "nobody": bwrap runs as it when the orchestrator is root
WORKDIR = "/sandbox"
MAIN = "main.py"  # the program's file name in WORKDIR
OUTPUT_LIMIT = 1 << 20  # bytes kept of each of stdout and stderr; the rest is read and dropped
OPEN_FILES = 1024  # RLIMIT_NOFILE inside the sandbox
_READY = b"R"  # the launcher's first byte: the sandbox is up and the program's code runs next
_PATH = "/usr/local/bin:/usr/bin:/bin"
MIN_PROCESS_MB = 24  # the least address space a process may get: python3 -I starts in about 15 MB
CPU_WATCH_S = 0.05  # how often the launcher adds up the CPU time of the sandbox's processes
CGROUP_PARENT = "beam-rl-sandbox"  # the cgroup (under the cgroup2 root) that holds one child per program


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use, all of its processes together.

    cpu_s: CPU seconds of all its processes together (the launcher adds them up and ends the program
    past it). memory_mb: the memory of all its processes together: a cgroup's memory.max where this
    host lets us make one per program (cgroup v2 with the memory and pids controllers), else each
    process's address space is capped at memory_mb / processes. processes: tasks at once, threads and
    the launcher included. file_size_mb: the largest file it may write, and also what its directory
    (beyond its inputs) and its /dev/shm may each hold.

    The defaults are safe for 64 programs at once (reward.concurrency's default) on a 24 GiB machine:
    a program holds at most 160 MB of memory (without a cgroup: 4 processes x 40 MB of address space)
    plus 2 x 16 MB of files, 192 MB; 64 x 192 MB = 12 GiB, half of the machine.
    """

    cpu_s: float = 5
    wall_s: float = 10
    memory_mb: int = 160
    processes: int = 4
    file_size_mb: int = 16
    network: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "network" and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"SandboxLimits.{f.name} must be a positive number, got {value!r}")
        if self.memory_mb / self.processes < MIN_PROCESS_MB:
            raise ValueError(
                f"SandboxLimits: memory_mb / processes must be at least {MIN_PROCESS_MB} MB (each process's "
                f"share where no cgroup holds them together; python3 needs that to start), "
                f"got {self.memory_mb} / {self.processes}"
            )


# The total caps a program can run into, as SandboxResult.capped names them.
CAPS = {
    "cpu": "stopped at its total CPU time (cpu_s, all processes together)",
    "memory": "stopped at its total memory (memory_mb, all processes together)",
    "processes": "reached its process cap (processes)",
}


@dataclass
class SandboxResult:
    """What a run did. A program killed by a signal has `exit_code` None and `signal` set (SIGKILL for
    the wall-clock timeout, with `timed_out` and no `cpu_s`; SIGKILL with "cpu" in `capped` for the
    total CPU cap). stdout and stderr are printable: control characters come escaped (beam_rl.printable)."""

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    signal: str | None
    wall_s: float
    output_truncated: bool = False  # stdout or stderr went past OUTPUT_LIMIT
    cpu_s: float | None = None  # CPU time of all the sandbox's processes when the program ended
    capped: tuple[str, ...] = ()  # the total caps it ran into (keys of CAPS)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    @property
    def verdict(self) -> str:
        """What became of the program, in one line."""
        if self.timed_out:
            how = "timed out (wall clock)"
        elif self.signal:
            how = f"killed by {self.signal}"
        else:
            how = f"exit status {self.exit_code}"
        return "; ".join([how, *(CAPS[cap] for cap in self.capped)])


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
    async with contextlib.AsyncExitStack() as stack:
        cgroup = await _ProgramCgroup.make(limits)
        if cgroup is not None:
            stack.push_async_callback(cgroup.remove)
        status_r, status_w = os.pipe()
        stack.callback(os.close, status_r)
        os.set_blocking(status_r, False)
        go_r, go_w = os.pipe() if cgroup else (-1, -1)  # the launcher waits for a byte here once in the cgroup
        if cgroup:
            stack.callback(os.close, go_w)
        child_fds = [status_w] + ([go_r] if cgroup else [])
        try:
            input_fds = {}
            for name, text in inputs.items():
                input_fds[name] = _memfd(name, text)
                child_fds.append(input_fds[name])
            inputs_mb = math.ceil(sum(len(text.encode()) for text in inputs.values()) / (1 << 20))
            watch = {"cpu_s": limits.cpu_s, "processes": limits.processes, "every": CPU_WATCH_S}
            argv = [
                bwrap,
                *_namespace_args(unshare_net),
                *_filesystem_args(limits, input_fds, inputs_mb),
                "--",
                python,
                "-I",
                "-c",
                _LAUNCHER,
                str(status_w),
                str(go_r),
                json.dumps(_rlimits(limits, together=cgroup is not None)),
                json.dumps(watch),
                MAIN,
            ]
            started = time.monotonic()
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                    pass_fds=child_fds,
                    env={"PATH": _PATH},
                    **_sandbox_user(),
                )
            except OSError as err:
                raise SandboxUnavailable(f"could not start bwrap: {err}") from err
        finally:
            for fd in child_fds:  # the sandbox holds its own copies now
                os.close(fd)
        sandbox = _Sandbox(proc, limits, started, status_r, cgroup, go_w)
        return await sandbox.finish(stdin)


@dataclass
class _Sandbox:
    """One started sandbox, from bwrap's start to its result."""

    proc: asyncio.subprocess.Process
    limits: SandboxLimits
    started: float
    status_r: int  # the launcher's pipe: the ready byte, then its report
    cgroup: _ProgramCgroup | None
    go_w: int  # with a cgroup: the byte that lets the launcher start the program, once it is inside
    head: bytes = b""  # what was read of the status pipe before the end (the ready byte)

    async def finish(self, stdin: str) -> SandboxResult:
        proc, limits = self.proc, self.limits
        assert proc.stdin and proc.stdout and proc.stderr
        feed = asyncio.create_task(_feed(proc.stdin, stdin.encode()))
        out = asyncio.create_task(_read_capped(proc.stdout))
        err = asyncio.create_task(_read_capped(proc.stderr))
        timed_out = False
        try:
            await asyncio.wait_for(self._run(), limits.wall_s)
        except TimeoutError:
            timed_out = True
        finally:
            if proc.returncode is None:  # timed out, or this coroutine was cancelled: end the namespace
                await _end_sandbox(proc)
        wall_s = time.monotonic() - self.started
        # Every holder of the pipes died with the PID namespace; the bound only guards against surprises.
        done, pending = await asyncio.wait([feed, out, err], timeout=5)
        for task in pending:
            task.cancel()
        (stdout, cut_out), (stderr, cut_err) = (t.result() if t in done else (b"", True) for t in (out, err))
        ready, report = _read_status(self.head, self.status_r)
        capped = set(report["capped"] if report else ()) | (self.cgroup.capped() if self.cgroup else set())
        if not ready or (report is None and not timed_out and "memory" not in capped):
            why = (
                f"did not start within {limits.wall_s} s"
                if timed_out and not ready
                else f"failed (exit status {proc.returncode})"
                if not ready
                else "ended without reporting the program's exit"
            )
            detail = printable(stderr.decode(errors="replace").strip())
            raise SandboxUnavailable(f"the sandbox {why}" + (f": {detail}" if detail else ""))
        # No report and not timed out: the cgroup's OOM killer ended the program, its launcher with it.
        exit_code, signal_name = _status(report["returncode"]) if report else (None, "SIGKILL")
        return SandboxResult(
            exit_code=exit_code,
            stdout=printable(stdout.decode(errors="replace")),
            stderr=printable(stderr.decode(errors="replace")),
            timed_out=timed_out,
            signal=signal_name,
            wall_s=wall_s,
            output_truncated=cut_out or cut_err,
            cpu_s=report["cpu_s"] if report else None,
            capped=tuple(cap for cap in CAPS if cap in capped),
        )

    async def _run(self) -> None:
        if self.cgroup is not None:
            await self._enter_cgroup()
        await self.proc.wait()

    async def _enter_cgroup(self) -> None:
        """Once the launcher is up (its ready byte), move it into the program's cgroup and let it start
        the program: everything the program starts is then in the cgroup too."""
        assert self.cgroup is not None
        loop = asyncio.get_running_loop()
        readable = loop.create_future()

        def ready() -> None:
            if not readable.done():
                readable.set_result(None)

        loop.add_reader(self.status_r, ready)
        try:
            await readable  # the ready byte, or the end of the pipe if the sandbox died first
        finally:
            loop.remove_reader(self.status_r)
        with contextlib.suppress(BlockingIOError):
            self.head = os.read(self.status_r, 1)
        if self.head != _READY:
            return  # the sandbox did not start: finish() says so
        try:
            (launcher,) = _children(self.proc.pid)
            self.cgroup.enter(launcher)
        except (OSError, ValueError) as err:
            raise SandboxUnavailable(f"could not move the sandbox into its cgroup {self.cgroup.path}: {err}") from err
        os.write(self.go_w, b"G")


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


def _read_status(head: bytes, status_r: int) -> tuple[bool, dict | None]:
    """What the launcher wrote (`head`: what was read of it already): (whether the program was
    started, its report once it ended)."""
    data = head
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(status_r, 1 << 16):
            data += chunk
    if not data.startswith(_READY):
        return False, None
    try:
        report = json.loads(data[len(_READY) :])
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
        "--unshare-user",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--disable-userns",  # no nested user namespace: no way to regain capabilities inside
        "--as-pid-1",  # the launcher is the namespace's init (bwrap's own leaves a zombie behind)
        "--die-with-parent",
        "--new-session",
        "--hostname",
        "sandbox",
    ]
    return args + (["--unshare-net"] if unshare_net else [])


def _filesystem_args(limits: SandboxLimits, input_fds: dict[str, int], inputs_mb: int = 0) -> list[str]:
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):  # merged-/usr links, or the real dirs
        host = f"/{name}"
        if os.path.islink(host):
            args += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            args += ["--ro-bind", host, host]
    args += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(limits.file_size_mb << 20),
        "--tmpfs",
        "/dev/shm",
        "--remount-ro",
        "/dev",
        "--size",
        str((limits.file_size_mb + inputs_mb) << 20),
        "--tmpfs",
        WORKDIR,
        "--dir",
        f"{WORKDIR}/.tmp",
        "--symlink",
        f"{WORKDIR}/.tmp",
        "/tmp",
    ]
    for name, fd in input_fds.items():
        for parent in reversed(PurePosixPath(name).parents[:-1]):
            args += ["--dir", f"{WORKDIR}/{parent}"]
        args += ["--file", str(fd), f"{WORKDIR}/{name}"]
    args += [
        "--remount-ro",
        "/",
        "--chdir",
        WORKDIR,
        "--clearenv",
        "--setenv",
        "PATH",
        _PATH,
        "--setenv",
        "HOME",
        WORKDIR,
        "--setenv",
        "TMPDIR",
        "/tmp",
        "--setenv",
        "LANG",
        "C.UTF-8",
    ]
    return args


def _rlimits(limits: SandboxLimits, *, together: bool) -> dict[str, tuple[int, int]]:
    """The launcher's rlimits, which every process of the program inherits. `together`: a cgroup holds
    the program's memory in total, so one process may have all of it; without one, each gets its share."""
    cpu = math.ceil(limits.cpu_s) + 1  # a backstop: the launcher ends the program at cpu_s in total
    memory = limits.memory_mb if together else limits.memory_mb // limits.processes
    return {
        "RLIMIT_CPU": (cpu, cpu),
        "RLIMIT_AS": (memory << 20,) * 2,
        "RLIMIT_NPROC": (limits.processes,) * 2,
        "RLIMIT_FSIZE": (limits.file_size_mb << 20,) * 2,
        "RLIMIT_CORE": (0, 0),
        "RLIMIT_NOFILE": (OPEN_FILES,) * 2,
    }


# -- the total caps: a cgroup per program where the host allows it ------------------------------------

_cgroup_lock = threading.Lock()
_cgroup_names = itertools.count()


def total_caps_mechanism() -> str:
    """How this host holds a program's processes to memory_mb together, in one line (logged once)."""
    parent = _cgroups_parent()
    if parent is not None:
        return f"a cgroup v2 per program under {parent} (memory.max = memory_mb, pids.max = processes)"
    return "rlimits: each of a program's processes gets memory_mb / processes of address space"


def _cgroups_parent() -> Path | None:
    with _cgroup_lock:  # one check and one log line, even when the first runs start together
        return _checked_cgroups_parent()


@functools.cache
def _checked_cgroups_parent() -> Path | None:
    parent, why = _make_cgroups_parent()
    if parent is not None:
        log.info(
            "sandbox: each program runs in a cgroup of its own under %s, which caps its processes' "
            "memory and number together",
            parent,
        )
    else:
        log.info(
            "sandbox: no cgroup per program (%s): each of a program's processes gets memory_mb / "
            "processes of address space instead",
            why,
        )
    return parent


def _make_cgroups_parent() -> tuple[Path | None, str]:
    """A cgroup v2 whose children get the memory and pids controllers: (its path, "") or (None, why not)."""
    root = _cgroup2_mount()
    if root is None:
        return None, "no cgroup2 hierarchy is mounted"
    try:
        available = (root / "cgroup.controllers").read_text().split()
        missing = [c for c in ("memory", "pids") if c not in available]
        if missing:
            return None, f"the cgroup2 hierarchy at {root} has no {' or '.join(missing)} controller"
        parent = root / CGROUP_PARENT
        _enable_controllers(root)
        parent.mkdir(exist_ok=True)
        _enable_controllers(parent)
    except OSError as err:
        return None, f"cannot delegate the memory and pids controllers under {root}: {err}"
    return parent, ""


def _enable_controllers(cgroup: Path) -> None:
    """Give `cgroup`'s children the memory and pids controllers (refused where `cgroup` holds processes
    itself and is not the root: cgroup v2 keeps processes in leaves only)."""
    control = cgroup / "cgroup.subtree_control"
    if not {"memory", "pids"} <= set(control.read_text().split()):
        control.write_text("+memory +pids")


def _cgroup2_mount() -> Path | None:
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            fields_ = line.split()
            if fields_[fields_.index("-") + 1] == "cgroup2":
                return Path(fields_[4])
    return None


@dataclass
class _ProgramCgroup:
    """One program's cgroup: its processes' memory (swap included) and number, together."""

    path: Path

    @classmethod
    async def make(cls, limits: SandboxLimits) -> _ProgramCgroup | None:
        """A new cgroup for one program, or None where this host has none to give (rlimits then)."""
        parent = _cgroups_parent()
        if parent is None:
            return None
        path = parent / f"{os.getpid()}-{next(_cgroup_names)}"
        try:
            path.mkdir()
        except OSError as err:
            raise SandboxUnavailable(f"could not make the sandbox's cgroup {path}: {err}") from err
        cgroup = cls(path)
        try:
            cgroup._write("memory.max", str(limits.memory_mb << 20))
            cgroup._write("memory.swap.max", "0", optional=True)  # no swap: memory.max is all it gets
            cgroup._write("memory.oom.group", "1", optional=True)  # out of memory ends the whole program
            cgroup._write("pids.max", str(limits.processes))
        except OSError as err:
            await cgroup.remove()
            raise SandboxUnavailable(f"could not set the limits of the sandbox's cgroup {path}: {err}") from err
        return cgroup

    def enter(self, pid: int) -> None:
        self._write("cgroup.procs", str(pid))

    def capped(self) -> set[str]:
        """The caps its processes ran into: "memory" (the OOM killer ended them), "processes"."""
        out = set()
        if self._count("memory.events", "oom_kill"):
            out.add("memory")
        if self._count("pids.events", "max"):
            out.add("processes")
        return out

    async def remove(self) -> None:
        """Kill what is left in it and remove it (a cgroup with processes cannot be removed)."""
        with contextlib.suppress(OSError):
            self._write("cgroup.kill", "1", optional=True)
        for _ in range(200):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:  # EBUSY while its killed processes are being reaped
                await asyncio.sleep(0.005)
        log.warning("sandbox: could not remove the cgroup %s: it still holds processes", self.path)

    def _write(self, name: str, value: str, optional: bool = False) -> None:
        if optional and not (self.path / name).exists():
            return
        (self.path / name).write_text(value)

    def _count(self, name: str, key: str) -> int:
        with contextlib.suppress(OSError, ValueError):
            for line in (self.path / name).read_text().splitlines():
                field, _, value = line.partition(" ")
                if field == key:
                    return int(value)
        return 0


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
            probe = [
                bwrap,
                *_namespace_args(unshare_net=False),
                *_filesystem_args(SandboxLimits(), {}),
                "--",
                python,
                "-I",
                "-c",
                "",
            ]
            with_net = _try(probe[:1] + ["--unshare-net"] + probe[1:])
            if with_net is None:
                _netns_checked[bwrap] = True
            else:
                without = _try(probe)
                if without is not None:  # no sandbox at all: not cached, the next run asks again
                    raise SandboxUnavailable(f"bwrap cannot create a sandbox here: {without}")
                log.warning(
                    "network namespaces are not allowed on this machine (bwrap: %s): sandboxed "
                    "programs can reach the network",
                    with_net,
                )
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
# <go fd or -1> <rlimits> <watch> main.py`. It sets the limits, closes every inherited descriptor,
# writes the ready byte (a failure before it is the sandbox's, after it the program's), waits for the
# go byte where the host moves it into a cgroup first, and forks the program, which runs main.py as
# __main__ with a traceback that shows only its own frames. The init then reaps whatever ends (the
# program, and orphans handed to it) and every CPU_WATCH_S adds up the CPU time of the namespace's
# processes (its own, the reaped ones', the live ones' from /proc): past cpu_s it kills them all. Once
# the program has ended, it writes its exit status, the namespace's CPU time and the caps it ran into after the ready
# byte. Being init and not dumpable, it is out of the program's reach: the kernel drops a SIGKILL from
# inside the namespace, and /proc hides its descriptors from the program.
_LAUNCHER = r"""
def _launch():
    import builtins, ctypes, json, os, resource, signal, sys
    status, go, limits, watch, path = int(sys.argv[1]), int(sys.argv[2]), *map(json.loads, sys.argv[3:5]), sys.argv[5]
    for name, (soft, hard) in limits.items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    for fd in [int(name) for name in os.listdir("/proc/self/fd")]:
        if fd > 2 and fd not in (status, go):
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
    if go >= 0:
        if os.read(go, 1) != b"G":  # the host gave up on this sandbox
            os._exit(1)
        os.close(go)
    program = os.fork()
    if program == 0:
        os.close(status)
        prctl(4, 1, 0, 0, 0)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _run(source, path)
        return
    wait_status, capped = _watch(program, **watch)
    report = {"returncode": os.waitstatus_to_exitcode(wait_status), "cpu_s": _usage()[1], "capped": sorted(capped)}
    os.write(status, json.dumps(report).encode())
    os._exit(0)

def _watch(program, cpu_s, processes, every):
    # Reap until the program ends, holding the namespace to cpu_s in total: (its wait status, caps hit).
    import os, select, signal
    pidfd = os.pidfd_open(program)
    capped = set()
    while True:
        select.select([pidfd], [], [], every)
        while True:
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid = 0
            if pid == program:
                return wait_status, capped
            if pid == 0:
                break
        tasks, used = _usage()
        if tasks >= processes:
            capped.add("processes")
        if used > cpu_s and "cpu" not in capped:
            capped.add("cpu")
            os.kill(-1, signal.SIGKILL)  # from init: every process of the namespace but itself

def _usage():
    # (tasks, CPU seconds) of the whole namespace: the live processes' and what was reaped.
    import os, resource
    tick = os.sysconf("SC_CLK_TCK")
    tasks = 0
    used = sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/" + name + "/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        tasks += int(stat[17])  # num_threads
        if name != "1":  # utime, stime, and those of its reaped children
            used += sum(int(ticks) for ticks in stat[11:15]) / tick
    return tasks, used

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
