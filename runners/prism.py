"""The runner `direct` names: Beam's `PrismRunner`, with a Prism of its own for each job, a child of this
process alone, that whoever follows the job stops once it has ended.

- Beam 2.70 shares one Prism among all the jobs of a process, started with the first job's
  `--prism_location`: a later job naming another binary (tests/runners/test_prism_patches.py builds Prism without one
  patch) would silently run on the first.
- With that singleton off, Beam starts each job's Prism through its subprocess cache, which makes every caller
  registered at the time an owner of the new process: one earlier job's Prism not stopped yet keeps every
  later one alive, and Beam stops them only when the process exits. A process that runs several jobs (a test
  session, a benchmark, a notebook) kept each finished job's Prism running, and a killed one left them all
  behind.
- Here the Prism is started by this module and dies with this process; `release_prism` stops it once its
  job has ended: when `wait_until_finish()` returns, or when `beam_rl/job/rollouts.py` has seen the end of a
  job it cancelled.
- Prism's job service, and the FnAPI endpoints of its workers on the same port, listen on `--bind_host`
  (runners/listen.py; Prism patch 0008), as does the LOOPBACK environment's worker pool.
"""

from __future__ import annotations

import functools
import logging
import subprocess
import threading
from typing import IO

import grpc
from apache_beam.portability.api import beam_job_api_pb2_grpc
from apache_beam.runners.portability import job_server, prism_runner
from apache_beam.runners.runner import PipelineResult, PipelineState

from beam_rl.listeners import reach, warn_if_open
from beam_rl.processes import die_with_parent, stop_processes
from runners.listen import LoopbackOnHost, bind_host

_LOG = logging.getLogger(__name__)
_SERVER = "_beam_rl_job_server"
# Prism's own log lines, as Beam forwards them: with its filter, which reads their JSON, into Beam's log.
_PRISM_LOG = logging.getLogger(prism_runner.__name__)
_PRISM_LOG.addFilter(prism_runner.PrismRunnerLogFilter())


class OwnPrism(prism_runner.PrismJobServer):
    """One Prism process, started and stopped by this object only."""

    _process: subprocess.Popen | None = None

    def __init__(self, options) -> None:  # type: ignore[no-untyped-def]
        super().__init__(options)
        self._host = bind_host(options)

    def subprocess_cmd_and_endpoint(self) -> tuple[list, str]:
        command, endpoint = super().subprocess_cmd_and_endpoint()
        self._port = int(endpoint.rsplit(":", 1)[1])
        return [*command, f"--job_host={self._host}"], reach(self._host, self._port)

    def start(self) -> beam_job_api_pb2_grpc.JobServiceStub:
        if self._process is None:
            command, endpoint = self.subprocess_cmd_and_endpoint()
            self._process = subprocess.Popen(
                [str(part) for part in command],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )
            threading.Thread(target=_forward, args=(self._process.stdout,), daemon=True, name="prism-log").start()
            self._channel = grpc.insecure_channel(
                endpoint, options=[("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
            )
            ready = grpc.channel_ready_future(self._channel)
            while True:
                if (code := self._process.poll()) is not None:
                    self.stop()
                    raise RuntimeError(f"Prism ({command[0]}) failed to start up with error {code}")
                try:
                    ready.result(timeout=0.2)
                    break
                except grpc.FutureTimeoutError:
                    continue
            self._stub = beam_job_api_pb2_grpc.JobServiceStub(self._channel)
            warn_if_open(
                self._host,
                self._port,
                "Prism's job service and its workers' FnAPI: whoever reaches it "
                "can list and submit jobs, and have workers run their code",
                "runner.bind_host",
            )
        return self._stub

    def stop(self) -> None:
        if self._process is not None:
            self._channel.close()
            stop_processes([self._process])
            self._process = None


def _forward(stream: IO[bytes]) -> None:
    """Prism's output, a line a record, as Beam's own subprocess servers log it."""
    for line in iter(stream.readline, b""):
        log_stdout(line.decode(errors="backslashreplace").rstrip())


def log_stdout(line: str) -> None:
    # Named as Beam's forwarder is: its filter turns only records of `log_stdout` into Prism's levels.
    _PRISM_LOG.info(line)


class PrismPerJob(LoopbackOnHost, prism_runner.PrismRunner):
    def default_job_server(self, options):  # type: ignore[no-untyped-def]
        # Stopped at exit too, as Beam's own, should nobody stop it earlier.
        self._job_server = job_server.StopOnExitJobServer(OwnPrism(options))
        return self._job_server

    def run_portable_pipeline(self, pipeline, options):  # type: ignore[no-untyped-def]
        self._job_server = None  # type: ignore[assignment]  # a --job_endpoint of the caller's: not this runner's to stop
        result = super().run_portable_pipeline(pipeline, options)
        setattr(result, _SERVER, self._job_server)
        # What Beam runs once wait_until_finish() has seen the job end (and on cancel(), when it may not have).
        # (PortableRunner's result has them; mypy sees the base class.)
        callbacks = result._cleanup_callbacks  # type: ignore[attr-defined]
        result._cleanup_callbacks = (*callbacks, functools.partial(release_prism, result))  # type: ignore[attr-defined]
        return result


def release_prism(result: PipelineResult) -> None:
    """Once the job of `result` has ended: reads its metrics (Beam keeps them for later calls), then stops the
    Prism it ran on. A job not known to have ended keeps its Prism, until the process exits."""
    server = getattr(result, _SERVER, None)
    if server is None:
        return
    try:
        if not PipelineState.is_terminal(result.state):
            return
        result.metrics()
    except grpc.RpcError as err:
        _LOG.debug("the job's Prism no longer answers: %s", err.details())
    server.stop()
    setattr(result, _SERVER, None)
