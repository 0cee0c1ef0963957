"""The sandbox on real bubblewrap: what a program can do, what it cannot reach, and that its failures
are reported as the program's, while a sandbox that cannot run raises SandboxUnavailable."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from beam_rl.envs import sandbox
from beam_rl.envs.sandbox import (
    OUTPUT_LIMIT,
    SandboxLimits,
    SandboxResult,
    SandboxUnavailable,
    run_python,
)
from bench.common.procs import cmdline
from tests.support import children

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (scripts/setup.sh)")

QUICK = SandboxLimits(cpu_s=1, wall_s=5)


def run(source: str, **kwargs) -> SandboxResult:
    return asyncio.run(run_python(source, **kwargs))


def sandbox_pids() -> list[int]:
    """Every process this test started that is still alive (the sandboxes' included)."""
    return children.started_since_test_began()


@pytest.fixture
def listener():
    """A TCP listener on a loopback port of this machine, and whether anything connected to it."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    yield server
    server.close()


def accepted(server: socket.socket) -> bool:
    try:
        conn, _ = server.accept()
    except TimeoutError:
        return False
    conn.close()
    return True


CONNECT = """
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=1).close()
    print("connected")
except OSError as exc:
    print("refused:", exc)
"""


# --- What a program can do ------------------------------------------------------------------------


def test_a_program_gets_its_stdin_files_and_a_clean_environment() -> None:
    result = run(
        "import os, sys\n"
        "print(sys.stdin.read().upper(), open('data/words.txt').read(), sorted(os.environ))\n"
        "print(os.getcwd(), sorted(os.listdir('.')))\n"
        "sys.exit(3)\n",
        stdin="hello",
        files={"data/words.txt": "policy version"},
    )
    assert result.exit_code == 3 and result.signal is None and not result.timed_out and not result.ok
    lines = result.stdout.splitlines()
    assert lines[0] == "HELLO policy version ['HOME', 'LANG', 'PATH', 'PWD', 'TMPDIR']"
    assert lines[1] == "/sandbox ['.tmp', 'data', 'main.py']"


def test_an_uncaught_exception_and_a_syntax_error_fail_with_the_programs_traceback() -> None:
    crashed = run("def f():\n    return 1 / 0\nf()\n")
    assert crashed.exit_code == 1
    assert crashed.stderr.startswith('Traceback (most recent call last):\n  File "main.py", line 3')
    assert crashed.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    broken = run("def f(:\n")
    assert broken.exit_code == 1 and 'File "main.py", line 1' in broken.stderr and "SyntaxError" in broken.stderr


def test_a_signal_that_kills_the_program_is_named_and_exit_statuses_are_exact() -> None:
    result = run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    assert (result.exit_code, result.signal, result.timed_out) == (None, "SIGSEGV", False)
    result = run("import sys\nsys.exit(128 + 9)\n")  # not mistaken for a SIGKILL
    assert (result.exit_code, result.signal) == (137, None)


def test_cpu_time_counts_the_program_and_its_children() -> None:
    spin = "t = time.process_time()\nwhile time.process_time() - t < 0.3:\n    pass\n"
    result = run(f"import os, time\nif os.fork() == 0:\n    {spin.replace(chr(10), chr(10) + '    ')}os._exit(0)\n"
                 f"os.wait()\n{spin}")
    assert result.ok, result.stderr
    assert result.cpu_s >= 0.6


def test_no_process_of_the_sandbox_is_left_for_others_to_reap() -> None:
    # As a subreaper, this process adopts whatever the sandbox orphans; none may be left unreaped.
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    try:
        run("import os\nif os.fork() == 0:\n    os.setsid()\n    import time; time.sleep(30)\nprint('done')\n")
        run("import time\ntime.sleep(30)\n", limits=SandboxLimits(wall_s=1))
        time.sleep(0.2)
        assert not sandbox_pids()
    finally:
        libc.prctl(36, 0, 0, 0, 0)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass


def test_output_is_capped() -> None:
    result = run(f"import sys\nsys.stdout.write('x' * {3 * OUTPUT_LIMIT})\nprint('done', file=sys.stderr)\n")
    assert result.ok and result.output_truncated
    assert result.stdout == "x" * OUTPUT_LIMIT and result.stderr == "done\n"


def test_bad_file_names_and_limits_are_refused() -> None:
    for name in ("/etc/passwd", "../up.txt", "a/../../b", "", "main.py", "./x"):
        with pytest.raises(ValueError, match="sandbox file name"):
            run("pass", files={name: "x"})
    with pytest.raises(ValueError, match=r"SandboxLimits\.memory_mb must be a positive number, got 0"):
        SandboxLimits(memory_mb=0)
    with pytest.raises(ValueError, match=r"SandboxLimits\.wall_s"):
        SandboxLimits(wall_s=float("nan"))


# --- Containment: each misbehaviour is stopped, and reported as the program's failure ---------------


def test_an_infinite_loop_is_stopped_by_the_cpu_limit() -> None:
    result = run("while True:\n    pass\n", limits=SandboxLimits(cpu_s=1, wall_s=30))
    assert (result.exit_code, result.signal, result.timed_out, result.capped) == (None, "SIGKILL", False, ("cpu",))
    assert 1 <= result.cpu_s < 2  # stopped at cpu_s, before the per-process backstop (RLIMIT_CPU, a second later)


def test_the_wall_clock_timeout_kills_the_whole_process_tree() -> None:
    # Sleeping uses no CPU: only the wall clock stops these, and it must take the children too.
    marker = f"{time.time_ns() % 10**6 + 1000}.5"
    source = (
        "import subprocess, time\n"
        f"children = [subprocess.Popen(['sleep', '{marker}']) for _ in range(2)]\n"
        "print('started', flush=True)\n"
        "time.sleep(600)\n"
    )
    result = run(source, limits=SandboxLimits(wall_s=1.5))
    assert result.timed_out and result.signal == "SIGKILL" and result.exit_code is None
    assert result.stdout == "started\n"  # output up to the kill is kept
    assert not [pid for pid in sandbox_pids() if marker in cmdline(pid)]
    assert not sandbox_pids()


def test_a_fork_bomb_stays_under_the_process_limit() -> None:
    source = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    most = 0

    def watch(stop: threading.Event) -> None:
        nonlocal most
        while not stop.is_set():
            most = max(most, len(sandbox_pids()))
            time.sleep(0.02)

    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(stop,))
    watcher.start()
    try:
        result = run(source, limits=SandboxLimits(cpu_s=1, wall_s=2, processes=12, memory_mb=12 * 24))
    finally:
        stop.set()
        watcher.join()
    assert result.timed_out or result.signal  # the program's failure, not the sandbox's
    assert 3 < most <= 12 + 1  # the limit counts the sandbox's init; bwrap outside it is the +1
    assert not sandbox_pids()
    assert subprocess.run(["true"]).returncode == 0  # this machine can still start processes


def test_a_memory_bomb_hits_the_address_space_limit() -> None:
    # Without a cgroup one process gets memory_mb / processes of it: 128 MB here, of which python uses ~15.
    limits = SandboxLimits(memory_mb=256, processes=2)
    fits = run("x = bytearray(100 << 20)\nprint(len(x))\n", limits=limits)
    assert fits.ok and fits.stdout == f"{100 << 20}\n"
    bomb = "blocks = []\nwhile True:\n    blocks.append(bytearray(10 << 20))\n"
    result = run(bomb, limits=limits)
    assert result.exit_code == 1 and result.stderr.rstrip().endswith("MemoryError")


def test_the_file_size_limit_stops_a_growing_file() -> None:
    source = "with open('big', 'wb') as f:\n    while True:\n        f.write(b'x' * 65536)\n"
    result = run(source, limits=SandboxLimits(file_size_mb=1))
    # Python ignores SIGXFSZ, so the write past the limit fails with EFBIG instead.
    assert result.exit_code == 1 and result.stderr.rstrip().endswith("OSError: [Errno 27] File too large")


def test_a_program_cannot_write_outside_its_directory(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    name = f"escaped-{os.getpid()}-{time.time_ns()}"
    targets = [str(run_dir / name), f"{tempfile.gettempdir()}/{name}", f"/tmp/{name}", f"/{name}", f"/usr/{name}",
               f"/dev/{name}", f"../{name}"]
    source = (
        "import os\n"
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        with open(path, 'w') as f:\n"
        "            f.write('out')\n"
        "        print('wrote', path)\n"
        "    except OSError as exc:\n"
        "        print('refused', path, type(exc).__name__)\n"
    )
    result = run(source)
    assert result.ok, result.stderr
    wrote = [line.split()[1] for line in result.stdout.splitlines() if line.startswith("wrote")]
    # The sandbox's own /tmp and workdir take the write; nothing lands on the host.
    assert set(wrote) <= {f"/tmp/{name}", f"../{name}"}, result.stdout
    for path in [run_dir / name, Path(tempfile.gettempdir()) / name, Path("/tmp") / name, Path("/") / name,
                 Path("/usr") / name, Path("/dev") / name]:
        assert not path.exists(), path
    assert os.listdir(run_dir) == []


def test_a_program_sees_no_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = f"s3cret-{time.time_ns()}"
    monkeypatch.setenv("BEAM_RL_TEST_SECRET", secret)
    secret_file = tmp_path / "credentials"
    secret_file.write_text(secret)
    secret_file.chmod(0o600)
    source = (
        "import os\n"
        "print(os.environ)\n"
        f"for path in [{str(secret_file)!r}, '/proc/{os.getpid()}/environ', '/proc/1/environ', '/proc/self/environ']:\n"
        "    try:\n"
        "        print(path, open(path, 'rb').read())\n"
        "    except OSError as exc:\n"
        "        print(path, type(exc).__name__)\n"
    )
    result = run(source)
    assert result.ok, result.stderr
    assert secret not in result.stdout + result.stderr
    assert f"{secret_file} FileNotFoundError" in result.stdout  # the host's files are not there at all


def test_a_program_cannot_open_a_network_connection(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    result = run(CONNECT.format(port=port))
    assert result.ok and result.stdout.startswith("refused:"), result.stdout
    assert not accepted(listener)
    # The same program with the network allowed reaches the listener: the check above can see a connection.
    allowed = run(CONNECT.format(port=port), limits=SandboxLimits(network=True))
    assert allowed.stdout == "connected\n"
    assert accepted(listener)


def test_a_program_cannot_kill_its_parent_or_the_orchestrator() -> None:
    victim = subprocess.Popen(["sleep", "60"])
    try:
        source = (
            "import ctypes, os, signal\n"
            f"for name, pid in [('parent', os.getppid()), ('orchestrator', {os.getpid()}), ('victim', {victim.pid})]:\n"
            "    try:\n"
            "        os.kill(pid, signal.SIGKILL)\n"
            "        print(name, pid, 'signalled')\n"
            "    except OSError as exc:\n"
            "        print(name, pid, type(exc).__name__)\n"
            f"print('ptrace', ctypes.CDLL(None, use_errno=True).ptrace(16, {os.getpid()}, 0, 0))  # PTRACE_ATTACH\n"
            "try:\n"
            "    os.listdir('/proc/1/fd')\n"
            "except OSError as exc:\n"
            "    print('init fds', type(exc).__name__)\n"
            "import time; time.sleep(0.3)\n"
            "print('survived')\n"
        )
        result = run(source)
        # The program lives on, so its parent (the sandbox's init, whose death would end it) did too.
        assert result.ok and result.stdout.endswith("ptrace -1\ninit fds PermissionError\nsurvived\n"), result.stdout
        assert "parent 1 " in result.stdout  # inside its PID namespace, the parent is the sandbox's init
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()


def test_its_directory_is_gone_after_the_run() -> None:
    source = (
        "open('left-behind', 'w').write('x')\n"
        "open('/tmp/left-behind', 'w').write('x')\n"
        "print('written', flush=True)\n"
    )
    seen_during: list[str] = []

    async def watch_then_run() -> SandboxResult:
        task = asyncio.create_task(run_python(source + "import time\ntime.sleep(30)\n", limits=SandboxLimits(wall_s=2)))
        for _ in range(150):
            await asyncio.sleep(0.01)
            for pid in sandbox_pids():
                root = Path(f"/proc/{pid}/root/sandbox")
                with contextlib.suppress(OSError):  # exited meanwhile
                    if (root / "left-behind").exists():
                        seen_during.append(str(root))
            if seen_during:
                break
        return await task

    result = asyncio.run(watch_then_run())
    assert result.timed_out and result.stdout == "written\n"
    assert seen_during  # the directory existed (seen from the host through the sandbox's root) ...
    assert not sandbox_pids()  # ... and nothing of the sandbox is left to hold its mount
    assert not any(Path(path).exists() for path in seen_during)
    fresh = run("import os\nprint(sorted(os.listdir('.')), os.listdir('/tmp'))\n")
    assert fresh.stdout == "['.tmp', 'main.py'] []\n"


def test_concurrent_runs_do_not_interfere() -> None:
    source = (
        "import os, time\n"
        "me = open('me.txt').read()\n"
        "open(me, 'w').write(me)\n"
        "open('/tmp/' + me, 'w').write(me)\n"
        "forks = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(2)\n"
        "            os._exit(0)\n"
        "        forks += 1\n"
        "except OSError:\n"
        "    pass\n"
        "time.sleep(0.3)\n"
        "print(me, forks, sorted(os.listdir('.')), os.listdir('/tmp'))\n"
    )

    async def all_at_once() -> list[SandboxResult]:
        limits = SandboxLimits(processes=8, memory_mb=256)
        return await asyncio.gather(*[run_python(source, files={"me.txt": f"run{i}"}, limits=limits) for i in range(5)])

    results = asyncio.run(all_at_once())
    for i, result in enumerate(results):
        # Each run saw only its own files and had the whole process budget to itself (8 = its
        # init + itself + 6 children), though all five forked at the same time.
        assert result.stdout == f"run{i} 6 ['.tmp', 'main.py', 'me.txt', 'run{i}'] ['run{i}']\n", result.stdout


# --- Infrastructure failures: SandboxUnavailable, never a program result ---------------------------


@pytest.fixture
def fake_bwrap():
    """Makes a `bwrap` that runs a shell script (the real bwrap is $REAL there); returns a PATH that
    finds it first. It lives in a directory the sandbox's unprivileged uid may enter."""
    bin_dir = Path(tempfile.mkdtemp(prefix="fake-bwrap-"))
    bin_dir.chmod(0o755)

    def make(script: str) -> str:
        fake = bin_dir / "bwrap"
        fake.write_text(f"#!/bin/sh\nREAL={shutil.which('bwrap')}\n{script}\n")
        fake.chmod(0o755)
        return f"{bin_dir}:{os.environ['PATH']}"

    yield make
    shutil.rmtree(bin_dir)


