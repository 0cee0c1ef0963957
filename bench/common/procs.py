"""Process-tree CPU time and resident memory from /proc (Linux), and embedded servers to measure against."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator

from beam_rl.processes import stop_processes, tree_pids  # noqa: F401  (tests and benches use tree_pids from here)
from beam_rl.standin.launch import start_subprocess_server

_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def name(pid: int) -> str | None:
    """The process's command name (`comm`), or None once it has exited."""
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def descendants_named(command: str) -> list[int]:
    """This process's descendants whose command name is `command` (e.g. "prism", "java")."""
    return [pid for pid in tree_pids(os.getpid()) if name(pid) == command]


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of the live processes, and of the children they have reaped."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(fields[i]) for i in (11, 12, 13, 14)) / _TICK  # utime stime cutime cstime
    return total


def rss_mb_by_name(pids: list[int]) -> dict[str, float]:
    """Resident MB of `pids` summed per process name ("python", "java"): which part of a tree grows."""
    by_name: dict[str, float] = {}
    for pid in pids:
        label = name(pid)
        if label is not None:
            by_name[label] = round(by_name.get(label, 0.0) + rss_bytes([pid]) / 2**20, 1)
    return by_name


def rss_bytes(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * _PAGE
        except OSError:
            continue
    return total


@contextlib.contextmanager
def servers(count: int, mode: str, max_num_seqs: int, extra_args: tuple[str, ...] = ()) -> Iterator[tuple[list[str], list[int]]]:
    """Embedded servers as subprocesses (no GIL shared with the orchestrator); yields (urls, pids)."""
    procs: list[subprocess.Popen] = []
    try:
        urls = []
        for _ in range(count):
            proc, url = start_subprocess_server(mode=mode, max_num_seqs=max_num_seqs,
                                                extra_args=("--served-model-name", "tiny", *extra_args))
            procs.append(proc)
            urls.append(url)
        yield urls, [p.pid for p in procs]
    finally:
        stop_processes(procs)
