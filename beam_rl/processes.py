"""Processes of a run: which worker this is, and stopping the children a run started."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterable


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


def tree_pids(root: int, exclude: set[int] = frozenset()) -> list[int]:
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
