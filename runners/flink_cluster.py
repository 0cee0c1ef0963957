"""A standalone Flink cluster on this machine: one JobManager and N TaskManagers, each its own JVM, and
beside each TaskManager a Beam worker pool that runs its Python workers (as a sidecar does on Kubernetes).

The distribution is the one inside the PyPI apache-flink wheel (runners/bootstrap.py), at the Flink
version Beam's job server speaks. Every cluster gets its own conf/log directory and free loopback ports,
so tests can run several and kill single TaskManagers. For users:

    python -m runners.flink_cluster --taskmanagers 2     # prints the flink_master, runs until Ctrl-C

A pipeline names its worker pool by one address that every TaskManager resolves on its own host (on
Kubernetes, localhost:50000 in each pod). Here all TaskManagers share one host, so each runs in a mount
namespace of its own whose /etc/hosts gives WORKER_POOL_HOST its own loopback address (127.0.0.11 for the
first, ...), where its pool listens. Flink itself keeps talking over 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from beam_rl.processes import die_with_parent, free_port, stop_processes, tree_pids
from runners.bootstrap import ensure_flink_distribution
from runners.flink_rest import FlinkRest

WORKER_POOL_HOST = "beam-rl-worker-pool"  # runner.worker_pool's host: each TaskManager's own pool
WORKER_POOL_PORT = 50000

# Loopback-only, small JVMs, and fast failure detection: a killed TaskManager is noticed within
# seconds (default heartbeat timeout is 50 s), so a job's restart is measurable in a test.
DEFAULT_SETTINGS: dict[str, Any] = {
    "jobmanager.bind-host": "127.0.0.1",
    "jobmanager.rpc.address": "127.0.0.1",
    "rest.address": "127.0.0.1",
    "rest.bind-address": "127.0.0.1",
    "taskmanager.bind-host": "127.0.0.1",
    "taskmanager.host": "127.0.0.1",
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
    return ensure_flink_distribution()


def _can_unshare_mounts() -> bool:
    try:
        return (
            subprocess.run(
                ["unshare", "--mount", "--propagation", "private", "true"], capture_output=True, timeout=10
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


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
class TaskManager:
    """One TaskManager JVM and, beside it, its worker pool (None: its Python workers run elsewhere)."""

    name: str
    process: subprocess.Popen
    pool: subprocess.Popen | None = None
    pool_address: str | None = None  # host:port the pool listens on; the TaskManager knows it as WORKER_POOL_HOST


@dataclass
class FlinkCluster:
    """A running cluster; `master` is what Beam's `--flink_master` takes, `worker_pool` what
    `--environment_config` takes for EXTERNAL workers."""

    home: Path
    workdir: Path
    rest_port: int
    jobmanager: subprocess.Popen | None = None
    taskmanagers: list[TaskManager] = field(default_factory=list)
    slots_per_taskmanager: int = 2
    worker_pools: bool = True

    @property
    def master(self) -> str:
        return f"localhost:{self.rest_port}"

    @property
    def worker_pool(self) -> str:
        return f"{WORKER_POOL_HOST}:{WORKER_POOL_PORT}"

    @property
    def api(self) -> FlinkRest:
        return FlinkRest(self.master)

    @property
    def conf_dir(self) -> Path:
        return self.workdir / "conf"

    @property
    def log_dir(self) -> Path:
        return self.workdir / "log"

    # -- processes -------------------------------------------------------------------------------

    def _spawn(self, script: str, name: str, *args: str, hosts: Path | None = None) -> subprocess.Popen:
        env = dict(
            os.environ,
            FLINK_CONF_DIR=str(self.conf_dir),
            FLINK_LOG_DIR=str(self.log_dir),
            FLINK_PID_DIR=str(self.workdir),
            FLINK_IDENT_STRING=name,
        )
        command = [str(self.home / "bin" / script), "start-foreground", *args]
        if hosts is not None:
            # Its own mount namespace, where /etc/hosts names its own worker pool; unshare and sh exec
            # what follows, and start-foreground execs the JVM: this pid ends up the JVM's.
            command = [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                f'mount --bind "{hosts}" /etc/hosts && exec "$@"',
                "sh",
                *command,
            ]
        with open(self.log_dir / f"{name}.out", "ab") as out:
            return subprocess.Popen(
                command,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def start_jobmanager(self) -> None:
        self.jobmanager = self._spawn("jobmanager.sh", "jobmanager")

    def add_taskmanager(self) -> TaskManager:
        """A new TaskManager, with a worker pool of its own if the cluster has them."""
        index = len(self.taskmanagers)
        name = f"taskmanager-{index}"
        pool = address = None
        if self.worker_pools:
            address = f"127.0.0.{11 + index}:{WORKER_POOL_PORT}"
            pool = self._start_pool(name, address)
            hosts = self.workdir / f"hosts-{name}"
            hosts.write_text(Path("/etc/hosts").read_text() + f"\n{address.split(':')[0]} {WORKER_POOL_HOST}\n")
        taskmanager = TaskManager(name, self._start_taskmanager(name, index), pool, address)
        self.taskmanagers.append(taskmanager)
        return taskmanager

    def restart_taskmanager(self, index: int) -> TaskManager:
        """A new TaskManager JVM in place of a dead one, beside the same worker pool (on Kubernetes, the
        pod restarting its crashed container while the sidecar stays)."""
        old = self.taskmanagers[index]
        if old.process.poll() is None:
            raise FlinkClusterError(f"{old.name} is still running")
        name = f"{old.name.split('.')[0]}.{int(old.name.split('.')[1]) + 1 if '.' in old.name else 1}"
        self.taskmanagers[index] = TaskManager(name, self._start_taskmanager(name, index), old.pool, old.pool_address)
        return self.taskmanagers[index]

    def _start_taskmanager(self, name: str, index: int) -> subprocess.Popen:
        hosts = self.workdir / f"hosts-taskmanager-{index}" if self.worker_pools else None
        # The resource id is what the REST API names a subtask's TaskManager by: kill the right one.
        return self._spawn("taskmanager.sh", name, f"-Dtaskmanager.resource-id={name}", hosts=hosts)

    def index_of(self, resource_id: str) -> int:
        """The position in `taskmanagers` of the TaskManager the REST API names `resource_id`."""
        return next(i for i, tm in enumerate(self.taskmanagers) if tm.name == resource_id)

    def _start_pool(self, name: str, address: str) -> subprocess.Popen:
        host, port = address.split(":")
        logs = self.log_dir / f"workers-{name}"
        logs.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, BEAM_RL_WORKER_LOG_DIR=str(logs))
        # Workers run `python`: the interpreter of this environment must lead PATH.
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        with open(self.log_dir / f"pool-{name}.out", "ab") as out:  # the pool writes to its own copy
            pool = subprocess.Popen(
                [sys.executable, "-m", "runners.workers", "pool", "--host", host, "--port", port],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if pool.poll() is not None:
                raise FlinkClusterError(f"the worker pool of {name} exited with {pool.returncode}; see {self.log_dir}")
            try:
                with socket.create_connection((host, int(port)), timeout=1):
                    return pool
            except OSError:
                time.sleep(0.2)
        raise FlinkClusterError(f"the worker pool of {name} did not listen on {address} within 60 s")

    def worker_pids(self, index: int | None = None) -> list[int]:
        """The Python workers (children of the worker pools) now running, of one TaskManager or all."""
        pools = [tm.pool for i, tm in enumerate(self.taskmanagers) if tm.pool and index in (None, i)]
        return [pid for pool in pools for pid in tree_pids(pool.pid) if pid != pool.pid]

    def taskmanagers_of(self, job_id: str) -> set[str]:
        """Resource ids of the TaskManagers running any subtask of the job."""
        names = set()
        for vertex in self.rest(f"/jobs/{job_id}")["vertices"]:
            for subtask in self.rest(f"/jobs/{job_id}/vertices/{vertex['id']}")["subtasks"]:
                names.add(subtask.get("taskmanager-id"))
        return names - {None, "(unassigned)"}

    def kill_taskmanager(self, index: int) -> None:
        """SIGKILL, as a crashed machine would: no deregistration, the JobManager must notice. Its worker
        pool stays up (a sidecar outlives its neighbour's crash); workers it served lose their TaskManager."""
        process = self.taskmanagers[index].process
        process.send_signal(signal.SIGKILL)
        process.wait()

    def stop(self) -> None:
        processes = [tm.process for tm in self.taskmanagers] + [tm.pool for tm in self.taskmanagers if tm.pool]
        stop_processes([p for p in [*processes, self.jobmanager] if p is not None], timeout_s=20)
        for tm in self.taskmanagers:  # the pools' workers, if any outlived their pool
            if tm.pool is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(tm.pool.pid, signal.SIGKILL)
        # Flink's scratch (io.tmp.dirs: blob caches, every job's uploaded jars) is ~1 GB per run;
        # conf/ and log/ stay for a post-mortem.
        shutil.rmtree(self.workdir / "tmp", ignore_errors=True)

    # -- REST ------------------------------------------------------------------------------------

    def rest(self, path: str, timeout_s: float = 5.0) -> Any:
        return self.api.get(path, timeout_s)

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
            if (
                overview
                and overview.get("taskmanagers", 0) >= taskmanagers
                and overview.get("slots-total", 0) >= taskmanagers * self.slots_per_taskmanager
            ):
                return overview
            time.sleep(0.5)
        raise FlinkClusterError(f"cluster not ready in {timeout_s:g}s (last overview {overview}); see {self.log_dir}")

    def jobs(self) -> list[dict[str, Any]]:
        return self.api.jobs()

    def job_metric(self, job_id: str, name: str) -> float | None:
        return self.api.metric(job_id, name)

    def checkpoints(self, job_id: str) -> dict[str, Any]:
        return self.api.checkpoints(job_id)


def write_conf(home: Path, conf_dir: Path, settings: dict[str, Any]) -> None:
    """conf/ of the distribution (log4j files, Java 17 --add-opens flags) with `settings` on top."""
    shutil.copytree(home / "conf", conf_dir, dirs_exist_ok=True)
    base = _flatten(yaml.safe_load((home / "conf" / "config.yaml").read_text()) or {})
    (conf_dir / "config.yaml").write_text(yaml.safe_dump({**base, **settings}, sort_keys=True))


def start_cluster(
    taskmanagers: int = 2,
    slots_per_taskmanager: int = 2,
    workdir: str | Path | None = None,
    settings: dict[str, Any] | None = None,
    ready_timeout_s: float = 120.0,
    worker_pools: bool = True,
) -> FlinkCluster:
    """Starts a JobManager and `taskmanagers` TaskManagers, each with its worker pool (`worker_pools`),
    and waits until all are registered. The cluster lives as long as the thread that started it: its
    processes get SIGTERM when that ends, even by SIGKILL."""
    if worker_pools and not _can_unshare_mounts():
        raise FlinkClusterError(
            "a worker pool per TaskManager on one machine needs mount namespaces (`unshare --mount`, as root): "
            "each TaskManager gets its own /etc/hosts entry for its pool. Start the cluster with "
            "worker_pools=False and run the workers elsewhere (runner.environment = \"loopback\" or \"process\")"
        )
    home = flink_home()
    workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="beam-rl-flink-"))
    cluster = FlinkCluster(
        home=home,
        workdir=workdir,
        rest_port=free_port(),
        slots_per_taskmanager=slots_per_taskmanager,
        worker_pools=worker_pools,
    )
    cluster.log_dir.mkdir(parents=True, exist_ok=True)
    write_conf(
        home,
        cluster.conf_dir,
        {
            **DEFAULT_SETTINGS,
            "rest.port": cluster.rest_port,
            "jobmanager.rpc.port": free_port(),
            "taskmanager.numberOfTaskSlots": slots_per_taskmanager,
            "io.tmp.dirs": str(workdir / "tmp"),
            **(settings or {}),
        },
    )
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
    parser.add_argument("--no-worker-pools", action="store_true", help="no worker pool beside each TaskManager")
    args = parser.parse_args()
    started = time.monotonic()
    cluster = start_cluster(args.taskmanagers, args.slots, args.workdir, worker_pools=not args.no_worker_pools)
    pools = f'; runner.worker_pool = "{cluster.worker_pool}"' if cluster.worker_pools else ""
    print(
        f"Flink cluster ready in {time.monotonic() - started:.1f}s: flink_master = \"{cluster.master}\"{pools} "
        f"(web UI http://{cluster.master}, logs {cluster.log_dir}); Ctrl-C stops it",
        flush=True,
    )
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
