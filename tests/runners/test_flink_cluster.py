"""A standalone Flink 1.19 cluster (a JobManager and two TaskManagers, separate JVMs, loopback), each
TaskManager with a Beam worker pool beside it, and the rollout pipeline submitted to it with runner "flink"
and EXTERNAL workers: the Python stages run on the cluster's workers, not in this process.

Covered: dispatch (two shards) and scoring (a CPU-heavy reward) ran in two worker processes, neither of
them this one, every group trained once or counted; the job keeps checkpointing for the whole run and
restores from a checkpoint taken more than a minute in when a TaskManager dies; a killed worker process;
a killed submitter, after which steps keep committing and a new follower attaches to the job; a verifiers
taskset's rewards scoring in the workers; a verifiers environment served under its own virtualenv from the
cluster's workers, its env server killed mid-run; a cluster whose starting process is killed goes with it.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from beam_rl.config import config_from_dict
from beam_rl.processes import tree_pids
from beam_rl.rundir import RunDir
from beam_rl.rundir.lease import RunDirBusyError, read_job_record
from beam_rl.standin.server import EmbeddedServer, FaultConfig
from beam_rl.standin.simulated import SimulatedParams
from runners.flink_cluster import start_cluster
from beam_rl.job.rollouts import attach_rollouts, start_rollouts

GROUP_SIZE, ROLLOUTS_PER_STEP = 8, 64
FIRST_STEP_TIMEOUT_S = 90.0
RUN_TIMEOUT_S = 300.0

pytestmark = pytest.mark.skipif(shutil.which("java") is None, reason="needs a Java 11+ runtime for Flink")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The cluster of every test here. Its worker pools see the module's PYTHONPATH as it was when it
    started: the verifiers echo taskset is put on it first (tests/pipeline/test_verifiers.py)."""
    from tests.pipeline.test_verifiers import put_echo_taskset_on_path

    with pytest.MonkeyPatch.context() as monkeypatch:
        put_echo_taskset_on_path(tmp_path_factory.mktemp("verifiers"), monkeypatch)
        started = time.monotonic()
        cluster = start_cluster(taskmanagers=2, slots_per_taskmanager=2)
        print(f"Flink cluster with worker pools ready in {time.monotonic() - started:.1f}s at {cluster.master}")
        yield cluster
        cluster.stop()


def _servers(mode: str = "instant", simulated: SimulatedParams | None = None, **faults):
    started = [EmbeddedServer(mode=mode, served_model_name="tiny", max_num_seqs=256, simulated=simulated,
                              faults=FaultConfig(**faults)) for _ in range(2)]
    return started, [s.start() for s in started]


@pytest.fixture(scope="module")
def servers():
    started, urls = _servers()
    yield urls
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def slow_servers():
    """Each request answered after 1 s: with a group per shard in flight at a time, a run of
    `prompts` groups takes about prompts / 2 seconds, long enough to kill things in the middle."""
    started, urls = _servers(latency_s=1.0)
    yield urls
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def streaming_servers():
    """Each request streams its 8 tokens over ~1 s (simulated engine steps of 0.125 s), so a kill always
    finds rollouts part-way through their tokens."""
    started, urls = _servers(mode="simulated", simulated=SimulatedParams(decode_base_s=0.125, length_median=400,
                                                                         length_sigma=0.1))
    yield started, urls
    for s in started:
        s.stop()


def _config(run_dir, cluster, prompts: int, checkpointing_interval_ms: int | None = 1000,
            max_inflight: int = 64, reward_cpu_ms: float = 0.0) -> dict:
    env = ({"name": "arithmetic", "args": {"reward_cpu_ms": reward_cpu_ms}} if reward_cpu_ms
           else {"name": "reverse_text"})
    return {
        "run": {"dir": str(run_dir), "max_steps": 1000},
        "envs": [{**env, "group_size": GROUP_SIZE, "limit": prompts}],
        "batch": {"rollouts_per_step": ROLLOUTS_PER_STEP},
        # Every group trains or is counted; a zero-advantage group is then trained too, so steps are full.
        "filters": {"zero_advantage": {"mode": "monitor"}},
        "inference": {"max_tokens": 8, "max_inflight": max_inflight},
        "dispatch": {"shards": 2},
        "runner": {"name": "flink", "flink_master": cluster.master, "parallelism": 2, "environment": "external",
                   "worker_pool": cluster.worker_pool, "checkpointing_interval_ms": checkpointing_interval_ms},
    }


