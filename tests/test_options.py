"""Runner options that decide whether a long run survives: Beam's job-server deadline."""

from __future__ import annotations

import time

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PortableOptions

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
