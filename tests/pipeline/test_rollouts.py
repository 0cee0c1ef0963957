"""The rollout pipeline end to end on Prism, against two embedded inference servers over HTTP."""

from __future__ import annotations

import collections
import gc
import os
import shutil

import psutil
import pyarrow as pa
import pytest

from beam_rl.config import config_from_dict
from beam_rl.rundir import RunDir
from beam_rl.source import admission
from beam_rl.standin.server import EmbeddedServer, FaultConfig
from beam_rl.model.tiny import tiny_model_dir
from bench.common.trainer import PublishEveryStep
from beam_rl.job.rollouts import run_rollouts, runner_settings, start_rollouts

PROMPTS, GROUP_SIZE, ROLLOUTS_PER_STEP = 32, 8, 64


def _config(run_dir, runner="direct", max_steps=10, runner_options=None, **inference):
    return config_from_dict({
        "run": {"dir": str(run_dir), "max_steps": max_steps},
        "envs": [{"name": "reverse_text", "group_size": GROUP_SIZE, "limit": PROMPTS}],
        "batch": {"rollouts_per_step": ROLLOUTS_PER_STEP},
        "inference": {"max_tokens": 8, "max_inflight": 16, **inference},
        "runner": {"name": runner, **(runner_options or {})},
    })


