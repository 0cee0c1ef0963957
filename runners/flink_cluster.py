"""A standalone Flink cluster on this machine: one JobManager and N TaskManagers, each its own JVM.

The distribution is the one inside the PyPI apache-flink wheel (scripts/setup-flink-cluster.sh), at
the Flink version Beam's job server speaks. Every cluster gets its own conf/log directory and free
loopback ports, so tests can run several and kill single TaskManagers. For users:

    python -m runners.flink_cluster --taskmanagers 2     # prints the flink_master, runs until Ctrl-C
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from beam_rl.processes import stop_processes

_REPO = Path(__file__).resolve().parents[1]
SETUP_SCRIPT = _REPO / "scripts" / "setup-flink-cluster.sh"

# Loopback-only, small JVMs, and fast failure detection: a killed TaskManager is noticed within
# seconds (default heartbeat timeout is 50 s), so a job's restart is measurable in a test.
DEFAULT_SETTINGS: dict[str, Any] = {
    "jobmanager.bind-host": "localhost",
    "jobmanager.rpc.address": "localhost",
    "rest.address": "localhost",
    "rest.bind-address": "localhost",
    "taskmanager.bind-host": "localhost",
    "taskmanager.host": "localhost",
    "jobmanager.memory.process.size": "1024m",
    "taskmanager.memory.process.size": "1280m",
    "taskmanager.memory.managed.size": "64m",
    "heartbeat.interval": 1000,
    "heartbeat.timeout": 5000,
    "cluster.evenly-spread-out-slots": True,  # parallel subtasks land on different TaskManagers
    "restart-strategy.type": "fixed-delay",
    "restart-strategy.fixed-delay.attempts": 20,
    "restart-strategy.fixed-delay.delay": "1 s",
}


class FlinkClusterError(RuntimeError):
    """The cluster did not start or answer; the message names the log to read."""


def flink_home() -> Path:
    """$FLINK_HOME if set, else the cached distribution (set up on first use, ~30 s)."""
    if os.environ.get("FLINK_HOME"):
        return Path(os.environ["FLINK_HOME"])
    proc = subprocess.run([str(SETUP_SCRIPT)], check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise FlinkClusterError(f"{SETUP_SCRIPT} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


@dataclass
class FlinkCluster:
    """A running cluster; `master` is what Beam's `--flink_master` takes."""

    home: Path
    workdir: Path
    rest_port: int
    jobmanager: subprocess.Popen | None = None
    taskmanagers: list[subprocess.Popen] = field(default_factory=list)
    slots_per_taskmanager: int = 2

    @property
    def master(self) -> str:
        return f"localhost:{self.rest_port}"

    @property
    def conf_dir(self) -> Path:
        return self.workdir / "conf"

    @property
    def log_dir(self) -> Path:
        return self.workdir / "log"

    # -- processes -------------------------------------------------------------------------------

    def _spawn(self, script: str, name: str, *args: str) -> subprocess.Popen:
        env = dict(os.environ, FLINK_CONF_DIR=str(self.conf_dir), FLINK_LOG_DIR=str(self.log_dir),
                   FLINK_PID_DIR=str(self.workdir), FLINK_IDENT_STRING=name)
        # start-foreground execs the JVM, so this pid is the JVM's: kill() hits exactly that process.
        with open(self.log_dir / f"{name}.out", "ab") as out:
            return subprocess.Popen([str(self.home / "bin" / script), "start-foreground", *args], env=env,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def start_jobmanager(self) -> None:
        self.jobmanager = self._spawn("jobmanager.sh", "jobmanager")

    def add_taskmanager(self) -> subprocess.Popen:
        name = f"taskmanager-{len(self.taskmanagers)}"
        # The resource id is what the REST API names a subtask's TaskManager by: kill the right one.
        proc = self._spawn("taskmanager.sh", name, f"-Dtaskmanager.resource-id={name}")
        self.taskmanagers.append(proc)
        return proc

    def taskmanagers_of(self, job_id: str) -> set[str]:
        """Resource ids of the TaskManagers running any subtask of the job."""
        names = set()
        for vertex in self.rest(f"/jobs/{job_id}")["vertices"]:
            for subtask in self.rest(f"/jobs/{job_id}/vertices/{vertex['id']}")["subtasks"]:
                names.add(subtask.get("taskmanager-id"))
        return names - {None, "(unassigned)"}

    def kill_taskmanager(self, index: int) -> None:
        """SIGKILL, as a crashed machine would: no deregistration, the JobManager must notice."""
        proc = self.taskmanagers[index]
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def stop(self) -> None:
        stop_processes([p for p in [*self.taskmanagers, self.jobmanager] if p is not None], timeout_s=20)
        # Flink's scratch (io.tmp.dirs: blob caches, every job's uploaded jars) is ~1 GB per run;
        # conf/ and log/ stay for a post-mortem.
        shutil.rmtree(self.workdir / "tmp", ignore_errors=True)

    # -- REST ------------------------------------------------------------------------------------

    def rest(self, path: str, timeout_s: float = 5.0) -> Any:
        with urllib.request.urlopen(f"http://{self.master}{path}", timeout=timeout_s) as response:
            return json.loads(response.read())

    def overview(self) -> dict[str, Any] | None:
        try:
            return self.rest("/overview")
        except (OSError, urllib.error.URLError, ValueError):
            return None

    def wait_ready(self, taskmanagers: int, timeout_s: float = 120.0) -> dict[str, Any]:
        """Waits until the REST endpoint answers and `taskmanagers` TaskManagers have registered
        their slots (a TaskManager is listed before its slot report arrives)."""
        deadline = time.monotonic() + timeout_s
        overview = None
        while time.monotonic() < deadline:
            if self.jobmanager is not None and self.jobmanager.poll() is not None:
                raise FlinkClusterError(f"the JobManager exited with {self.jobmanager.returncode}; see {self.log_dir}")
            overview = self.overview()
            if (overview and overview.get("taskmanagers", 0) >= taskmanagers
                    and overview.get("slots-total", 0) >= taskmanagers * self.slots_per_taskmanager):
                return overview
            time.sleep(0.5)
        raise FlinkClusterError(f"cluster not ready in {timeout_s:g}s (last overview {overview}); see {self.log_dir}")

    def jobs(self) -> list[dict[str, Any]]:
        return self.rest("/jobs/overview")["jobs"]

    def job_metric(self, job_id: str, name: str) -> float | None:
        values = self.rest(f"/jobs/{job_id}/metrics?get={name}")
        return float(values[0]["value"]) if values else None

    def checkpoints(self, job_id: str) -> dict[str, Any]:
        return self.rest(f"/jobs/{job_id}/checkpoints")


def write_conf(home: Path, conf_dir: Path, settings: dict[str, Any]) -> None:
    """conf/ of the distribution (log4j files, Java 17 --add-opens flags) with `settings` on top."""
    shutil.copytree(home / "conf", conf_dir, dirs_exist_ok=True)
    base = _flatten(yaml.safe_load((home / "conf" / "config.yaml").read_text()) or {})
    (conf_dir / "config.yaml").write_text(yaml.safe_dump({**base, **settings}, sort_keys=True))


def start_cluster(taskmanagers: int = 2, slots_per_taskmanager: int = 2, workdir: str | Path | None = None,
                  settings: dict[str, Any] | None = None, ready_timeout_s: float = 120.0) -> FlinkCluster:
    """Starts a JobManager and `taskmanagers` TaskManagers and waits until all are registered."""
    home = flink_home()
    workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="beam-rl-flink-"))
    cluster = FlinkCluster(home=home, workdir=workdir, rest_port=_free_port(),
                           slots_per_taskmanager=slots_per_taskmanager)
    cluster.log_dir.mkdir(parents=True, exist_ok=True)
    write_conf(home, cluster.conf_dir, {
        **DEFAULT_SETTINGS,
        "rest.port": cluster.rest_port,
        "jobmanager.rpc.port": _free_port(),
        "taskmanager.numberOfTaskSlots": slots_per_taskmanager,
        "io.tmp.dirs": str(workdir / "tmp"),
        **(settings or {}),
    })
    try:
        cluster.start_jobmanager()
        for _ in range(taskmanagers):
            cluster.add_taskmanager()
        cluster.wait_ready(taskmanagers, ready_timeout_s)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--taskmanagers", type=int, default=2)
    parser.add_argument("--slots", type=int, default=2, help="task slots per TaskManager")
    parser.add_argument("--workdir", help="conf/ and log/ go here (default: a new temporary directory)")
    args = parser.parse_args()
    started = time.monotonic()
    cluster = start_cluster(args.taskmanagers, args.slots, args.workdir)
    print(f"Flink cluster ready in {time.monotonic() - started:.1f}s: flink_master = \"{cluster.master}\" "
          f"(web UI http://{cluster.master}, logs {cluster.log_dir}); Ctrl-C stops it", flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops it like Ctrl-C
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
