"""The streaming proof on real runners: Prism (direct) and embedded Flink (flink-local)."""

from __future__ import annotations

import importlib
import stat
import time
from pathlib import Path
from typing import NamedTuple

import apache_beam as beam
import pytest
from apache_beam.runners.portability.portable_runner import PipelineResult
from apache_beam.runners.portability.prism_runner import PrismRunner
from apache_beam.runners.runner import PipelineState

from runners import bootstrap
from runners.options import RunnerSettings, pipeline_options
from bench.throughput.streaming_demo import build_streaming_demo, read_batch_files

COUNT, INTERVAL_S, GROUP_SIZE, GROUPS_PER_BATCH = 48, 0.1, 4, 3
# A bound on waiting for the first batch file, so that a runner that does not stream fails instead of hanging.
FIRST_BATCH_TIMEOUT_S = 120.0


class DemoRun(NamedTuple):
    runner: str
    out: Path
    result: PipelineResult
    state: str
    written_while_held: list[str]  # the batch files on disk while the source still held its last tick back
    released_at: float  # when the test let the last tick go (Unix time)


@pytest.fixture(scope="module", params=["direct", "flink-local"])
def demo_run(request, tmp_path_factory):
    """The demo on the runner, its source holding its last tick back until a batch file is on disk: a runner
    that streams writes one meanwhile, one that waited for its source to end would write none."""
    out = tmp_path_factory.mktemp(f"demo-{request.param}")
    release = out / "release-last-tick"
    pipeline = beam.Pipeline(options=pipeline_options(request.param))
    build_streaming_demo(pipeline, str(out), count=COUNT, interval_s=INTERVAL_S, group_size=GROUP_SIZE,
                         groups_per_batch=GROUPS_PER_BATCH, probe_timers=True, last_waits_for=str(release))
    result = pipeline.run()
    try:
        written = _batch_files_once_there_are_any(out, result)
    finally:
        released_at = time.time()
        release.touch()  # whatever came of the wait: the job may end now
    state = result.wait_until_finish(duration=240_000)  # ms; the pipeline must end by itself
    return DemoRun(request.param, out, result, state, written, released_at)


def _batch_files_once_there_are_any(out: Path, result: PipelineResult) -> list[str]:
    """The batch files in `out` once one is there; none if the job ends or the wait times out first."""
    deadline = time.monotonic() + FIRST_BATCH_TIMEOUT_S
    while time.monotonic() < deadline and not PipelineState.is_terminal(result.state):
        files = sorted(f.name for f in out.glob("batch_*.arrow"))  # written whole (write_atomic)
        if files:
            return files
        time.sleep(0.05)
    return []


def test_runs_on_the_named_portable_runner_and_ends_by_itself(demo_run):
    assert isinstance(demo_run.result, PipelineResult)  # a portable job, not Beam's in-process batch runner
    assert demo_run.state == PipelineState.DONE


def test_first_batch_is_on_disk_before_the_source_emits_its_last_element(demo_run):
    # A batch file was there while the last tick was held back, and the last tick waited for its release.
    assert demo_run.written_while_held, f"{demo_run.runner}: no batch file while the last tick was held back"
    files = read_batch_files(demo_run.out)
    assert set(demo_run.written_while_held) <= {f.name for f, _ in files}
    last_emitted = max(max(t.column("emitted_at").to_pylist()) for _, t in files)
    assert last_emitted >= demo_run.released_at, (last_emitted, demo_run.released_at)


def test_every_element_in_exactly_one_complete_file(demo_run):
    files = read_batch_files(demo_run.out)
    elements = [e for _, t in files for e in t.column("element").to_pylist()]
    assert sorted(elements) == list(range(COUNT))  # none lost, none duplicated across files
    full = GROUP_SIZE * GROUPS_PER_BATCH
    sizes = sorted(t.num_rows for _, t in files)
    assert all(size % GROUP_SIZE == 0 for size in sizes)  # files hold whole groups only
    assert sizes.count(full) >= len(sizes) - 1  # only the final flush may be partial
    assert not list(demo_run.out.glob(".*.tmp"))  # no half-written leftovers


def test_timer_kinds_fire_but_nothing_waits_on_them(demo_run):
    log = (demo_run.out / "timers.log").read_text().split()
    # Both kinds fire on both runners (how early or late differs: see docs/runners.md); the
    # batches above were all cut by count, so liveness never depended on either.
    assert "processing_time_timer_fired" in log and "event_time_timer_fired" in log, (demo_run.runner, log)


def test_unknown_runner_is_refused():
    with pytest.raises(ValueError, match="unknown runner 'dataflow'"):
        pipeline_options("dataflow")


def test_flink_cluster_needs_a_master():
    with pytest.raises(ValueError, match="flink_master"):
        pipeline_options(RunnerSettings(name="flink"))


def test_direct_names_prism_never_the_falling_back_direct_runner():
    options = pipeline_options("direct").get_all_options()
    module, name = options["runner"].rsplit(".", 1)
    assert issubclass(getattr(importlib.import_module(module), name), PrismRunner)
    assert options["streaming"] is True
    assert Path(options["prism_location"]).is_file()


def test_broken_prism_fails_loudly_instead_of_falling_back(tmp_path, monkeypatch):
    monkeypatch.setenv("BEAM_RL_CACHE", str(tmp_path))
    fake = bootstrap.prism_path()
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\necho 'prism exploded' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    pipeline = beam.Pipeline(options=pipeline_options("direct"))
    _ = pipeline | beam.Create([1, 2, 3]) | beam.Map(lambda x: x)
    with pytest.raises(RuntimeError, match="failed to start up with error 3"):
        pipeline.run().wait_until_finish()


def test_missing_go_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("BEAM_RL_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))  # no go here
    with pytest.raises(bootstrap.BootstrapError, match="`go` was not found on PATH; install Go"):
        bootstrap.ensure_prism()


def test_prism_is_never_built_without_its_patches(tmp_path, monkeypatch):
    monkeypatch.setenv("BEAM_RL_CACHE", str(tmp_path))
    monkeypatch.setattr(bootstrap, "PRISM_PATCHES", [])  # e.g. an install that left the patch files out
    with pytest.raises(bootstrap.BootstrapError, match="no Prism patches"):
        bootstrap.ensure_prism()


def test_missing_java_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("BEAM_RL_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(bootstrap.BootstrapError, match="`java` was not found on PATH"):
        bootstrap.ensure_flink_job_server()


def test_cached_bootstrap_does_not_rebuild():
    prism, jar = bootstrap.ensure_prism(), bootstrap.ensure_flink_job_server()
    before = (prism.stat().st_mtime_ns, jar.stat().st_mtime_ns)
    assert (bootstrap.ensure_prism(), bootstrap.ensure_flink_job_server()) == (prism, jar)
    assert (prism.stat().st_mtime_ns, jar.stat().st_mtime_ns) == before