def _wait(predicate, timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s:g}s")
        time.sleep(0.5)
    return time.monotonic() - started


def _assert_exactly_once(run_dir: RunDir, prompts: int) -> None:
    steps = run_dir.committed_steps()
    assert steps == list(range(1, len(steps) + 1))
    ids = [rid for s in steps for rid in run_dir.read_window(s).column("rollout_id").to_pylist()]
    assert len(ids) == prompts * GROUP_SIZE and len(set(ids)) == len(ids)  # none lost, none twice
    groups = collections.Counter(rid.rsplit("/", 1)[0] for rid in ids)
    assert len(groups) == prompts and set(groups.values()) == {GROUP_SIZE}


def _workers(run_dir: RunDir) -> dict[str, set[str]]:
    """host:pid of every worker that dispatched or scored a rollout of the run (the commit records')."""
    seen: dict[str, set[str]] = {"dispatch": set(), "score": set()}
    for step in run_dir.committed_steps():
        for role, workers in run_dir.read_commit(step).extra["workers"].items():
            seen[role].update(workers)
    return seen


def test_the_cluster_is_a_jobmanager_and_two_taskmanagers_each_with_a_worker_pool(cluster):
    overview = cluster.overview()
    assert overview["flink-version"].startswith("1.19")
    assert overview["taskmanagers"] == 2 and overview["slots-total"] == 4
    processes = [cluster.jobmanager, *(tm.process for tm in cluster.taskmanagers), *(tm.pool for tm in cluster.taskmanagers)]
    assert len({p.pid for p in processes}) == 5 and all(p.poll() is None for p in processes)
    assert {tm["id"] for tm in cluster.rest("/taskmanagers")["taskmanagers"]} == {"taskmanager-0", "taskmanager-1"}
    assert len({tm.pool_address for tm in cluster.taskmanagers}) == 2  # a pool of its own each


def test_dispatch_and_scoring_run_on_two_cluster_workers_none_of_them_this_process(cluster, servers, tmp_path):
    prompts = 32
    config = config_from_dict(_config(tmp_path, cluster, prompts, reward_cpu_ms=5.0))
    job = start_rollouts(config, servers, str(tmp_path), with_trainer=False)
    pool_workers: set[int] = set()
    sampling = threading.Event()

    def sample() -> None:  # the pools' workers while the job runs (they go with it)
        while not sampling.wait(0.2):
            pool_workers.update(cluster.worker_pids())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        with pytest.raises(RunDirBusyError):  # one follower per run directory
            start_rollouts(config, servers, str(tmp_path), with_trainer=False)
        job.wait()
    finally:
        sampling.set()
        sampler.join()
        job.cancel()
    run_dir = RunDir(tmp_path)
    _assert_exactly_once(run_dir, prompts)
    workers = _workers(run_dir)
    assert len(workers["dispatch"]) == 2 and len(workers["score"]) == 2, workers
    pids = {int(w.rsplit(":", 1)[1]) for w in workers["dispatch"] | workers["score"]}
    assert os.getpid() not in pids and pids <= pool_workers, (pids, pool_workers)  # the pools' children


def _start(cluster, servers, run_dir, prompts, **kw):
    config = config_from_dict(_config(run_dir, cluster, prompts, max_inflight=2 * GROUP_SIZE, **kw))
    job = start_rollouts(config, servers, str(run_dir), with_trainer=False)
    return config, job, read_job_record(run_dir)["job_id"]