def test_unavailable_when_bwrap_is_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap there
    with pytest.raises(SandboxUnavailable, match="install the Debian package bubblewrap"):
        run("print(1)")


def test_unavailable_when_bwrap_cannot_build_the_sandbox(monkeypatch: pytest.MonkeyPatch, fake_bwrap) -> None:
    # Only the sandboxed program's own runs fail (the network check passes): the failure comes
    # before the program starts, so it is the sandbox's, whatever its exit status.
    monkeypatch.setenv("PATH", fake_bwrap('case "$*" in *main.py*) echo "bwrap: Creating new namespace failed: '
                                          'No space left on device" >&2; exit 1;; esac\nexec "$REAL" "$@"'))
    with pytest.raises(SandboxUnavailable, match=r"failed \(exit status 1\): bwrap: Creating new namespace failed"):
        run("print(1)")


def test_unavailable_when_the_sandbox_does_not_start_in_time(monkeypatch: pytest.MonkeyPatch, fake_bwrap) -> None:
    monkeypatch.setenv("PATH", fake_bwrap('case "$*" in *main.py*) exec sleep 30;; esac\nexec "$REAL" "$@"'))
    started = time.monotonic()
    with pytest.raises(SandboxUnavailable, match=r"did not start within 1\.0 s"):
        run("print(1)", limits=SandboxLimits(wall_s=1.0))
    assert time.monotonic() - started < 5 and not sandbox_pids()


