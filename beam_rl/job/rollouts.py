"""Starts the rollout job for a run directory on its runner (Prism, embedded Flink, a Flink cluster) and
follows it until the run is over: what `beam-rl rollouts` and the main job run."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Protocol

import apache_beam as beam
import grpc
from apache_beam.runners.runner import PipelineState

from beam_rl.config import RunConfig
from beam_rl.job.fleet_keeper import FleetKeeper, initial_fleet
from beam_rl.job.graph import build_rollout_pipeline, source_spec
from beam_rl.job.preflight import check_servers
from beam_rl.processes import worker_id
from beam_rl.rundir import RunDir
from beam_rl.rundir.lease import RunLease, read_job_record, write_job_record
from beam_rl.source import SourceSpec
from beam_rl.wiring import JobParts, job_parts
from runners.flink_rest import TERMINAL, FlinkRest
from runners.job_server import JobServer, start_job_server
from runners.options import RunnerSettings, pipeline_options
from runners.prism import release_prism

_LOG = logging.getLogger(__name__)

# Once the run is over (max_steps committed, or the input exhausted) a job whose sources end by
# themselves finishes within seconds; one kept up for checkpoints is cancelled after this long.
END_GRACE_S = 5.0
POLL_S = 0.5


_SAMPLE_BYTES_PER_TOKEN = 20  # five per-token arrays (17 bytes) and their pickling


def flink_local_heap_mb(config: RunConfig) -> int:
    """runner.flink_local_heap_mb, or 512 MB plus four steps of samples (the packer's state holds up to
    ~2 steps of samples and checkpoints copy it)."""
    if config.runner.flink_local_heap_mb is not None:
        return config.runner.flink_local_heap_mb
    step_mb = config.batch.rollouts_per_step * config.model.max_context * _SAMPLE_BYTES_PER_TOKEN / 2**20
    return 512 + math.ceil(4 * step_mb)


def runner_settings(config: RunConfig, job_endpoint: str | None = None, job_name: str | None = None) -> RunnerSettings:
    r = config.runner
    return RunnerSettings(
        name=r.name,
        flink_master=r.flink_master,
        parallelism=r.parallelism,
        checkpointing_interval_ms=r.checkpointing_interval_ms,
        state_backend=r.state_backend,
        state_backend_storage_path=r.state_backend_storage_path,
        environment=config.worker_environment,
        worker_pool=r.worker_pool,
        worker_command=r.worker_command,
        jvm_heap_mb=flink_local_heap_mb(config) if r.name == "flink-local" else None,
        job_endpoint=job_endpoint,
        job_name=job_name,
        bind_host=r.bind_host,
    )


class _JobHandle(Protocol):
    def state(self) -> str: ...

    def cancel(self) -> None: ...

    def raise_if_failed(self) -> None: ...

    def counters(self) -> dict[str, float]: ...

    def release(self) -> None: ...


@dataclass
class _BeamJob:
    """A job followed through the Beam job service that runs it."""

    result: beam.runners.runner.PipelineResult
    embedded_flink: _FlinkJob | None = None  # the same job inside flink-local's embedded Flink
    ended_as: str | None = None  # once seen: a job that ended stays so, and its Prism may be gone

    def state(self) -> str:
        if self.ended_as is None:
            state = str(self.result.state)
            if state not in _ENDED:
                return state
            self.ended_as = state
        return self.ended_as

    def cancel(self) -> None:
        if self.embedded_flink is not None:
            # The job server's cancel ends its invocation but leaves the embedded Flink job running until
            # the server stops, under this process's loopback workers (which then die with tracebacks).
            # Cancelled in Flink first, its tasks release the workers.
            self.embedded_flink.cancel_and_wait()
        self.result.cancel()

    def raise_if_failed(self) -> None:
        self.result.wait_until_finish()  # raises the pipeline's error when it failed

    def counters(self) -> dict[str, float]:
        """The pipeline's own counters (namespace/name -> value summed over the stages that count them);
        Beam's system metrics (namespace "beam") are left out."""
        totals: dict[str, float] = {}
        for result in self.result.metrics().query()["counters"]:
            if result.key.metric.namespace == "beam":
                continue
            name = f"{result.key.metric.namespace}/{result.key.metric.name}"
            value = result.committed if result.committed is not None else result.attempted
            totals[name] = totals.get(name, 0) + (value or 0)
        return totals

    def release(self) -> None:
        release_prism(self.result)


