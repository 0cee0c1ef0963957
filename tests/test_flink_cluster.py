"""A standalone Flink 1.19 cluster (JobManager + two TaskManagers, separate JVMs, loopback) from the
PyPI apache-flink wheel, and the rollout pipeline submitted to it with runner "flink".

The cluster itself (start-up, a killed TaskManager noticed, a new one joining) and the rollout
pipeline at parallelism 2 with and without checkpointing work (with checkpointing only since
runners/options.py passes --finish_bundle_before_checkpointing: Beam 2.62 otherwise parks the
Impulse stage's only output in operator state and the dispatch SDF never starts). A TaskManager
killed mid-run is recovered exactly once, whether Flink restores a checkpoint or restarts with none:
this LOOPBACK process keeps its RolloutSource and packer mirror across the restart, and both rebuild
from the restored state and the run directory (docs/flink-cluster.md).
"""

from __future__ import annotations

import collections
import shutil
import time

import pytest

from beam_rl.config import config_from_dict
from beam_rl.inference.server import EmbeddedServer, FaultConfig
from beam_rl.rundir import RunDir
from beam_rl.tinymodel import tiny_model_dir
from runners.flink_cluster import start_cluster
from runners.pipeline import start_rollouts

PROMPTS, GROUP_SIZE, ROLLOUTS_PER_STEP = 32, 8, 64
FIRST_STEP_TIMEOUT_S = 60.0  # Prism commits step 1 of this run within seconds; Flink within ~20 s
RUN_TIMEOUT_S = 240.0

pytestmark = pytest.mark.skipif(shutil.which("java") is None, reason="needs a Java 11+ runtime for Flink")


@pytest.fixture(scope="module")
def cluster():
    started = time.monotonic()
    cluster = start_cluster(taskmanagers=2, slots_per_taskmanager=2)
    print(f"Flink cluster ready in {time.monotonic() - started:.1f}s at {cluster.master}")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def servers():
    started = [EmbeddedServer(model_dir=tiny_model_dir(), served_model_name="tiny", max_num_seqs=64)
               for _ in range(2)]
    yield [s.start() for s in started]
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def slow_servers():
    """Servers that answer each request after 1 s: with one group in flight at a time the 32 groups
    take over 30 s, so a kill after step 1 lands mid-run (with the fast servers every step is often
    committed before the kill, leaving nothing to recover)."""
    started = [EmbeddedServer(model_dir=tiny_model_dir(), served_model_name="tiny", max_num_seqs=64,
                               faults=FaultConfig(latency_s=1.0))
               for _ in range(2)]
    yield [s.start() for s in started]
    for s in started:
        s.stop()


def _config(run_dir, master: str, parallelism: int = 2, checkpointing_interval_ms: int | None = 1000,
            max_inflight: int = 64):
    return config_from_dict({
        "run": {"dir": str(run_dir), "max_steps": 10},
        "envs": [{"name": "reverse_text", "group_size": GROUP_SIZE, "limit": PROMPTS}],
        "batch": {"rollouts_per_step": ROLLOUTS_PER_STEP},
        "inference": {"max_tokens": 8, "max_inflight": max_inflight},
        "runner": {"name": "flink", "flink_master": master, "parallelism": parallelism,
                   "checkpointing_interval_ms": checkpointing_interval_ms},
    })


def _wait(predicate, timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s:g}s")
        time.sleep(0.5)
    return time.monotonic() - started


def _assert_exactly_once(run_dir: RunDir) -> None:
    steps = run_dir.committed_steps()
    assert steps == list(range(1, len(steps) + 1))
    ids = [rid for s in steps for rid in run_dir.read_window(s).column("rollout_id").to_pylist()]
    assert len(ids) == PROMPTS * GROUP_SIZE and len(set(ids)) == len(ids)  # none lost, none twice
    groups = collections.Counter(rid.rsplit("/", 1)[0] for rid in ids)
    assert len(groups) == PROMPTS and set(groups.values()) == {GROUP_SIZE}


def test_the_cluster_is_a_jobmanager_and_two_taskmanager_processes(cluster):
    overview = cluster.overview()
    assert overview["flink-version"].startswith("1.19")
    assert overview["taskmanagers"] == 2 and overview["slots-total"] == 4
    pids = {cluster.jobmanager.pid, *(p.pid for p in cluster.taskmanagers)}
    assert len(pids) == 3 and all(p.poll() is None for p in [cluster.jobmanager, *cluster.taskmanagers])
    names = {tm["id"] for tm in cluster.rest("/taskmanagers")["taskmanagers"]}
    assert names == {"taskmanager-0", "taskmanager-1"}


def test_a_killed_taskmanager_is_noticed_and_a_new_one_joins(tmp_path):
    # Its own cluster: the module's one stays whole for the pipeline tests.
    cluster = start_cluster(taskmanagers=2, slots_per_taskmanager=1, workdir=tmp_path)
    try:
        cluster.kill_taskmanager(0)
        noticed = _wait(lambda: cluster.overview()["taskmanagers"] == 1, 30, "the JobManager drops the dead TaskManager")
        cluster.add_taskmanager()
        joined = _wait(lambda: cluster.overview()["slots-total"] == 2, 60, "a new TaskManager registers")
        print(f"dead TaskManager dropped after {noticed:.1f}s; replacement registered after {joined:.1f}s")
    finally:
        cluster.stop()


