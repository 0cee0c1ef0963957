"""Inference faults through the real rollout pipeline (Prism) against two embedded servers, one of
them faulty: 5xx answers, hangs past the request timeout, dropped connections, a server dying
mid-run, a server coming back, and every server down.

The contract once re-dispatch is spent (`max_redispatches = 0` here; docs/design.md, "Reliability"): a
failing server costs only the rollouts it held, which leave Dispatch as errored and are counted in their
step's window; the run finishes its steps on the other server. Counts are exact where the servers make them so: with `max_retries = 0` and group mode every
completion request a server received is one group of GROUP_SIZE rollouts, and the servers count the
requests they received (`beam_rl:requests_total`).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from beam_rl import cli
from beam_rl.config import RunConfig, config_from_dict
from beam_rl.rundir import RunDir
from beam_rl.rundir.failures import read_failure
from beam_rl.standin.server import EmbeddedServer, FaultConfig
from beam_rl.job.rollouts import run_rollouts

pytestmark = pytest.mark.timeout(120)

GROUP_SIZE = 4
PROMPTS = 16
ROLLOUTS_PER_STEP = 16
REQUEST_TIMEOUT_S = 1.0
MAX_INFLIGHT = 16
UNHEALTHY_AFTER = 3  # ServerPool's default


def sent_before_taken_out(servers: int) -> int:
    """The most groups dead servers can still be sent (beyond those they held): `unhealthy_after`
    failures in a row (or one refused connection) take a server out of selection, and the groups
    already on their way to it then fail too, at most one fewer than fit in the permits."""
    return servers * (UNHEALTHY_AFTER + MAX_INFLIGHT // GROUP_SIZE - 1)


def _config(run_dir, prompts: int = PROMPTS, max_inflight: int = MAX_INFLIGHT, **inference) -> RunConfig:
    return config_from_dict({
        "run": {"dir": str(run_dir), "max_steps": 100},  # ends when the data is exhausted
        "model": {"max_context": 256},
        "envs": [{"name": "reverse_text", "group_size": GROUP_SIZE, "limit": prompts}],
        "batch": {"rollouts_per_step": ROLLOUTS_PER_STEP, "seq_len": 256},
        # Flagged, not dropped: which steps the clean groups fill must not depend on random rewards
        # (a zero-advantage group arriving last would meet the bug of test_groups_after_the_last_batch_...).
        "filters": {"zero_advantage": {"mode": "monitor"}},
        # No retries and no re-dispatch: every injected fault must surface as errored rollouts, one request
        # per group (re-dispatch, which keeps them, is tests/integration/test_dispatch_embedded.py's).
        "inference": {"max_tokens": 8, "max_inflight": max_inflight, "max_retries": 0, "max_redispatches": 0,
                      "request_timeout_s": REQUEST_TIMEOUT_S, **inference},
    })


@pytest.fixture
def start_server(start_embedded) -> Callable[..., EmbeddedServer]:
    """Starts instant-mode embedded servers; each is stopped afterwards (stop() is idempotent)."""

    def start(served_model_name: str | None = None, **faults) -> EmbeddedServer:
        return start_embedded(mode="instant", faults=FaultConfig(**faults), served_model_name=served_model_name)

    return start


def requests_received(server: EmbeddedServer) -> int:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return int(values["beam_rl:requests_total"])


def after_first_commit(run_dir: RunDir, action: Callable[[], None]) -> threading.Thread:
    """Runs `action` on a thread as soon as step 1 is committed (what an operator or a crash would do)."""

    def watch() -> None:
        deadline = time.monotonic() + 60
        while not run_dir.is_committed(1) and time.monotonic() < deadline:
            time.sleep(0.01)
        action()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def checked_windows(run_dir: RunDir, prompts: int = PROMPTS) -> list[dict]:
    """Every window record of the run, after checking the invariants every faulty run must keep:
    committed steps contiguous from 1, every group in exactly one step's window with all its
    rollouts, and each commit's error count equal to the errored records of its window."""
    steps = run_dir.committed_steps()
    assert steps == list(range(1, len(steps) + 1)) and steps
    records: list[dict] = []
    steps_of_group: dict[str, set[int]] = defaultdict(set)
    for step in steps:
        window = run_dir.read_window(step).to_pylist()
        summary = run_dir.read_commit(step).window
        errored = sum(r["status"] == "error" for r in window)
        assert summary.errored == summary.status["error"] == errored
        assert summary.rollouts == len(window)
        for r in window:
            steps_of_group[r["group_id"]].add(step)
        records += window
    assert all(len(s) == 1 for s in steps_of_group.values()), "a group landed in two steps"
    assert Counter(Counter(r["rollout_id"] for r in records).values()) == {1: len(records)}
    per_group = Counter(r["group_id"] for r in records)
    assert len(per_group) == prompts and set(per_group.values()) == {GROUP_SIZE}
    assert all(r["status"] in ("ok", "error") for r in records)
    return records


