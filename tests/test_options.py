"""Runner options that decide whether a long run survives and what the runner costs: Beam's
job-server deadline, and Prism's CPU priority."""

from __future__ import annotations

import os
import threading
import time

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PortableOptions

from runners.bootstrap import PRISM_NICENESS
from runners.options import JOB_SERVER_TIMEOUT_S, pipeline_options

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


def _prism_children() -> list[int]:
    children = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat.rsplit(")", 1)[1].split()
        if name == "prism" and int(fields[1]) == os.getpid():
            children.append(int(pid))
    return children


def test_prism_runs_at_a_lower_cpu_priority():
    # Prism busy-loops while a streaming job runs; niced, that loop only takes idle CPU.
    before = set(_prism_children())
    job = threading.Thread(target=_run_a_job_of_a_few_seconds)
    job.start()
    deadline, started = time.monotonic() + 30, []
    while not started and time.monotonic() < deadline:
        started = [p for p in _prism_children() if p not in before]
        time.sleep(0.1)
    job.join()
    assert started, "no Prism process was started by the job"
    assert os.getpriority(os.PRIO_PROCESS, started[0]) == os.getpriority(os.PRIO_PROCESS, 0) + PRISM_NICENESS