def test_without_network_namespaces_programs_keep_the_network_and_we_say_so_once(
    monkeypatch: pytest.MonkeyPatch, fake_bwrap, caplog: pytest.LogCaptureFixture, listener: socket.socket
) -> None:
    refuse_netns = (
        'case "$*" in *--unshare-net*) '
        'echo "bwrap: loopback: Failed RTM_NEWADDR: Operation not permitted" >&2; exit 1;; esac'
    )
    monkeypatch.setenv("PATH", fake_bwrap(f'{refuse_netns}\nexec "$REAL" "$@"'))
    caplog.set_level(logging.WARNING, logger=sandbox.__name__)
    port = listener.getsockname()[1]
    first, second = run(CONNECT.format(port=port)), run(CONNECT.format(port=port))
    assert first.stdout == second.stdout == "connected\n"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "network namespaces are not allowed on this machine" in warnings[0]
    assert "RTM_NEWADDR" in warnings[0]


def test_the_sandbox_user_is_unprivileged() -> None:
    result = run("import os\nprint(os.getuid(), os.getgid(), os.getgroups())\n"
                 "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])\n")
    uid, gid, groups, capabilities = result.stdout.split("\n", 1)[0].split(" ", 2) + result.stdout.splitlines()[1:]
    if os.geteuid() == 0:  # we are root: the sandbox is nobody, with no supplementary group
        assert (int(uid), int(gid), groups) == (sandbox.SANDBOX_UID, sandbox.SANDBOX_UID, "[]")
    assert capabilities == "0000000000000000"