@dataclass
class _FlinkJob:
    """A job followed on its Flink cluster, through the REST API (with no Beam job server left)."""

    rest: FlinkRest
    job_id: str

    def state(self) -> str:
        return self.rest.state(self.job_id)

    def cancel(self) -> None:
        self.rest.cancel(self.job_id)

    def cancel_and_wait(self, timeout_s: float = 60.0) -> None:
        self.cancel()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if self.rest.get(f"/jobs/{self.job_id}", attempts=1)["state"] in TERMINAL:
                    return
            except OSError:
                return  # an embedded Flink shuts down, REST API and all, once its only job has ended
            time.sleep(POLL_S)

    def raise_if_failed(self) -> None:
        if self.state() == "FAILED":
            raise RuntimeError(f"Flink job {self.job_id} failed; see the cluster's logs at {self.rest.master}")

    def counters(self) -> dict[str, float]:
        return {}  # Beam's counters reach Flink's REST API only as opaque accumulators

    def release(self) -> None:
        pass  # the cluster runs the job; nothing of it lives in this process


_ENDED = {str(PipelineState.DONE), str(PipelineState.CANCELLED), str(PipelineState.FAILED), *TERMINAL}


class RolloutJob:
    """A rollout job this process follows: it holds the run directory's lease, ends the job once the run
    is over (max_steps committed, or the input exhausted), and cancels it on request."""

    def __init__(
        self,
        spec: SourceSpec,
        handle: _JobHandle,
        lease: RunLease,
        job_server: JobServer | None = None,
        fleet: FleetKeeper | None = None,
    ) -> None:
        self.spec = spec
        self._handle = handle
        self._lease = lease
        self.job_server = job_server  # the Flink job server this process started, if any
        self.fleet = fleet  # keeps fleet.json current while the job runs (a living fleet)
        self._run_dir = RunDir(spec.run_dir)

    def wait(self) -> None:
        """Returns once the job has ended: by itself, or cancelled here once the run is over."""
        over_since = None
        try:
            while (state := self._handle.state()) not in _ENDED:
                if self._run_dir.run_over(self.spec.config.run.max_steps):
                    over_since = over_since or time.monotonic()
                    if time.monotonic() - over_since > END_GRACE_S:
                        _LOG.info("the run is over: ending its job")
                        self._handle.cancel()
                        self._wait_ended()
                        return
                time.sleep(POLL_S)
            # Prism may report DONE for a job a bundle failure ended: its message stream says why.
            self._handle.raise_if_failed()
            if state not in (str(PipelineState.DONE), "FINISHED") and not self._run_dir.run_over(
                self.spec.config.run.max_steps
            ):
                raise RuntimeError(f"the rollout job ended as {state} before the run was over")
        finally:
            self._release()

    def counters(self) -> dict[str, float]:
        """Beam's counters of the job so far ({} where the runner does not say)."""
        try:
            return self._handle.counters()
        except Exception:  # a job server gone or busy: the counters are advisory
            return {}

    def cancel(self) -> None:
        try:
            if self._handle.state() not in _ENDED:
                self._handle.cancel()
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            # The job service is gone (Ctrl-C reaches Prism, in this process group, too): no job is left.
            _LOG.debug("the job service is gone; nothing to cancel: %s", err.details())
        finally:
            self._release()

    def _wait_ended(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self._handle.state() not in _ENDED and time.monotonic() < deadline:
            time.sleep(POLL_S)

    def _release(self) -> None:
        self._handle.release()
        if self.fleet is not None:
            self.fleet.stop()
        if self.job_server is not None:
            self.job_server.stop()
        self._lease.release()


def start_rollouts(
    config: RunConfig,
    server_urls: list[str],
    run_dir: str | None = None,
    with_trainer: bool = True,
    parts: JobParts | None = None,
) -> RolloutJob:
    """Submit the rollout job for a run directory this process then follows (see RolloutJob); `parts`: the
    job's, when the caller built them already."""
    parts = parts or job_parts(config)
    directory = RunDir(run_dir or config.run.dir)
    directory.check_writable()
    lease = RunLease(directory.path).acquire()  # a run another process follows: said at once
    fleet = None
    try:
        server_urls = initial_fleet(config, str(directory.path), server_urls)
        check_servers(parts, server_urls)  # a refused API key fails here, not rollout by rollout
        removed = directory.clean_uncommitted()  # what a killed run left half-written
        if removed:
            _LOG.warning("removed %d uncommitted leftovers of an earlier run: %s", len(removed), removed[:5])
        torn = directory.repair_metrics()
        if torn:
            _LOG.warning(
                "dropped the torn last line of %s (%d bytes, a crash mid-append)", directory.metrics_path, torn
            )
        directory.input_exhausted_path.unlink(missing_ok=True)  # this job decides afresh
        spec = source_spec(parts, server_urls, directory, with_trainer)
        if config.inference.discovery != "static":
            fleet = FleetKeeper(parts, str(directory.path), server_urls)  # fleet.json, before any source reads it
        job_server = None
        if config.runner.name != "direct":
            master = (
                (config.runner.flink_master or "") if config.runner.name == "flink" else "[local]"
            )  # set: RunConfig
            job_server = start_job_server(
                master,
                directory.path / "logs" / "flink-job-server.log",
                flink_local_heap_mb(config) if config.runner.name == "flink-local" else None,
                host=config.runner.bind_host,
            )
        job_name = f"beam-rl-{spec.run_id[:12]}"
        settings = runner_settings(config, job_server.endpoint if job_server else None, job_name)
        pipeline = beam.Pipeline(options=pipeline_options(settings))
        build_rollout_pipeline(pipeline, spec)
        result = pipeline.run()
    except BaseException:
        lease.release()
        raise
    if fleet is not None:
        fleet.start()
    handle: _JobHandle = _BeamJob(result)
    if config.runner.name == "flink":
        handle = _record_cluster_job(config, directory, job_name) or handle
    elif config.runner.name == "flink-local" and job_server is not None:
        handle = _BeamJob(result, _embedded_flink_job(job_server, job_name))
    return RolloutJob(spec, handle, lease, job_server, fleet)


def _find_flink_job(rest: FlinkRest, job_name: str, timeout_s: float = 60.0) -> _FlinkJob | None:
    """The job called `job_name` once Flink lists it (its REST API may answer 503 or nothing at first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if (job := rest.job_named(job_name)) is not None:
                return _FlinkJob(rest, job["jid"])
        except OSError:
            pass
        time.sleep(POLL_S)
    return None


def _embedded_flink_job(job_server: JobServer, job_name: str) -> _FlinkJob | None:
    rest = job_server.embedded_flink_rest()
    job = _find_flink_job(rest, job_name) if rest is not None else None
    if job is None:
        _LOG.warning("the embedded Flink's job %s is not found: it is ended through the job server only", job_name)
    return job


def _record_cluster_job(config: RunConfig, directory: RunDir, job_name: str) -> _FlinkJob | None:
    """Name the submitted job in the run directory's job record, and follow it on the cluster (so it
    can be followed again by another process if this one dies)."""
    job = _find_flink_job(FlinkRest(config.runner.flink_master or ""), job_name)
    if job is None:
        _LOG.warning(
            "job %s is not listed on %s: it is followed through the job server only",
            job_name,
            config.runner.flink_master,
        )
        return None
    write_job_record(
        directory.path,
        {
            "runner": "flink",
            "flink_master": config.runner.flink_master,
            "job_id": job.job_id,
            "job_name": job_name,
            "submitted_at": time.time(),
            "submitted_by": worker_id(),
        },
    )
    return job


def attach_rollouts(
    config: RunConfig, run_dir: str, with_trainer: bool = True, parts: JobParts | None = None
) -> RolloutJob | None:
    """Follow the job the run directory's job record names, if it still runs on its cluster (a submitter
    that died left it running); None when there is none to follow."""
    record = read_job_record(run_dir)
    if config.runner.name != "flink" or record is None:
        return None
    rest = FlinkRest(record["flink_master"])
    if not rest.reachable() or rest.state(record["job_id"]) in TERMINAL:
        return None
    lease = RunLease(run_dir).acquire()
    directory = RunDir(run_dir)
    spec = SourceSpec(
        config=config,
        server_urls=(),
        run_dir=str(directory.path),
        run_id=record["job_name"],
        first_step=directory.next_step(),
        with_trainer=with_trainer,
    )
    _LOG.warning("attached to job %s, still running on %s", record["job_id"], rest.master)
    fleet = FleetKeeper(parts or job_parts(config), run_dir).start() if config.inference.discovery != "static" else None
    return RolloutJob(spec, _FlinkJob(rest, record["job_id"]), lease, fleet=fleet)


def run_rollouts(
    config: RunConfig,
    server_urls: list[str],
    run_dir: str | None = None,
    with_trainer: bool = True,
    parts: JobParts | None = None,
) -> SourceSpec:
    """Runs the rollout pipeline to the end of the run."""
    job = start_rollouts(config, server_urls, run_dir, with_trainer, parts)
    job.wait()
    return job.spec