def test_a_taskmanager_killed_over_a_minute_in_is_restored_from_a_checkpoint_taken_after_that_minute(
        cluster, slow_servers, tmp_path):
    prompts = 160  # ~80 s of dispatch on slow servers: the kill lands past the minute, with work left
    _, job, job_id = _start(cluster, slow_servers, tmp_path, prompts, checkpointing_interval_ms=2000)
    run_dir = RunDir(tmp_path)
    try:
        started_ms = cluster.rest(f"/jobs/{job_id}")["start-time"]
        _wait(lambda: time.time() * 1000 - started_ms > 65_000, 120, "the job runs past a minute")
        steps_then = len(run_dir.committed_steps())
        assert steps_then < prompts * GROUP_SIZE // ROLLOUTS_PER_STEP, "the run ended before the kill"
        # Checkpoints go on past the first minute (the source is kept up): the newest one is the restore's.
        newest = cluster.checkpoints(job_id)["latest"]["completed"]
        assert newest["trigger_timestamp"] - started_ms > 60_000, newest
        victim = cluster.index_of(min(cluster.taskmanagers_of(job_id)))
        killed_at = time.monotonic()
        cluster.kill_taskmanager(victim)
        _wait(lambda: (cluster.job_metric(job_id, "numRestarts") or 0) >= 1, 60, "the job restarts")
        _wait(lambda: len(run_dir.committed_steps()) > steps_then, RUN_TIMEOUT_S, "a step committed after the kill")
        recovery_s = time.monotonic() - killed_at
        restored = cluster.checkpoints(job_id)["latest"]["restored"]
        print(f"TaskManager killed {time.time() * 1000 - started_ms:.0f} ms into the job; restored checkpoint "
              f"{restored['id']} (the newest before the kill: {newest['id']}, triggered "
              f"{(newest['trigger_timestamp'] - started_ms) / 1000:.1f}s in); a new step committed "
              f"{recovery_s:.1f}s after the kill")
        assert restored["id"] >= newest["id"]
        job.wait()
        _assert_exactly_once(run_dir, prompts)
    finally:
        job.cancel()
        if cluster.taskmanagers[victim].process.poll() is not None:  # the module's cluster: two live again
            cluster.restart_taskmanager(victim)
            cluster.wait_ready(2)


def test_a_killed_worker_process_is_replaced_and_its_rollouts_continue_from_their_tokens(
        cluster, streaming_servers, tmp_path):
    prompts = 48
    servers, urls = streaming_servers
    _, job, job_id = _start(cluster, urls, tmp_path, prompts, checkpointing_interval_ms=1000)
    run_dir = RunDir(tmp_path)
    try:
        _wait(lambda: len(run_dir.committed_steps()) >= 1, FIRST_STEP_TIMEOUT_S, "step 1 committed")
        steps_then = len(run_dir.committed_steps())
        victim = cluster.worker_pids()[0]
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        _wait(lambda: (cluster.job_metric(job_id, "numRestarts") or 0) >= 1, 60, "the job restarts")
        _wait(lambda: len(run_dir.committed_steps()) > steps_then, RUN_TIMEOUT_S, "a step committed after the kill")
        print(f"worker {victim} killed; a new step committed {time.monotonic() - killed_at:.1f}s later")
        job.wait()
        _assert_exactly_once(run_dir, prompts)
        assert victim not in cluster.worker_pids()
        # The restored sources continued what the checkpoint kept: the servers were asked for the rest of
        # those rollouts (the prompt plus the tokens kept, fewer than 8 to go).
        restores = [m["dispatch_restore"] for m in run_dir.read_metrics() if "dispatch_restore" in m]
        resumed = sum(r["rollouts_resumed"] for r in restores)
        continued = [seen for s in servers for seen in s.requests_seen if seen.max_tokens < 8]
        print(f"restored: {resumed} rollouts continued from {sum(r['tokens_resumed'] for r in restores)} tokens")
        assert resumed > 0 and len(continued) >= 1
    finally:
        job.cancel()