def errored(records: list[dict]) -> list[dict]:
    return [r for r in records if r["status"] == "error"]


def record_outcome(record_property, run_dir: RunDir, records: list[dict]) -> None:
    """The run's figures in the JUnit report (`--junitxml`): steps, rollouts, errored ones."""
    record_property("steps_committed", len(run_dir.committed_steps()))
    record_property("rollouts_in_windows", len(records))
    record_property("rollouts_errored", len(errored(records)))


# -- one faulty server among two -------------------------------------------------------------------

FAULT_ERRORS = {
    "error": "InferenceHTTPError: POST {url}/v1/completions: HTTP 500",
    "hang": f"InferenceTimeout: POST {{url}}/v1/completions: not finished within {REQUEST_TIMEOUT_S:g}s",
    "drop": "InferenceConnectionError: POST {url}/v1/completions: connection failed",
}


@pytest.mark.parametrize("kind", ["error", "hang", "drop"])
def test_a_faulty_server_costs_only_the_groups_it_was_sent(start_server, tmp_path, record_property, kind):
    faulty = start_server(**{f"{kind}_rate": 1.0})
    clean = start_server()
    run_dir = RunDir(tmp_path)
    run_rollouts(_config(tmp_path), [faulty.url, clean.url], with_trainer=False)

    records = checked_windows(run_dir)
    record_outcome(record_property, run_dir, records)
    lost = errored(records)
    # Every request the faulty server received was one group, and every one of them failed.
    sent_to_faulty = requests_received(faulty)
    assert sent_to_faulty >= 1
    assert len(lost) == sent_to_faulty * GROUP_SIZE
    assert {r["server"] for r in lost} == {faulty.url}
    expected = FAULT_ERRORS[kind].format(url=faulty.url)
    assert all(len(r["errors"]) == 1 and r["errors"][0].startswith(expected) for r in lost), lost[0]["errors"]
    # The clean server produced every other rollout, one request per group.
    ok = [r for r in records if r["status"] == "ok"]
    assert {r["server"] for r in ok} == {clean.url}
    assert len(ok) == requests_received(clean) * GROUP_SIZE == PROMPTS * GROUP_SIZE - len(lost)


def test_a_server_dying_mid_run_costs_only_what_it_held(start_server, tmp_path, record_property):
    # A slow dying server (well within the request timeout): what it holds when it dies is still
    # in flight past the server's 1 s graceful shutdown, so really lost.
    dying = start_server(latency_s=4.0)
    survivor = start_server(latency_s=0.05)
    run_dir = RunDir(tmp_path)
    killer = after_first_commit(run_dir, dying.stop)
    run_rollouts(_config(tmp_path, request_timeout_s=30.0), [dying.url, survivor.url], with_trainer=False)
    killer.join()

    records = checked_windows(run_dir)
    record_outcome(record_property, run_dir, records)
    lost = errored(records)
    assert lost and {r["server"] for r in lost} == {dying.url}
    lost_groups = {r["group_id"] for r in lost}
    answered_groups = {r["group_id"] for r in records if r["status"] == "ok" and r["server"] == dying.url}
    # The groups that reached it but were never answered: held when it died. Only a few more can be
    # lost: those sent before it was taken out of selection.
    held_at_death = dying.requests_total - len(answered_groups)
    assert held_at_death >= 1
    assert held_at_death <= len(lost_groups) <= held_at_death + sent_before_taken_out(1)
    assert all(e.startswith(("InferenceConnectionError", "InferenceHTTPError")) for r in lost for e in r["errors"]), \
        {e for r in lost for e in r["errors"]}
    # Everything else was generated on the survivor; nothing after the death went to the dead server.
    assert all(r["server"] == survivor.url for r in records if r["group_id"] not in lost_groups | answered_groups)


