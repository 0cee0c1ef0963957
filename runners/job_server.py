"""The Flink job server a rollout job is submitted through, started by beam-rl so that it lives exactly
as long as the process that submitted: the job on a Flink cluster outlives both (the server is only a
client of the cluster), while an embedded Flink (`[local]`) lives inside it."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from beam_rl.listeners import LOOPBACK, local_name, reach, warn_if_open
from beam_rl.processes import die_with_parent, free_port, stop_processes
from runners import bootstrap
from runners.flink_rest import FlinkRest

_EMBEDDED_REST = re.compile(rb"Rest endpoint listening at (\S+):(\d+)")


class JobServerError(RuntimeError):
    """The job server did not start; the message holds the end of its log."""


@dataclass
class JobServer:
    process: subprocess.Popen
    endpoint: str  # host:port of its job service
    log: Path
    log_start: int = 0  # where this server's output begins in `log` (runs append to one file)

    def stop(self) -> None:
        stop_processes([self.process], timeout_s=10)

    def embedded_flink_rest(self, timeout_s: float = 60.0) -> FlinkRest | None:
        """The REST API of the embedded Flink (`[local]`) this server starts for its job, from the port
        its log names; None if none shows within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.process.poll() is None:
            with open(self.log, "rb") as f:
                f.seek(self.log_start)
                if match := _EMBEDDED_REST.search(f.read()):
                    return FlinkRest(f"{match[1].decode()}:{match[2].decode()}")
            time.sleep(0.2)
        return None


def embedded_flink_jvm_options(heap_mb: int) -> list[str]:
    """The JVM options of a job server that runs an embedded Flink (flink-local): a bounded heap, and the
    parallel collector. G1 takes each young generation from free regions anywhere in its committed heap,
    so a long run touches more and more of it: the JVM's resident memory grew 80 to 156 MB (5 runs) from
    2,000 to 19,968 rollouts of `python -m bench.throughput.overhead --size full --runners flink-local`, where the
    parallel collector, which reuses one eden range, grew -4 to 49 MB (4 runs)."""
    return [f"-Xmx{heap_mb}m", "-XX:+UseParallelGC"]


def start_job_server(
    flink_master: str, log: Path, jvm_heap_mb: int | None = None, timeout_s: float = 120.0, host: str = LOOPBACK
) -> JobServer:
    """A Flink job server for `flink_master` ("[local]": an embedded Flink), its output in `log`, its job
    service on `host` (`runner.bind_host`)."""
    java = bootstrap.require_tool("java", "install a Java 11+ runtime (e.g. `apt-get install openjdk-17-jre-headless`)")
    port = free_port()
    artifacts = tempfile.mkdtemp(prefix="beam-rl-artifacts-")
    jvm_options = embedded_flink_jvm_options(jvm_heap_mb) if jvm_heap_mb else []
    command = [
        java,
        *jvm_options,
        "-jar",
        str(bootstrap.ensure_flink_job_server()),
        "--flink-master",
        flink_master,
        "--artifacts-dir",
        artifacts,
        "--job-host",
        host,
        "--job-port",
        str(port),
        "--artifact-port",
        "0",
        "--expansion-port",
        "0",
    ]
    if flink_master == "[local]":
        command += ["--flink-conf-dir", _embedded_flink_conf(host)]
    log.parent.mkdir(parents=True, exist_ok=True)
    log_start = log.stat().st_size if log.exists() else 0
    with open(log, "ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise JobServerError(f"the Flink job server exited with {process.returncode}:\n{_tail(log)}")
        try:
            with socket.create_connection((local_name(host), port), timeout=1):
                warn_if_open(
                    host,
                    port,
                    "the Flink job service: whoever reaches it can submit jobs, whose "
                    "workers run the code they are sent",
                    "runner.bind_host",
                )
                return JobServer(process, reach(host, port), log, log_start)
        except OSError:
            if time.monotonic() > deadline:
                stop_processes([process])
                raise JobServerError(
                    f"the Flink job server did not listen within {timeout_s:g}s:\n{_tail(log)}"
                ) from None
            time.sleep(0.2)


def _embedded_flink_conf(host: str) -> str:
    """A Flink configuration directory that puts the embedded Flink's BLOB server and REST endpoint on `host`:
    by default Flink listens on every interface."""
    conf = tempfile.mkdtemp(prefix="beam-rl-flink-conf-")
    settings = {"jobmanager.bind-host": host, "taskmanager.bind-host": host, "rest.bind-address": host}
    # JSON strings are YAML strings: "::" stays an address.
    Path(conf, "config.yaml").write_text("".join(f"{key}: {json.dumps(value)}\n" for key, value in settings.items()))
    return conf


def _tail(log: Path, chars: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"