def test_a_verifiers_env_server_on_the_cluster_killed_mid_run_is_restarted_and_nothing_trains_twice(
        cluster, tok, tmp_path):
    """The toy verifiers environment (tests/support/vf_toy.py) in env servers the cluster's dispatch workers start
    under a virtualenv of its own; one is SIGKILLed once a step has committed: it is started again, every
    group trains once, and the rank files hold the tokens the server sampled."""
    import asyncio

    from verifiers.v1.serve import EnvClient

    from tests.support.run_checks import assert_rank_files_hold_the_windows_tokens
    from tests.support.vf_toy import REPLIES, answers, own_virtualenv, serve_processes, toy_config, toy_env

    python = own_virtualenv(tmp_path)
    tasks = 12
    config = config_from_dict(toy_config(
        tmp_path / "run", [toy_env("toy", tasks, server="process", python=str(python))], rollouts_per_step=4,
        max_inflight=4, dispatch={"shards": 2},
        runner={"name": "flink", "flink_master": cluster.master, "parallelism": 2, "environment": "external",
                "worker_pool": cluster.worker_pool, "checkpointing_interval_ms": 1000}))
    # A server a shard, each turn answered after 0.5 s, two episodes in flight a shard: some 10 s of episodes.
    inference = [EmbeddedServer(mode="instant", served_model_name="tiny", max_num_seqs=16,
                                faults=FaultConfig(replies=[{"text": t, "latency_s": 0.5} for t in REPLIES]))
                 for _ in range(2)]
    run_dir = RunDir(tmp_path / "run")
    job = start_rollouts(config, [s.start() for s in inference], str(tmp_path / "run"), with_trainer=False)
    try:
        # The workers import verifiers and read the taskset under the other python first (seconds each).
        started_s = _wait(lambda: _rollouts_done(run_dir) >= 2, 3 * FIRST_STEP_TIMEOUT_S, "2 episodes done")
        servers = serve_processes(python)
        assert len(servers) == 2 and _rollouts_done(run_dir) < tasks * 2 - 4, "the run ended before the kill"
        # One that has started (a kill while it starts is a start retried, tests/pipeline/test_verifiers_episodes.py).
        healthy = {pid: a for pid, a in servers.items() if asyncio.run(EnvClient(a).health(timeout=2.0))}
        assert healthy, servers
        victim, address = next(iter(healthy.items()))
        os.killpg(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        _wait(lambda: address in serve_processes(python).values(), 60, "the env server started again")
        _wait(lambda: asyncio.run(EnvClient(address).health(timeout=1.0)), 60, "the new env server healthy")
        print(f"2 episodes done {started_s:.1f} s after the submission; env server {victim} SIGKILLed; its "
              f"replacement answered its health check {time.monotonic() - killed_at:.2f} s later")
        job.wait()
    finally:
        job.cancel()
        for server in inference:
            server.stop()
    rollouts = assert_rank_files_hold_the_windows_tokens(run_dir)
    groups = collections.Counter(r["group_id"] for r in rollouts)
    assert len({r["rollout_id"] for r in rollouts}) == len(rollouts)  # none twice
    assert len(groups) == tasks and set(groups.values()) == {2}  # every group, whole
    sampled = answers(tok)
    assert all([t["completion_ids"] for t in r["turns"]] in ([a, b] for a in sampled for b in sampled)
               for r in rollouts)
    assert len(_workers(run_dir)["dispatch"]) == 2


def test_cluster_workers_score_with_a_verifiers_taskset(cluster, tmp_path):
    """The worker pools' processes score with a verifiers taskset's own reward functions (verifiers.v1 from
    the project's virtualenv, the taskset from PYTHONPATH)."""
    from tests.pipeline.test_verifiers import _assert_scored_by_the_taskset, _pipeline_config

    started, urls = _servers()
    try:
        runner = {"name": "flink", "flink_master": cluster.master, "parallelism": 1, "environment": "external",
                  "worker_pool": cluster.worker_pool, "checkpointing_interval_ms": 1000}
        job = start_rollouts(config_from_dict(_pipeline_config(tmp_path / "run", runner)), urls,
                             str(tmp_path / "run"), with_trainer=False)
        try:
            job.wait()
        finally:
            job.cancel()
    finally:
        for s in started:
            s.stop()
    workers = _assert_scored_by_the_taskset(tmp_path / "run")
    assert workers and all(int(w.rsplit(":", 1)[1]) != os.getpid() for w in workers), workers


def _rollouts_done(run_dir: RunDir) -> int:
    """Rollouts the shards' dispatchers finished so far, as their status files say."""
    done = 0
    for path in run_dir.path.glob("status-*.json"):
        with contextlib.suppress(OSError, ValueError):
            done += json.loads(path.read_text()).get("ok", 0)
    return done


_SUBMITTER = """
import sys
from beam_rl.config import config_from_dict
from beam_rl.job.rollouts import start_rollouts
import json
config = config_from_dict(json.loads(sys.argv[1]))
job = start_rollouts(config, json.loads(sys.argv[2]), config.run.dir, with_trainer=False)
print("SUBMITTED", flush=True)
job.wait()
"""


def test_the_job_outlives_its_submitter_and_a_new_follower_attaches_to_it(cluster, slow_servers, tmp_path):
    prompts = 48
    raw = _config(tmp_path, cluster, prompts, max_inflight=2 * GROUP_SIZE, checkpointing_interval_ms=1000)
    submitter = subprocess.Popen([sys.executable, "-c", _SUBMITTER, json.dumps(raw), json.dumps(slow_servers)],
                                 stdout=subprocess.PIPE, text=True)
    run_dir = RunDir(tmp_path)
    try:
        _wait(lambda: len(run_dir.committed_steps()) >= 1, FIRST_STEP_TIMEOUT_S, "step 1 committed")
        job_id = read_job_record(tmp_path)["job_id"]
        submitter.send_signal(signal.SIGKILL)
        submitter.wait()
        killed_at, steps_then = time.monotonic(), len(run_dir.committed_steps())
        _wait(lambda: len(run_dir.committed_steps()) > steps_then, RUN_TIMEOUT_S,
              "a step committed after the submitter died")
        print(f"submitter killed; a new step committed {time.monotonic() - killed_at:.1f}s later, on the cluster alone")
        assert cluster.api.state(job_id) == "RUNNING"
        follower = attach_rollouts(config_from_dict(raw), str(tmp_path), with_trainer=False)
        assert follower is not None  # the job the record names, still running: followed, not resubmitted
        follower.wait()
        assert len([j for j in cluster.jobs() if j["name"] == read_job_record(tmp_path)["job_name"]]) == 1
        _assert_exactly_once(run_dir, prompts)
        assert cluster.api.state(job_id) in ("CANCELED", "FINISHED")
    finally:
        if submitter.poll() is None:
            submitter.kill()
        with contextlib.suppress(Exception):
            cluster.api.cancel(read_job_record(tmp_path)["job_id"])


def test_a_cluster_whose_starter_is_killed_leaves_no_process_behind(tmp_path):
    starter = subprocess.Popen([sys.executable, "-m", "runners.flink_cluster", "--taskmanagers", "1",
                                "--workdir", str(tmp_path)], stdout=subprocess.PIPE, text=True)
    started: list[int] = []
    try:
        assert "ready" in starter.stdout.readline()
        started = [pid for pid in tree_pids(starter.pid) if pid != starter.pid]
        assert len(started) >= 3  # a JobManager, a TaskManager, its worker pool
        starter.send_signal(signal.SIGKILL)
        starter.wait()
        _wait(lambda: not any(map(_running, started)), 60, "the cluster's processes gone")
    finally:
        for pid in [starter.pid, *started]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False