def test_a_server_that_comes_back_gets_new_groups_again(start_server, tmp_path, record_property):
    faulty = start_server(error_rate=1.0)
    # The pool re-probes an unhealthy server once it has been out 5 s, on its 5 s refresh tick, so
    # recovery comes about 10 s in: one group at a time on a slow survivor keeps the run going
    # at least 40 x 0.3 = 12 s (a floor: a loaded machine only makes it longer).
    survivor = start_server(latency_s=0.3)
    run_dir = RunDir(tmp_path)
    switched: dict[str, float] = {}

    def switch_faults_off() -> None:
        # The faulty server is out of selection now (3 failures in a row), so nothing reaches it
        # between counting its requests and switching its faults off.
        switched["errored_requests"] = requests_received(faulty)
        switched["at"] = time.time()
        answer = httpx.post(f"{faulty.url}/faults", json={"error_rate": 0.0}, timeout=10)
        assert answer.status_code == 200, answer.text

    prompts = 40
    switcher = after_first_commit(run_dir, switch_faults_off)
    run_rollouts(_config(tmp_path, prompts=prompts, max_inflight=GROUP_SIZE), [faulty.url, survivor.url],
                 with_trainer=False)
    switcher.join()

    records = checked_windows(run_dir, prompts=prompts)
    record_outcome(record_property, run_dir, records)
    lost = errored(records)
    assert len(lost) == switched["errored_requests"] * GROUP_SIZE >= 3 * GROUP_SIZE
    assert {r["server"] for r in lost} == {faulty.url}
    assert all(r["t_sent"] < switched["at"] for r in lost)
    # Back in service after the re-probe: new groups went to it and came back ok.
    recovered = [r for r in records if r["server"] == faulty.url and r["status"] == "ok"]
    assert recovered and all(r["t_sent"] > switched["at"] for r in recovered)
    assert len(recovered) == (requests_received(faulty) - switched["errored_requests"]) * GROUP_SIZE


def test_all_servers_down_stops_the_run_with_the_limit_named_and_resume_finishes_it(
        start_server, tmp_path, record_property):
    servers = [start_server(latency_s=0.2), start_server(latency_s=0.2)]
    run_dir = RunDir(tmp_path)

    def kill_all() -> None:
        stopping = [threading.Thread(target=s.stop) for s in servers]
        for thread in stopping:
            thread.start()
        for thread in stopping:
            thread.join()

    killer = after_first_commit(run_dir, kill_all)
    # Enough prompts that groups are still waiting for a server when both are gone.
    prompts = 64
    config = _config(tmp_path, prompts=prompts, all_servers_down_timeout_s=3.0)
    with pytest.raises(Exception, match=r"past inference.all_servers_down_timeout_s = 3") as raised:
        run_rollouts(config, [s.url for s in servers], with_trainer=False)
    killer.join()
    assert "AllServersDownError: all 2 inference servers" in str(raised.value)
    failure = read_failure(run_dir.path)  # what the CLI shows: the typed record, not Beam's text
    assert (failure.error, failure.stage) == ("AllServersDownError", "dispatch")
    assert failure.message.startswith("all 2 inference servers") and failure.message in str(raised.value)

    committed = run_dir.committed_steps()
    assert committed == list(range(1, len(committed) + 1)) and committed
    before = {p: p.read_bytes() for p in run_dir.rollouts_dir.rglob("*") if p.is_file()}
    # Nothing committed is lost: a resumed run on fresh servers finishes the data, each group once.
    fresh = [start_server(), start_server()]
    run_rollouts(config, [s.url for s in fresh], with_trainer=False)
    records = checked_windows(run_dir, prompts=prompts)
    record_outcome(record_property, run_dir, records)
    record_property("steps_committed_before_the_stop", len(committed))
    assert all(p.read_bytes() == data for p, data in before.items() if p.parent.name in
               {f"step_{s}" for s in committed})
    # Only groups the dead servers held (or were sent before each was taken out of selection) were
    # lost, all counted; none after the resume.
    lost_groups = {r["group_id"] for r in errored(records)}
    assert {r["server"] for r in errored(records)} <= {s.url for s in servers}
    answered = {r["group_id"] for r in records if r["status"] == "ok" and r["server"] in {s.url for s in servers}}
    held_at_death = sum(s.requests_total for s in servers) - len(answered)
    assert len(lost_groups) <= held_at_death + sent_before_taken_out(len(servers))


