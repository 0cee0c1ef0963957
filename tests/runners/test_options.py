"""Runner options and builds that decide whether a long run survives and what the runner costs:
Beam's job-server deadline, and Prism's CPU while a job runs."""

from __future__ import annotations

import os
import threading
import time

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PortableOptions

from beam_rl.config import config_from_dict
from bench.common import procs
from bench.throughput import overhead
from runners.options import JOB_SERVER_TIMEOUT_S, RunnerSettings, pipeline_options
from beam_rl.job.rollouts import runner_settings

JOB_S = 4.0


def _sleep(_):
    time.sleep(JOB_S)
    yield 1


def _run_a_job_of_a_few_seconds(*extra_args: str) -> None:
    pipeline = beam.Pipeline(options=pipeline_options("direct", *extra_args))
    _ = pipeline | beam.Impulse() | beam.FlatMap(_sleep)
    pipeline.run().wait_until_finish()


def test_a_job_outliving_the_job_server_timeout_fails_so_ours_is_days():
    # The mechanism: on Prism the wait for the job's end is bounded by --job_server_timeout (Beam's
    # default 60 s), so a job longer than it dies with DEADLINE_EXCEEDED...
    with pytest.raises(Exception, match="DEADLINE_EXCEEDED|Deadline Exceeded"):
        _run_a_job_of_a_few_seconds(f"--job_server_timeout={int(JOB_S / 2)}")
    # ...and with the options we pass, the same job finishes; they allow a run of days.
    _run_a_job_of_a_few_seconds()
    assert pipeline_options("direct").view_as(PortableOptions).job_server_timeout == JOB_SERVER_TIMEOUT_S
    assert JOB_SERVER_TIMEOUT_S >= 30 * 24 * 3600


def test_prism_does_not_spin_while_a_rollout_run_runs():
    """Stock Prism 2.62 (and 2.70, 2.75) keeps a core busy for as long as a job runs: a bundle's
    progress loop selects on a data channel that is closed once its outputs are in, and the
    scheduler reschedules a stateful stage while its key's bundle is still in progress. With
    runners/prism_patches/ Prism's CPU is a small share of the run's."""
    size = {"rollouts_per_step": 256, "group_size": 8, "pipeline_rollouts": 4096, "tokens": 64,
            "pipeline_permits": 256, "pipeline_servers": 2, "rss_warm_rollouts": 1024}
    # Beam keeps the job server (Prism) of an earlier job in this process: count CPU from now on.
    start_cpu = {pid: procs.cpu_s([pid]) for pid in procs.descendants_named("prism")}
    latest: dict[int, float] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for pid in procs.descendants_named("prism"):
                latest[pid] = procs.cpu_s([pid])
            done.wait(0.2)

    watcher = threading.Thread(target=sample, daemon=True)
    own_cpu = procs.cpu_s([os.getpid()])
    watcher.start()
    run = overhead.pipeline_run(size, "direct")
    own_cpu = procs.cpu_s([os.getpid()]) - own_cpu
    done.set()
    watcher.join()
    assert run["rollouts"] == 4096
    prism_cpu = sum(cpu - start_cpu.get(pid, 0.0) for pid, cpu in latest.items())
    # Measured side by side, Prism's CPU against this process's (the pipeline's Python side): 0.016
    # patched, 0.17 stock.
    assert 0 < prism_cpu < 0.08 * own_cpu, f"Prism used {prism_cpu:.2f} s of CPU, this process {own_cpu:.2f} s"


def test_flink_local_runs_with_a_bounded_heap_sized_to_the_steps():
    """The default leaves room for four steps of samples; the parallel collector keeps the JVM's resident
    memory from creeping through a run (runners/job_server.py)."""
    small = config_from_dict({"envs": [{"name": "reverse_text"}], "runner": {"name": "flink-local"},
                              "batch": {"rollouts_per_step": 64}, "model": {"max_context": 512}})
    large = config_from_dict({"envs": [{"name": "reverse_text"}], "runner": {"name": "flink-local"},
                              "batch": {"rollouts_per_step": 4096, "seq_len": 8192}, "model": {"max_context": 8192}})
    assert runner_settings(small).jvm_heap_mb == 515
    assert runner_settings(large).jvm_heap_mb == 512 + 4 * 4096 * 8192 * 20 // 2**20  # 3,072 MB
    chosen = config_from_dict({"envs": [{"name": "reverse_text"}],
                               "runner": {"name": "flink-local", "flink_local_heap_mb": 2048}})
    options = pipeline_options(runner_settings(chosen)).get_all_options()
    assert options["job_server_jvm_properties"] == ["-Xmx2048m", "-XX:+UseParallelGC"]
    # A cluster's heap is the cluster's own configuration.
    cluster = RunnerSettings(name="flink", flink_master="localhost:8081", jvm_heap_mb=2048)
    assert pipeline_options(cluster).get_all_options()["job_server_jvm_properties"] == []
