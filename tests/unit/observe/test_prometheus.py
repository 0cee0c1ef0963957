"""The orchestrator's Prometheus endpoint, scraped over loopback with real HTTP and checked against the
run directory it follows; the Grafana dashboard only asks for metrics the endpoint exports."""

from __future__ import annotations

import json
import re
import socket

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from beam_rl.observe import RunObserver
from beam_rl.processes import free_port
from beam_rl.rundir import RunDir
from tests.support.observe_run import grow, observe_config, status
from tests.support.paths import REPO

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    response.raise_for_status()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def value(samples: Samples, metric: str, **labels: str) -> float:
    return samples[(metric, tuple(sorted(labels.items())))]


def observer_on(run: RunDir, **kwargs) -> RunObserver:
    config = observe_config(prometheus_port=free_port(), prometheus_host="127.0.0.1")
    return RunObserver(run, config, **kwargs)


def check_against_run_dir(samples: Samples, run: RunDir, state: dict) -> None:
    steps = run.committed_steps()
    commits = [run.read_commit(step) for step in steps]
    assert value(samples, "beam_rl_steps_committed") == steps[-1]
    assert value(samples, "beam_rl_groups_packed_total") == sum(c.counts.groups for c in commits)
    assert value(samples, "beam_rl_rollouts_observed_total") == sum(c.window.rollouts for c in commits)
    assert value(samples, "beam_rl_rollouts_trained_total") == sum(c.window.trained_rollouts for c in commits)
    for fate in ("trained", "filtered", "errored"):
        assert value(samples, "beam_rl_tokens_by_fate_total", fate=fate) == sum(
            c.window.tokens_by_fate[fate] for c in commits)
    assert value(samples, "beam_rl_step_figure", figure="reward/mean") == commits[-1].window.reward_mean
    assert value(samples, "beam_rl_lag_max_steps") == commits[-1].window.staleness_max
    assert value(samples, "beam_rl_last_commit_timestamp_seconds") == commits[-1].committed_at
    trainer = [m["trainer"] for m in run.read_metrics() if "trainer" in m][-1]
    assert value(samples, "beam_rl_trainer_step") == trainer["step"]
    assert value(samples, "beam_rl_trainer_figure", figure="trainer/loss") == trainer["loss"]
    last_eval = [m["eval"] for m in run.read_metrics() if "eval" in m][-1]
    assert value(samples, "beam_rl_eval_after_step") == last_eval["after_step"]
    assert value(samples, "beam_rl_eval_figure", figure="eval/arithmetic/pass@1") == last_eval["envs"]["arithmetic"]["pass@1"]

    # status.json: permits, per-server load as the servers report it, counters, policy version and lag.
    assert value(samples, "beam_rl_permits_in_use") == state["inflight"]
    assert value(samples, "beam_rl_permits_capacity") == state["max_inflight"]
    assert value(samples, "beam_rl_policy_version") == state["policy_version"]
    assert value(samples, "beam_rl_steps_ahead_of_policy") == steps[-1] - state["policy_version"]
    up, down = (server["url"].split("//")[1] for server in state["servers"])
    assert value(samples, "beam_rl_server_rollouts_in_flight", server=up) == state["servers"][0]["inflight"]
    assert value(samples, "beam_rl_server_rollouts_in_flight", server=down) == 0
    assert value(samples, "beam_rl_server_healthy", server=up) == 1 and value(samples, "beam_rl_server_healthy", server=down) == 0
    assert value(samples, "beam_rl_server_requests_running", server=up) == state["servers"][0]["running"]
    assert value(samples, "beam_rl_server_requests_waiting", server=up) == state["servers"][0]["waiting"]
    assert value(samples, "beam_rl_server_kv_cache_usage_ratio", server=up) == state["servers"][0]["kv_cache_usage"]
    # A server that reported no queue (unhealthy: never polled) has no queue samples rather than zeros.
    assert ("beam_rl_server_requests_running", (("server", down),)) not in samples
    assert value(samples, "beam_rl_groups_admitted_total") == state["groups_admitted"]
    assert value(samples, "beam_rl_rollouts_started_total") == state["started"]
    for status_name in ("ok", "errored", "cancelled"):
        assert value(samples, "beam_rl_rollouts_finished_total", status=status_name) == state[status_name]
    assert value(samples, "beam_rl_trainer_wait_seconds_total") == state["waited_for_trainer_s"]
    assert value(samples, "beam_rl_weight_reloads_total") == len(state["weight_reloads"])
    assert value(samples, "beam_rl_weight_reload_last_seconds") == state["weight_reloads"][-1]["seconds"]
    assert value(samples, "beam_rl_waiting_for_trainer") == 0