def test_groups_after_the_last_batch_are_still_committed(start_server, tmp_path):
    # The hanging server holds one group until its timeout; the clean one answers the other four,
    # exactly one full step, long before that. The errored group arrives last, with nothing to train.
    hanging = start_server(hang_rate=1.0)
    clean = start_server()
    run_dir = RunDir(tmp_path)
    prompts = ROLLOUTS_PER_STEP // GROUP_SIZE + 1
    run_rollouts(_config(tmp_path, prompts=prompts, max_inflight=2 * GROUP_SIZE, request_timeout_s=3.0),
                 [hanging.url, clean.url], with_trainer=False)
    assert requests_received(hanging) == 1 and requests_received(clean) == prompts - 1  # the premise
    records = checked_windows(run_dir, prompts=prompts)
    assert len(errored(records)) == GROUP_SIZE


# -- a living fleet ---------------------------------------------------------------------------------


def _servers_in_status(run_dir: RunDir) -> dict[str, dict]:
    return {s["url"]: s for s in run_dir.read_status().get("servers", [])}


def test_a_server_added_and_one_removed_mid_run_with_beam_rl_servers_cost_no_rollout(start_server, tmp_path,
                                                                                     record_property):
    first = start_server(served_model_name="tiny", latency_s=0.3)
    second = start_server(served_model_name="tiny", latency_s=0.3)
    run_dir = RunDir(tmp_path)
    seen: dict[str, float] = {}

    def operate() -> None:
        # What an operator does: add a server once the run is going, take the first one out once the new one
        # answers; then note what the first had received once its shard let it go.
        seen["added"] = time.time()
        assert cli.main(["servers", "add", str(tmp_path), second.url]) == 0
        wait_for(lambda: _servers_in_status(run_dir).get(second.url, {}).get("join_to_first_request_s") is not None)
        assert cli.main(["servers", "remove", str(tmp_path), first.url]) == 0
        wait_for(lambda: first.url not in _servers_in_status(run_dir))
        seen["first_left_with_requests"] = requests_received(first)

    prompts = 48
    operator = after_first_commit(run_dir, operate)
    run_rollouts(_config(tmp_path, prompts=prompts, max_inflight=2 * GROUP_SIZE, discovery="file",
                         discovery_interval_s=0.5, drain_timeout_s=2.0), [first.url], with_trainer=False)
    operator.join()

    records = checked_windows(run_dir, prompts=prompts)  # contiguous steps, every group once and whole
    record_outcome(record_property, run_dir, records)
    assert errored(records) == [] and "first_left_with_requests" in seen, seen
    on_second = [r for r in records if r["server"] == second.url]
    assert on_second and all(r["t_sent"] > seen["added"] for r in on_second)
    assert requests_received(first) == seen["first_left_with_requests"]  # nothing reached it after it left
    assert {r["server"] for r in records} == {first.url, second.url}


def wait_for(condition: Callable[[], bool], deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, "the run never got there"
        time.sleep(0.05)
