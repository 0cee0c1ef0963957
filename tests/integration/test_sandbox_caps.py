"""The sandbox's caps on all of a program's processes together (memory, processes, CPU time), at the
defaults users run, and its output made safe for logs and consoles. On real bubblewrap; whichever
mechanism this host allows holds the caps (a cgroup per program, or rlimits split between processes)."""

from __future__ import annotations

import asyncio
import shutil
import threading
import time

import pytest

from beam_rl.envs import sandbox
from beam_rl.envs.sandbox import CAPS, SandboxLimits, SandboxResult, run_python, total_caps_mechanism
from beam_rl.printable import printable
from bench.common.procs import cmdline
from tests.support import children

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (scripts/setup.sh)")

DEFAULTS = SandboxLimits()


def run(source: str, limits: SandboxLimits = DEFAULTS) -> SandboxResult:
    return asyncio.run(run_python(source, limits=limits))


# Forks up to 6 children; each (and then the parent) fills memory 1 MB at a time, writing every byte,
# until MemoryError or half of memory_mb, then holds it. The parent prints the MB held at once by all.
FORKING_MEMORY_BOMB = """
import os, time
def grab():
    held = []
    try:
        while len(held) < {half_mb}:
            held.append(b"\\1" * (1 << 20))
    except MemoryError:
        pass
    return held
r, w = os.pipe()
kids = []
for _ in range(6):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        held = grab()
        os.write(w, b"%d\\n" % len(held))
        time.sleep(600)
    kids.append(pid)
held = grab()
reports = os.fdopen(r)
total = len(held) + sum(int(reports.readline()) for _ in kids)
print(len(kids), total)
"""


def test_a_forking_memory_bomb_is_capped_in_total() -> None:
    result = run(FORKING_MEMORY_BOMB.format(half_mb=DEFAULTS.memory_mb // 2))
    if "memory" in result.capped:  # a cgroup: the OOM killer ended the whole program
        assert result.signal == "SIGKILL" and "stopped at its total memory" in result.verdict
        return
    assert result.ok, result.verdict + "\n" + result.stderr
    kids, held_mb = map(int, result.stdout.split())
    assert kids >= 1  # it did fork
    assert held_mb <= DEFAULTS.memory_mb, f"{kids + 1} processes held {held_mb} MB together"


FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"


def test_a_fork_bomb_hits_the_process_cap() -> None:
    most = 0

    def watch(stop: threading.Event) -> None:
        nonlocal most
        while not stop.is_set():
            most = max(most, len(children.started_since_test_began()))
            time.sleep(0.02)

    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(stop,))
    watcher.start()
    try:
        result = run(FORK_BOMB, SandboxLimits(cpu_s=1, wall_s=60))  # the default processes and memory
    finally:
        stop.set()
        watcher.join()
    # It forked to the cap and spun there until the CPU time of all its processes together ran out.
    assert result.capped == ("cpu", "processes") and not result.timed_out, result.verdict
    assert most <= DEFAULTS.processes + 1  # bwrap, outside the namespace, is the +1
    assert not children.started_since_test_began()


def test_a_multi_process_program_hits_the_total_cpu_cap() -> None:
    # The program and its two children each spin 0.7 s, under one process's CPU limit: 2.1 s together.
    source = (
        "import os, time\n"
        "kids = []\n"
        "for _ in range(2):\n"
        "    kids.append(os.fork())\n"
        "    if kids[-1] == 0:\n"
        "        break\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < 0.7:\n"
        "    pass\n"
        "if kids[-1] == 0:\n"
        "    os._exit(0)\n"
        "for pid in kids:\n"
        "    os.waitpid(pid, 0)\n"
        "print('done')\n"
    )
    result = run(source, SandboxLimits(cpu_s=1, wall_s=60))
    assert "cpu" in result.capped and result.signal == "SIGKILL" and not result.timed_out, result.verdict
    assert result.stdout == "" and 1 <= result.cpu_s < 2.1
    assert result.verdict.startswith(f"killed by SIGKILL; {CAPS['cpu']}")


def test_escape_sequences_in_a_programs_output_are_neutralised() -> None:
    source = (
        "import sys\n"
        "print('\\x1b[2J\\x1b[1;1Hclear\\x1b]0;title\\x07\\x9b31m\\u202etxt.exe\\r\\tok')\n"
        "sys.stderr.write('\\x1b[31mred\\x08\\x00\\n')\n"
    )
    result = run(source)
    assert result.ok
    assert result.stdout == "\\x1b[2J\\x1b[1;1Hclear\\x1b]0;title\\x07\\x9b31m\\u202etxt.exe\\r\tok\n"
    assert result.stderr == "\\x1b[31mred\\x08\\x00\n"
    assert printable("plain text, ünïcode\n\tand tabs") == "plain text, ünïcode\n\tand tabs"


def test_the_mechanism_in_force_is_named() -> None:
    assert total_caps_mechanism().startswith(("a cgroup v2 per program under ", "rlimits: "))


def test_with_a_cgroup_the_launcher_enters_it_before_the_program_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    # A directory stands in for the cgroup2 tree (this host may have none to give): what the sandbox
    # writes there, and that the program starts only after the host has moved the launcher in.
    monkeypatch.setattr(sandbox, "_checked_cgroups_parent", lambda: tmp_path)
    removed = []

    async def remove(self) -> None:
        removed.append(self.path.name)
        shutil.rmtree(self.path)

    monkeypatch.setattr(sandbox._ProgramCgroup, "remove", remove)
    seen = {}

    def enter(self, pid: int) -> None:
        seen.update({name: (self.path / name).read_text() for name in ("memory.max", "pids.max")})
        seen["launcher"] = cmdline(pid)
        (self.path / "cgroup.procs").write_text(str(pid))

    monkeypatch.setattr(sandbox._ProgramCgroup, "enter", enter)
    result = run("import resource\nprint(resource.getrlimit(resource.RLIMIT_AS)[0] >> 20)\n")
    # One process may have all of memory_mb: the cgroup holds the total.
    assert result.ok and result.stdout == f"{DEFAULTS.memory_mb}\n"
    assert seen["memory.max"] == str(DEFAULTS.memory_mb << 20) and seen["pids.max"] == str(DEFAULTS.processes)
    assert sandbox._LAUNCHER in seen["launcher"]  # the launcher, not bwrap: its children follow it in
    assert len(removed) == 1 and not list(tmp_path.iterdir())