def _job_ids(cluster) -> set[str]:
    return {j["jid"] for j in cluster.jobs()}


def _new_job(cluster, before: set[str]) -> str:
    """The id of the job submitted since `before` (the module's cluster also lists the earlier
    tests' jobs, in no fixed order)."""
    _wait(lambda: _job_ids(cluster) - before, 30, "the job is listed")
    (job_id,) = _job_ids(cluster) - before
    return job_id


def _wait_for_the_end(cluster, job_id: str) -> str:
    ended = ("FINISHED", "FAILED", "CANCELED")
    _wait(lambda: cluster.rest(f"/jobs/{job_id}")["state"] in ended, RUN_TIMEOUT_S, "job ends")
    return cluster.rest(f"/jobs/{job_id}")["state"]


def _run_to_the_end(cluster, servers, run_dir: RunDir, config) -> None:
    before = _job_ids(cluster)
    job = start_rollouts(config, servers, str(run_dir.path), with_trainer=False)
    try:
        _wait(lambda: run_dir.committed_steps(), FIRST_STEP_TIMEOUT_S, "step 1 committed on the cluster")
        assert _wait_for_the_end(cluster, _new_job(cluster, before)) == "FINISHED"
    finally:
        job.cancel()


def test_rollouts_stream_out_exactly_once_on_the_cluster_without_checkpoints(cluster, servers, tmp_path):
    run_dir = RunDir(tmp_path)
    _run_to_the_end(cluster, servers, run_dir,
                    _config(tmp_path, cluster.master, parallelism=2, checkpointing_interval_ms=None))
    _assert_exactly_once(run_dir)
    # Not asserted: that step 1 commits before the last rollout finishes (as on Prism). Measured
    # here, it committed 0.3 s after: this run's 256 rollouts take a few seconds, and each of the
    # four fused stages holds a bundle up to Beam's 1 s max bundle time on Flink.


def test_rollouts_stream_out_exactly_once_at_parallelism_2_with_checkpoints(cluster, servers, tmp_path):
    run_dir = RunDir(tmp_path)
    _run_to_the_end(cluster, servers, run_dir, _config(tmp_path, cluster.master))
    _assert_exactly_once(run_dir)


# When the TaskManager dies: (checkpointing interval, wait after step 1 for a checkpoint, then seconds).
KILLS = {
    # Flink restarts with no checkpoint: the source and packer start over from the run directory.
    "before-any-checkpoint": (60_000, False, 0.0),
    # Step 1 commits right after a checkpoint, and the source has usually not run since: Flink
    # restores the restriction this process last saved, and the source just continues.
    "right-after-step-1": (1000, False, 0.0),
    # The source ran on after the checkpoint: a replay, the source is rebuilt from the checkpoint.
    "2s-after-a-checkpoint": (5000, True, 2.0),
}


@pytest.mark.parametrize("kill", list(KILLS))
def test_a_taskmanager_killed_mid_run_loses_and_duplicates_no_step(cluster, slow_servers, tmp_path, kill):
    interval_ms, after_a_checkpoint, delay_s = KILLS[kill]
    before = _job_ids(cluster)
    config = _config(tmp_path, cluster.master, checkpointing_interval_ms=interval_ms, max_inflight=GROUP_SIZE)
    job = start_rollouts(config, slow_servers, str(tmp_path), with_trainer=False)
    run_dir = RunDir(tmp_path)
    try:
        _wait(lambda: run_dir.committed_steps(), FIRST_STEP_TIMEOUT_S, "step 1 committed on the cluster")
        job_id = _new_job(cluster, before)
        if after_a_checkpoint:
            done = cluster.checkpoints(job_id)["counts"]["completed"]
            _wait(lambda: cluster.checkpoints(job_id)["counts"]["completed"] > done, 30, "a checkpoint completes")
        time.sleep(delay_s)
        victim = min(cluster.taskmanagers_of(job_id))
        killed_at = time.monotonic()
        cluster.kill_taskmanager(int(victim.rsplit("-", 1)[1]))
        steps_then = len(run_dir.committed_steps())
        assert steps_then < PROMPTS * GROUP_SIZE // ROLLOUTS_PER_STEP, "the run ended before the kill"
        _wait(lambda: (cluster.job_metric(job_id, "numRestarts") or 0) >= 1, 60, "the job restarts")
        _wait(lambda: len(run_dir.committed_steps()) > steps_then, RUN_TIMEOUT_S, "a step committed after the kill")
        restored = (cluster.checkpoints(job_id).get("latest") or {}).get("restored")
        print(f"recovered: a new step committed {time.monotonic() - killed_at:.1f}s after the kill "
              f"({steps_then} committed at the kill; restored from {restored and restored.get('id')})")
        assert _wait_for_the_end(cluster, job_id) == "FINISHED"
        _assert_exactly_once(run_dir)
    finally:
        job.cancel()
        cluster.add_taskmanager()  # the module's cluster gets its second TaskManager back
        cluster.wait_ready(2)
