"""Python workers that run beside a cluster's TaskManagers instead of in the submitting process.

- `boot_main` is a worker boot program with the interface of Beam's container boot binary (flags
  --id, --provision_endpoint, --control_endpoint, ...): it asks the runner's provision service for the
  pipeline options, sends the worker's stdout and stderr to a log file instead of a pipe nobody reads
  (a chatty worker would block on it), and runs Beam's SDK harness (`sdk_worker_main`), which takes its
  state cache size and logging from those options. Beam's own Go boot binary also installs staged
  packages into a fresh virtualenv per worker; beam-rl workers use the environment they start in.
- `process` environments name it as the command a runner starts a worker with (each TaskManager, or
  Prism); `external` ones point at a worker pool (`pool_main`: Beam's worker pool, told to start
  workers with this boot program), one beside each TaskManager.
- `start_pool` is Beam's worker pool servicer on the address given, loopback by default: the pools above,
  and the one a LOOPBACK environment starts in the submitting process (runners/listen.py). Beam's own
  listens on every interface.

    python -m runners.workers pool --port 50000      # a worker pool, until SIGTERM
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

from beam_rl.cache import cache_root
from beam_rl.listeners import LOOPBACK, host_port, reach, warn_if_open

LOG_DIR_ENV = "BEAM_RL_WORKER_LOG_DIR"


def boot_command() -> Path:
    """An executable that runs `boot_main` with this interpreter (a runner starts workers with a path,
    not a Python module), written once per interpreter into the cache."""
    digest = hashlib.sha256(sys.executable.encode()).hexdigest()[:12]
    script = cache_root() / "workers" / f"boot-{digest}.sh"
    body = f"#!/bin/sh\nexec {sys.executable} -m runners.workers boot \"$@\"\n"
    if not script.is_file() or script.read_text() != body:
        script.parent.mkdir(parents=True, exist_ok=True)
        tmp = script.with_suffix(".tmp")
        tmp.write_text(body)
        tmp.chmod(tmp.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        os.replace(tmp, script)
    return script


def _descriptor(url: str) -> str:
    return f'url: "{url}"'


def _provision_info(provision_endpoint: str, worker_id: str) -> Any:
    import grpc
    from apache_beam.portability.api import beam_provision_api_pb2, beam_provision_api_pb2_grpc

    with grpc.insecure_channel(provision_endpoint) as channel:
        stub = beam_provision_api_pb2_grpc.ProvisionServiceStub(channel)
        return stub.GetProvisionInfo(
            beam_provision_api_pb2.GetProvisionInfoRequest(), metadata=[("worker_id", worker_id)], timeout=60
        ).info


def boot_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="runners.workers boot")
    parser.add_argument("--id", required=True)
    parser.add_argument("--provision_endpoint", required=True)
    # A worker pool passes these too; a TaskManager starting a `process` worker leaves them to the
    # provision service, as Beam's boot binary does.
    for flag in ("logging_endpoint", "artifact_endpoint", "control_endpoint", "semi_persist_dir"):
        parser.add_argument(f"--{flag}")
    args, _ = parser.parse_known_args(argv)
    log_dir = Path(os.environ.get(LOG_DIR_ENV) or Path(tempfile.gettempdir()) / "beam-rl-workers")
    log_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / f"worker-{args.id}-{os.getpid()}.log", "ab", buffering=0)  # noqa: SIM115 (kept open)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    from google.protobuf import json_format

    info = _provision_info(args.provision_endpoint, args.id)
    os.environ.update(
        {
            "WORKER_ID": args.id,
            "CONTROL_API_SERVICE_DESCRIPTOR": _descriptor(args.control_endpoint or info.control_endpoint.url),
            "LOGGING_API_SERVICE_DESCRIPTOR": _descriptor(args.logging_endpoint or info.logging_endpoint.url),
            "PIPELINE_OPTIONS": json.dumps(json_format.MessageToDict(info.pipeline_options)),
        }
    )
    if args.semi_persist_dir:
        os.environ["SEMI_PERSISTENT_DIRECTORY"] = args.semi_persist_dir
    from apache_beam.runners.worker import sdk_worker_main

    from runners.harness import quiet_hangups

    quiet_hangups()
    sdk_worker_main.main(sys.argv)


def start_pool(
    host: str,
    port: int = 0,
    *,
    use_process: bool = True,
    container_executable: str | None = None,
    state_cache_size: int = 0,
    data_buffer_time_limit_ms: int = 0,
    setting: str = "runner.bind_host",
) -> tuple[str, Any, Any]:
    """Beam's worker pool servicer on `host:port` (port 0: a free one); returns the `host:port` a process on
    this machine reaches it at, its gRPC server (started) and the servicer. `setting` is what chose `host`: the
    warning when it is beyond loopback names it. Beam's own (`BeamFnExternalWorkerPoolServicer.start`, which
    `worker_pool_main` and every LOOPBACK environment use) listens on every interface, and a pool starts
    workers that run whatever pickled code they are sent."""
    import atexit

    import grpc
    from apache_beam.portability.api import beam_fn_api_pb2_grpc
    from apache_beam.runners.worker.worker_pool_main import BeamFnExternalWorkerPoolServicer, kill_process_gracefully
    from apache_beam.utils import thread_pool_executor

    pool = BeamFnExternalWorkerPoolServicer(
        use_process=use_process,
        container_executable=container_executable,
        state_cache_size=state_cache_size,
        data_buffer_time_limit_ms=data_buffer_time_limit_ms,
    )
    # Beam's options: no limit on keepalive pings from the runner.
    server = grpc.server(
        thread_pool_executor.shared_unbounded_instance(),
        options=[("grpc.http2.max_pings_without_data", 0), ("grpc.http2.max_ping_strikes", 0)],
    )
    beam_fn_api_pb2_grpc.add_BeamFnExternalWorkerPoolServicer_to_server(pool, server)
    bound = server.add_insecure_port(host_port(host, port))
    server.start()
    warn_if_open(
        host, bound, "a Beam worker pool: it starts SDK workers that run the pickled code a runner sends", setting
    )

    @atexit.register
    def kill_workers() -> None:  # as Beam's: worker processes are children of the pool
        for worker in list(pool._worker_processes.values()):
            kill_process_gracefully(worker)

    return reach(host, bound), server, pool


def pool_main(argv: list[str]) -> None:
    """A worker pool on `--host:--port` (loopback unless told otherwise), starting each worker with
    `boot_command()` (so its output goes to a file). One pool per TaskManager on one machine needs each on
    its own loopback address."""
    parser = argparse.ArgumentParser(prog="runners.workers pool")
    parser.add_argument("--host", default=LOOPBACK, help="the address TaskManagers reach it on (default: loopback)")
    parser.add_argument("--port", type=int, default=50000)
    args = parser.parse_args(argv)
    import signal

    address, server, pool = start_pool(
        args.host, args.port, container_executable=str(boot_command()), setting="runners.workers pool --host"
    )

    def stop(*_: object) -> None:  # workers are children of the pool: they go with it
        for worker in list(pool._worker_processes.values()):
            worker.kill()
        server.stop(grace=None)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"READY {address}", flush=True)
    server.wait_for_termination()


def main() -> None:
    command, argv = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("", [])
    if command == "boot":
        boot_main(argv)
    elif command == "pool":
        pool_main(argv)
    else:
        sys.exit("usage: python -m runners.workers {boot|pool} ...")


if __name__ == "__main__":
    main()