@pytest.fixture(scope="module")
def servers():
    # Latency keeps dispatch running well past the first step, whatever the machine's load.
    started = [EmbeddedServer(model_dir=tiny_model_dir(), served_model_name="tiny", max_num_seqs=64,
                              faults=FaultConfig(latency_s=0.3)) for _ in range(2)]
    yield [s.start() for s in started]
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def finished_run(servers, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("pipeline-run")
    run_rollouts(_config(run_dir), servers, with_trainer=False)
    return RunDir(run_dir)


def _windows(run_dir: RunDir) -> dict[int, pa.Table]:
    return {step: run_dir.read_window(step) for step in run_dir.committed_steps()}


def _trained_rollout_ids(run_dir: RunDir, step: int) -> list[str]:
    table = pa.ipc.open_file(pa.memory_map(str(run_dir.rank_path(step, 0)))).read_all()
    return table.column("rollout_id").to_pylist()


def _assert_every_group_once(run_dir: RunDir) -> None:
    windows = _windows(run_dir)
    assert run_dir.committed_steps() == list(range(1, len(windows) + 1))
    ids = [rid for table in windows.values() for rid in table.column("rollout_id").to_pylist()]
    assert len(ids) == PROMPTS * GROUP_SIZE and len(set(ids)) == len(ids)  # none lost, none twice
    groups = collections.Counter(rid.rsplit("/", 1)[0] for rid in ids)
    assert len(groups) == PROMPTS and set(groups.values()) == {GROUP_SIZE}


def test_every_group_is_dispatched_and_lands_in_one_step(finished_run):
    _assert_every_group_once(finished_run)


@pytest.mark.skipif(shutil.which("java") is None, reason="needs a Java 11+ runtime for Flink")
@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # workers end quietly
def test_flink_local_with_checkpoints_keeps_every_group_exactly_once(servers, tmp_path):
    # Checkpoints every 0.5 s for the whole run: the source stays up and the job is ended once the run is over.
    config = _config(tmp_path, runner="flink-local", runner_options={"checkpointing_interval_ms": 500})
    job = start_rollouts(config, servers, str(tmp_path), with_trainer=False)
    # The job server runs the embedded Flink, with a bounded heap, for as long as the job.
    assert f"-Xmx{runner_settings(config).jvm_heap_mb}m" in job.job_server.process.args
    job.wait()
    assert job.job_server.process.poll() is not None  # stopped with the job
    _assert_every_group_once(RunDir(tmp_path))


def test_every_ok_rollout_is_trained_once_or_counted_as_filtered(finished_run):
    trained: list[str] = []
    for step, window in _windows(finished_run).items():
        trained += _trained_rollout_ids(finished_run, step)
        rows = window.to_pylist()
        for row in rows:
            if row["status"] != "ok":
                assert row["rollout_id"] not in trained
        filtered = collections.Counter(r["filtered"] for r in rows if r["status"] == "ok" and r["filtered"])
        assert dict(filtered) == finished_run.read_commit(step).window.filtered
    assert len(trained) == len(set(trained))
    all_rows = [r for w in _windows(finished_run).values() for r in w.to_pylist()]
    ok_unfiltered = {r["rollout_id"] for r in all_rows if r["status"] == "ok" and not r["filtered"]}
    assert set(trained) == ok_unfiltered


def test_the_window_holds_each_rollouts_tokens_versions_and_timeline(finished_run):
    for step, window in _windows(finished_run).items():
        trained = pa.ipc.open_file(pa.memory_map(str(finished_run.rank_path(step, 0)))).read_all()
        samples = dict(zip(trained.column("rollout_id").to_pylist(), trained.column("input_ids").to_pylist()))
        for row in window.to_pylist():
            stamps = [row[t] for t in ("t_admitted", "t_sent", "t_first_token", "t_finished", "t_scored", "t_packed",
                                       "t_committed")]
            assert stamps == sorted(stamps), row["rollout_id"]  # the first token as it streamed back
            if row["status"] != "ok":
                continue
            # No trainer, no update: the client stamps every token with the one version the servers hold.
            versions = {v for turn in row["turns"] for v in turn["policy_versions"]}
            assert versions == {row["policy_version_start"]} == {row["token_version_min"], row["token_version_max"]}
            tokens = row["prompt_ids"] + [t for turn in row["turns"] for t in turn["env_ids"] + turn["completion_ids"]]
            if row["rollout_id"] in samples:  # what the trainer reads is what the window shows
                assert samples[row["rollout_id"]] == tokens


def test_first_step_is_committed_while_dispatch_is_still_running(finished_run):
    first_commit = finished_run.read_commit(1).committed_at
    last_finished = max(max(w.column("t_finished").to_pylist()) for w in _windows(finished_run).values())
    assert first_commit < last_finished


def test_batches_hold_whole_groups_and_the_configured_size(finished_run):
    for step in finished_run.committed_steps():
        commit = finished_run.read_commit(step)
        trained = _trained_rollout_ids(finished_run, step)
        groups = collections.Counter(rid.rsplit("/", 1)[0] for rid in trained)
        assert set(commit.group_ids) == set(groups)
        if step < finished_run.last_committed_step():  # only the final flush may be partial
            assert len(trained) >= ROLLOUTS_PER_STEP


def test_max_steps_stops_the_run_early(servers, tmp_path):
    # 1 step of 64 rollouts out of 256: in-flight groups are cancelled once step 1 commits.
    gc.unfreeze()
    run_rollouts(_config(tmp_path, max_steps=1), servers, with_trainer=False)
    assert RunDir(tmp_path).committed_steps() == [1]
    # LOOPBACK: the worker is this process, and its long-lived heap left the collector's full passes.
    assert gc.get_freeze_count() > 100_000


@pytest.mark.parametrize("runner", ["direct", "flink-local"])
def test_two_dispatch_shards_share_the_work_and_keep_every_group_exactly_once(servers, tmp_path, runner):
    if runner == "flink-local" and shutil.which("java") is None:
        pytest.skip("needs a Java 11+ runtime for Flink")
    # On flink-local the Python stages run in workers the embedded TaskManager starts (`process`).
    options = ({"parallelism": 2, "checkpointing_interval_ms": 500, "environment": "process"}
               if runner == "flink-local" else {})
    config = config_from_dict({**_config(tmp_path, runner=runner, runner_options=options).model_dump(mode="json"),
                               "dispatch": {"shards": 2}})
    run_rollouts(config, servers, with_trainer=False)
    run_dir = RunDir(tmp_path)
    _assert_every_group_once(run_dir)
    # Each shard dispatched to its own server (every other one): both shards did their share.
    servers_seen = collections.Counter(r for t in _windows(run_dir).values() for r in t.column("server").to_pylist())
    assert set(servers_seen) == set(servers) and min(servers_seen.values()) >= PROMPTS * GROUP_SIZE // 4, servers_seen
    workers = {w for s in run_dir.committed_steps() for ws in run_dir.read_commit(s).extra["workers"].values() for w in ws}
    in_this_process = {f"{os.uname().nodename}:{os.getpid()}"}
    assert workers == in_this_process if runner == "direct" else (workers and not workers & in_this_process), workers


def run_publishing_every_step(config, urls: list[str]) -> tuple[RunDir, list[dict]]:
    """The rollout pipeline beside a stand-in trainer that publishes weights after every step: the run
    directory and its weight-update records."""
    run_dir = RunDir(config.run.dir)
    trainer = PublishEveryStep(run_dir)
    trainer.start()
    try:
        run_rollouts(config, urls, with_trainer=True)
    finally:
        trainer.stop.set()
        trainer.join(10)
    return run_dir, [m["weight_update"] for m in run_dir.read_metrics() if "weight_update" in m]


def trained_token_versions(run_dir: RunDir, step: int) -> list[list[int]]:
    """The policy version of every generated token of each of the step's rank-0 samples."""
    table = pa.ipc.open_file(pa.memory_map(str(run_dir.rank_path(step, 0)))).read_all()
    columns = zip(table.column("policy_versions").to_pylist(), table.column("loss_mask").to_pylist())
    return [[v for v, m in zip(versions, mask) if m] for versions, mask in columns]


def _run_slow_servers_publishing_every_step(tmp_path, update_mode: str) -> tuple[RunDir, list[dict], list[dict]]:
    """Slow decode steps and long completions, weights after every step, bound 1: the run directory, its
    weight-update records and every window row."""
    servers = [EmbeddedServer(model_dir=tiny_model_dir(), served_model_name="tiny", max_num_seqs=64,
                              faults=FaultConfig(step_delay_s=0.01)) for _ in range(2)]
    urls = [s.start() for s in servers]
    config = config_from_dict({
        "run": {"dir": str(tmp_path), "max_steps": 6},
        "envs": [{"name": "reverse_text", "group_size": 4, "limit": 64, "mode": "rollout"}],
        "batch": {"rollouts_per_step": 16},
        "inference": {"max_tokens": 24, "max_inflight": 48},
        "off_policy": {"max_async_level": 1, "max_off_policy_steps": 1},
        "weights": {"update_mode": update_mode},
        "filters": {"zero_advantage": {"mode": "monitor"}},
    })
    try:
        run_dir, updates = run_publishing_every_step(config, urls)
    finally:
        for s in servers:
            s.stop()
    return run_dir, updates, [r for step in run_dir.committed_steps() for r in run_dir.read_window(step).to_pylist()]


@pytest.mark.parametrize("update_mode", ["keep", "continue", "reload"])
def test_weights_published_every_step_train_only_tokens_inside_the_bound(tmp_path, update_mode, monkeypatch):
    # Admission is blind to the bound here, as it is in effect when rollouts take longer than steps: groups
    # queue past what the bound can train, so new weights make some stale while they generate.
    monkeypatch.setattr(admission, "staleness_at_training", lambda *_: 0)
    run_dir, updates, rows = _run_slow_servers_publishing_every_step(tmp_path, update_mode)
    # WeightSync loads the newest weights, so steps committed during an update are skipped (on a loaded machine
    # every other one). max_async_level = 1 holds admission two steps past the servers' weights, so a run of
    # six steps needs at least two updates unless the first poll misses two steps.
    assert len(updates) >= 2 and {s["mode"] for u in updates for s in u["servers"]} == {update_mode}
    # Regenerated or kept, never cancelled as stale: a cancelled rollout is one the run's end stopped.
    assert not [r for r in rows if r["status"] == "cancelled" and r["discarded_tokens"]["stale"]]
    for step in run_dir.committed_steps():
        for generated in trained_token_versions(run_dir, step):
            if update_mode != "reload":
                assert min(generated) >= 0, (step, generated)  # keep and continue: every token's version is known
            known = [v for v in generated if v >= 0]
            assert not known or min(known) >= step - 1 - 1, (step, generated)  # staleness <= max_off_policy_steps
        assert run_dir.read_commit(step).window.tokens_by_fate.get("trained", 0) == \
            run_dir.read_commit(step).counts.trained_tokens
    generated = sum(r["completion_tokens"] + sum(v or 0 for v in r["discarded_tokens"].values()) for r in rows)
    counted = sum(sum(run_dir.read_commit(s).window.tokens_by_fate.values()) for s in run_dir.committed_steps())
    clean_left = sum(r["completion_tokens"] for r in rows if r["status"] == "ok" and not r["filtered"]) - sum(
        run_dir.read_commit(s).counts.trained_tokens for s in run_dir.committed_steps())
    assert counted == generated - clean_left  # clean rollouts not cut into a step yet are counted when cut
    # New weights did make in-flight rollouts too stale, and they were generated again.
    assert sum(u["regenerated_rollouts"] for u in updates) > 0 and sum(r["discarded_tokens"]["stale"] for r in rows) > 0


def test_admission_inside_the_bound_generates_nothing_too_stale_to_train(tmp_path):
    run_dir, updates, rows = _run_slow_servers_publishing_every_step(tmp_path, "keep")
    fates = collections.Counter()
    for step in run_dir.committed_steps():
        fates.update(run_dir.read_commit(step).window.tokens_by_fate)
    assert len(updates) >= 2 and fates["trained"] > 0 and fates["stale"] == 0, fates


def _prisms() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True) if p.name() == "prism"}


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # workers end quietly
def test_the_jobs_own_counters_come_from_the_runner_and_its_prism_stops_with_it(servers, tmp_path):
    before = _prisms()
    job = start_rollouts(_config(tmp_path, max_steps=2), servers, str(tmp_path), with_trainer=False)
    assert _prisms() - before  # the job's own
    job.wait()
    assert not _prisms() - before  # not left running until this process exits
    counters = job.counters()  # what the job's follower serves to Prometheus (beam_rl/observe)
    assert counters["beam_rl/steps_committed"] == len(RunDir(tmp_path).committed_steps()) == 2, counters
    assert not any(name.startswith("beam/") for name in counters)  # Beam's system metrics left out


def test_goodput_concurrency_runs_two_shards_and_a_resumed_run_starts_from_the_committed_steps(servers, tmp_path):
    """dispatch.concurrency.mode = "goodput" on Prism with two shards: every group once; run again on the
    same run directory, each shard's controller starts where its servers' committed rollouts overlapped."""
    from beam_rl.dispatch.concurrency import committed_concurrency

    def config(max_steps):
        return config_from_dict({**_config(tmp_path, max_steps=max_steps).model_dump(mode="json"),
                                 "dispatch": {"shards": 2, "concurrency": {"mode": "goodput"}}})

    run_rollouts(config(2), servers, with_trainer=False)
    run_dir = RunDir(tmp_path)
    windows = [run_dir.read_window(s) for s in run_dir.committed_steps()]
    starts = [committed_concurrency(windows, {url}) for url in servers]
    assert all(s is not None and 1 <= s <= 8 for s in starts), starts  # each shard: 16 // 2 permits
    run_rollouts(config(4), servers, with_trainer=False)
    assert run_dir.committed_steps() == [1, 2, 3, 4]
    _assert_every_group_once(run_dir)
