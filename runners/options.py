"""Pipeline options for a runner name, streaming on, with no path to a silent batch fallback.

`direct` names Beam's `PrismRunner` (as `runners.prism.PrismPerJob`) rather than `DirectRunner`: the latter
quietly switches to its batch-style runners when it meets a feature it thinks Prism lacks (docs/design.md,
"Runners").
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from apache_beam.options.pipeline_options import PipelineOptions

from beam_rl.listeners import LOOPBACK
from runners import bootstrap
from runners.harness import quiet_hangups
from runners.job_server import embedded_flink_jvm_options
from runners.listen import FlinkOnHost
from runners.prism import PrismPerJob

RUNNERS = ("direct", "flink-local", "flink")
# Beam's portable runner waits on the job's state stream with a deadline of --job_server_timeout
# (default 60 s), so on Prism any job running longer than that failed with DEADLINE_EXCEEDED. RL
# runs last days; the other calls it bounds answer at once.
JOB_SERVER_TIMEOUT_S = 365 * 24 * 3600


@dataclass(frozen=True)
class RunnerSettings:
    name: str = "direct"
    flink_master: str | None = None  # host:port of a Flink cluster's REST endpoint (runner "flink")
    parallelism: int | None = None
    checkpointing_interval_ms: int | None = None
    state_backend: str | None = None  # "hashmap" | "rocksdb" (Flink)
    state_backend_storage_path: str | None = None  # where checkpoints go, e.g. file:///shared/ckpt
    # Where the Python workers run: "loopback" (in this process), "external" (worker pools at
    # `worker_pool`, one beside each TaskManager) or "process" (the runner starts `worker_command`: each
    # TaskManager, or Prism).
    environment: str = "loopback"
    worker_pool: str = "localhost:50000"
    worker_command: str | None = None  # process: default, this machine's runners.workers boot program
    job_endpoint: str | None = None  # Flink: a running job server (runners.job_server); None: Beam starts one
    job_name: str | None = None  # the name the job gets on the runner (Flink lists jobs by it)
    prism_location: str | None = None  # direct: a Prism binary (default: ours, runners.bootstrap)
    jvm_heap_mb: int | None = None  # flink-local: the embedded Flink's JVM heap (-Xmx); None = Java's default
    # Where the ports the job opens here listen (Prism's job service, the LOOPBACK worker pool); beyond
    # loopback only on purpose (runners/listen.py).
    bind_host: str = LOOPBACK


def pipeline_options(settings: RunnerSettings | str, *extra_args: str) -> PipelineOptions:
    """The PipelineOptions that run a streaming pipeline on the named runner."""
    if isinstance(settings, str):
        settings = RunnerSettings(name=settings)
    if settings.name not in RUNNERS:
        raise ValueError(f"unknown runner {settings.name!r}; choose one of {', '.join(RUNNERS)}")
    args = [
        "--streaming",
        *_environment_args(settings),
        f"--job_server_timeout={JOB_SERVER_TIMEOUT_S}",
        f"--bind_host={settings.bind_host}",
        # Beam otherwise stages `python -m pip freeze` of this environment with every job: a subprocess
        # per submission, and "No module named pip" on stderr where the venv has no pip (uv's).
        "--experiments=disable_logging_submission_environment",
        *extra_args,
    ]
    if settings.job_name:
        args.append(f"--job_name={settings.job_name}")
    if settings.name == "direct":
        # A Prism of its own for each job, stopped once the job has ended (runners/prism.py).
        args += [
            f"--runner={PrismPerJob.__module__}.{PrismPerJob.__name__}",
            f"--prism_location={settings.prism_location or bootstrap.ensure_prism()}",
        ]
    else:
        args += _flink_args(settings)
    return PipelineOptions(args)


def _environment_args(settings: RunnerSettings) -> list[str]:
    if settings.environment == "loopback":
        quiet_hangups()  # the SDK harness runs in this process
        return ["--environment_type=LOOPBACK"]
    if settings.environment == "external":
        return ["--environment_type=EXTERNAL", f"--environment_config={settings.worker_pool}"]
    if settings.environment == "process":
        from runners.workers import boot_command

        command = settings.worker_command or str(boot_command())
        return ["--environment_type=PROCESS", f"--environment_config={json.dumps({'command': command})}"]
    raise ValueError(f"unknown worker environment {settings.environment!r}; choose loopback, external or process")


def _flink_args(settings: RunnerSettings) -> list[str]:
    if settings.name == "flink":
        if not settings.flink_master:
            raise ValueError("runner 'flink' needs flink_master (host:port of the cluster's REST endpoint)")
        master = settings.flink_master
    else:
        master = "[local]"
    args = [
        f"--runner={FlinkOnHost.__module__}.{FlinkOnHost.__name__}",
        f"--flink_master={master}",
        f"--flink_version={bootstrap.FLINK_VERSION}",
    ]
    if settings.job_endpoint:
        args.append(f"--job_endpoint={settings.job_endpoint}")
    else:
        args.append(f"--flink_job_server_jar={bootstrap.ensure_flink_job_server()}")
        if settings.name == "flink-local" and settings.jvm_heap_mb:
            jvm_options = embedded_flink_jvm_options(settings.jvm_heap_mb)
            args += [f"--job_server_jvm_properties={option}" for option in jvm_options]
    if settings.parallelism:
        args.append(f"--parallelism={settings.parallelism}")
    if settings.checkpointing_interval_ms:
        args += [
            f"--checkpointing_interval={settings.checkpointing_interval_ms}",
            # Beam 2.62 otherwise finishes an open bundle inside snapshotState() and parks its
            # output in operator state until that operator starts another bundle or sees another
            # watermark. The Impulse stage gets neither again, so the source's only element never
            # reached the dispatch SDF (0 groups admitted). Finishing before the barrier emits it.
            "--finish_bundle_before_checkpointing",
            # No --shutdown_sources_after_idle_ms: with checkpointing Beam then keeps the Impulse
            # source up for good. Once a source task ends, the stages after it drain inside finish()
            # and Flink declines every checkpoint from then on ("task is closing"). So the job runs,
            # and checkpoints, until the orchestrator ends it once the run is over
            # (beam_rl.job.rollouts.RolloutJob).
        ]
    if settings.state_backend:
        args.append(f"--state_backend={settings.state_backend}")
    if settings.state_backend_storage_path:
        args.append(f"--state_backend_storage_path={settings.state_backend_storage_path}")
    return args