def test_the_endpoint_serves_what_the_run_directory_holds_as_the_run_grows(tmp_path):
    run = RunDir(tmp_path / "run")
    grow(run, range(1, 6))
    state = status(run, policy_version=4, groups_open=6, groups_emitted=34, prompts_per_s=12.5)
    counters = {"beam_rl/steps_committed": 5.0}
    with observer_on(run, beam_counters=lambda: counters) as observer:
        # Nothing read from the run directory yet: only the runner's counters, read at the scrape.
        assert scrape(observer.prometheus_port) == {("beam_rl_beam_counter", (("name", "beam_rl/steps_committed"),)): 5}
        observer.poll()
        samples = scrape(observer.prometheus_port)
        check_against_run_dir(samples, run, state)
        assert value(samples, "beam_rl_groups_open") == 6 and value(samples, "beam_rl_groups_emitted_total") == 34
        # A numeric status field without a name of its own still shows, under its field name.
        assert value(samples, "beam_rl_status", field="prompts_per_s") == 12.5
        assert value(samples, "beam_rl_beam_counter", name="beam_rl/steps_committed") == 5

        grow(run, range(6, 9))
        state = status(run, policy_version=7)
        counters["beam_rl/steps_committed"] = 8.0  # the runner's counters are read at each scrape
        observer.poll()
        samples = scrape(observer.prometheus_port)
        check_against_run_dir(samples, run, state)
        assert value(samples, "beam_rl_beam_counter", name="beam_rl/steps_committed") == 8
        assert ("beam_rl_groups_open", ()) not in samples  # no longer in status.json
    with pytest.raises(httpx.ConnectError):
        scrape(observer.prometheus_port)  # close() stopped serving


def test_a_scrape_answers_when_the_runners_counters_cannot_be_read(tmp_path, caplog):
    run = RunDir(tmp_path / "run")
    grow(run, range(1, 3))
    state = status(run, policy_version=1)

    def broken() -> dict[str, float]:
        raise ConnectionError("Flink REST API unreachable")

    with observer_on(run, beam_counters=broken) as observer:
        observer.poll()
        samples = scrape(observer.prometheus_port)
    assert value(samples, "beam_rl_permits_in_use") == state["inflight"]
    assert not any(name == "beam_rl_beam_counter" for name, _ in samples)
    assert "reading the runner's counters failed" in caplog.text


def test_the_grafana_dashboard_asks_only_for_exported_metrics(tmp_path):
    run = RunDir(tmp_path / "run")
    grow(run, range(1, 4))
    status(run, policy_version=2, groups_open=3, groups_emitted=20)
    with observer_on(run, beam_counters=lambda: {"beam_rl/steps_committed": 3.0}) as observer:
        observer.poll()
        exported = {name for name, _ in scrape(observer.prometheus_port)}

    dashboard = json.loads((REPO / "docs" / "grafana-dashboard.json").read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    assert len(expressions) >= 15
    for expr in expressions:
        names = set(re.findall(r"\bbeam_rl_[a-z0-9_]+", expr))
        assert names, f"no beam-rl metric in {expr!r}"
        assert names <= exported, f"{expr!r} asks for {sorted(names - exported)}, not exported"
    # Every panel reads the chosen Prometheus data source and is placed on the grid.
    for panel in dashboard["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"} and panel["gridPos"]["w"] > 0


def test_a_port_in_use_is_a_clear_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = observe_config(prometheus_port=port, prometheus_host="127.0.0.1")
        with pytest.raises(OSError, match=f"logging.prometheus_port = {port}: cannot serve /metrics on 127.0.0.1:{port}"):
            RunObserver(RunDir(tmp_path / "run"), config)
