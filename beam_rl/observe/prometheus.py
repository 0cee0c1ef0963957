"""Prometheus /metrics for a running job: a collector that turns the run observer's last snapshot (and
the runner's counters) into metric families at each scrape."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from beam_rl.listeners import warn_if_open
from beam_rl.observe.figures import server_name
from beam_rl.observe.snapshot import BeamCounters, Snapshot

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer


_LOG = logging.getLogger(__name__)
PREFIX = "beam_rl_"

# status.json fields with a name of their own: field -> (metric, help). Numeric fields not named here
# are exported too, as beam_rl_status{field="..."}, so new ones show up without a code change.
STATUS_GAUGES = {
    "inflight": ("permits_in_use", "Rollouts in flight, each holding one permit."),
    "max_inflight": ("permits_capacity", "Permits: the cap on rollouts in flight (inference.max_inflight)."),
    "inflight_cap": ("inflight_cap", "The in-flight cap now: max_inflight, or what dispatch.concurrency chose."),
    "policy_version": ("policy_version", "The policy version new rollouts start on."),
    "healthy_servers": ("healthy_servers", "Inference servers taking requests."),
    "waiting_for_trainer": ("waiting_for_trainer", "1 while the source holds back for the trainer (max_async_level)."),
    "groups_open": ("groups_open", "Groups admitted whose rollouts are not all back yet."),
    "all_servers_down_for_s": ("all_servers_down_seconds", "How long every inference server has been unhealthy."),
    "updated_at": ("status_updated_timestamp_seconds", "When the orchestrator last wrote its status (Unix time)."),
}
STATUS_COUNTERS = {
    "groups_admitted": ("groups_admitted", "Groups the source admitted to dispatch."),
    "groups_emitted": ("groups_emitted", "Complete groups that left dispatch."),
    "started": ("rollouts_started", "Rollouts sent to an inference server."),
    "rollouts_emitted": ("rollouts_emitted", "Rollouts that left dispatch, whatever their status."),
    "cancelled_stale_groups": ("stale_groups_cancelled", "Groups cancelled as too stale after a weight update."),
    "skipped_consumed_groups": ("consumed_groups_skipped", "Groups skipped on resume: a committed step holds them."),
    "waited_for_trainer_s": ("trainer_wait_seconds", "Time the source held back for the trainer."),
    "waited_for_sink_s": ("sink_wait_seconds", "Time the source held back for the packer and writer."),
}
ROLLOUT_STATUSES = ("ok", "errored", "cancelled")  # status.json counters of finished rollouts
_STATUS_OTHER = frozenset({*ROLLOUT_STATUSES, "servers", "weight_reloads", "errors"})
SERVER_GAUGES = {  # per server, from status.json's "servers" (running/waiting/KV: the server's own /metrics)
    "inflight": ("server_rollouts_in_flight", "Our rollouts running on the server."),
    "healthy": ("server_healthy", "1 while the server takes requests."),
    "running": ("server_requests_running", "Requests the server is running (vLLM num_requests_running)."),
    "waiting": ("server_requests_waiting", "Requests queued on the server (vLLM num_requests_waiting)."),
    "kv_cache_usage": (
        "server_kv_cache_usage_ratio",
        "The server's KV-cache usage, 0 to 1 (vLLM kv_cache_usage_perc).",
    ),
    "draining": ("server_draining", "1 while the server, gone from the fleet, finishes what it runs."),
    "joined_at": ("server_joined_timestamp_seconds", "When the server took its first requests in this run."),
    "join_s": ("server_join_seconds", "From being listed in the fleet to holding the current weights."),
}


class RunCollector(Collector):
    """Reads the observer's snapshot at scrape time: no gauge is ever set by hand."""

    def __init__(self, snapshot: Callable[[], Snapshot], beam_counters: BeamCounters | None = None) -> None:
        self._snapshot = snapshot
        self._beam_counters = beam_counters

    def collect(self) -> Iterator[Metric]:
        snapshot = self._snapshot()  # one poll's consistent view
        yield from _status_metrics(snapshot.status)
        yield from _run_metrics(snapshot)
        if self._beam_counters is not None:
            try:
                counters = dict(self._beam_counters())
            except Exception:  # a scrape must still answer with the rest
                _LOG.warning("reading the runner's counters failed", exc_info=True)
            else:
                yield _labelled(
                    GaugeMetricFamily,
                    "beam_counter",
                    "The Beam runner's counters (name: namespace/name).",
                    "name",
                    counters,
                )


def serve(
    snapshot: Callable[[], Snapshot], beam_counters: BeamCounters | None, host: str, port: int
) -> tuple[WSGIServer, int]:
    """Serve /metrics on host:port from a registry of its own; returns the server and the bound port. A host
    beyond loopback is warned about: the run's figures, to whoever reaches it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RunCollector(snapshot, beam_counters))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    _LOG.info("Prometheus metrics on http://%s:%d/metrics", host, server.server_port)
    warn_if_open(
        host,
        server.server_port,
        "Prometheus /metrics: the run's figures, servers and counters, to whoever reaches it, unauthenticated",
        "logging.prometheus_host",
    )
    return server, server.server_port


def _status_metrics(status: Mapping[str, Any]) -> Iterator[Metric]:
    for key, (name, doc) in STATUS_GAUGES.items():
        if _is_number(status.get(key)):
            yield GaugeMetricFamily(PREFIX + name, doc, value=float(status[key]))
    for key, (name, doc) in STATUS_COUNTERS.items():
        if _is_number(status.get(key)):
            yield CounterMetricFamily(PREFIX + name, doc, value=float(status[key]))
    finished = {s: float(status[s]) for s in ROLLOUT_STATUSES if _is_number(status.get(s))}
    if finished:
        yield _labelled(
            CounterMetricFamily, "rollouts_finished", "Rollouts that came back, by status.", "status", finished
        )
    causes = {e["cause"]: float(e["count"]) for e in status.get("errors") or () if isinstance(e, Mapping)}
    if causes:  # status.json's errors (beam_rl/source/status.py:ErrorTally): an alert can name the cause
        yield _labelled(
            CounterMetricFamily, "rollout_errors", "Errored rollouts, by cause (the error's type).", "cause", causes
        )
    reloads = status.get("weight_reloads")
    if isinstance(reloads, list):
        yield CounterMetricFamily(
            PREFIX + "weight_reloads", "Weight reloads on the inference servers.", value=len(reloads)
        )
        if reloads:
            yield GaugeMetricFamily(
                PREFIX + "weight_reload_last_seconds",
                "How long the last weight reload took.",
                value=float(reloads[-1]["seconds"]),
            )
    servers = [s for s in status.get("servers") or () if isinstance(s, Mapping) and "url" in s]
    for key, (name, doc) in SERVER_GAUGES.items():
        values = {server_name(s["url"]): float(s[key]) for s in servers if _is_number(s.get(key))}
        if values:
            yield _labelled(GaugeMetricFamily, name, doc, "server", values)
    other = {
        key: float(value)
        for key, value in status.items()
        if key not in STATUS_GAUGES and key not in STATUS_COUNTERS and key not in _STATUS_OTHER and _is_number(value)
    }
    if other:
        yield _labelled(
            GaugeMetricFamily, "status", "Other numeric fields of the orchestrator's status.", "field", other
        )


def _run_metrics(snapshot: Snapshot) -> Iterator[Metric]:
    if snapshot.steps_committed:
        yield GaugeMetricFamily(PREFIX + "steps_committed", "The last committed step.", value=snapshot.steps_committed)
        yield GaugeMetricFamily(
            PREFIX + "last_commit_timestamp_seconds",
            "When the last step was committed.",
            value=snapshot.last_committed_at,
        )
        for name, value in snapshot.totals.items():
            yield CounterMetricFamily(
                PREFIX + name, f"Sum over committed steps ({name.replace('_', ' ')}).", value=value
            )
        yield _labelled(
            GaugeMetricFamily,
            "step_figure",
            "The last committed step's figures (as the trackers name them).",
            "figure",
            snapshot.step,
        )
        if "lag/max" in snapshot.step:
            yield GaugeMetricFamily(
                PREFIX + "lag_max_steps",
                "Largest policy lag (staleness) in the last step's window.",
                value=snapshot.step["lag/max"],
            )
        if _is_number(snapshot.status.get("policy_version")):
            yield GaugeMetricFamily(
                PREFIX + "steps_ahead_of_policy",
                "Committed steps the trainer has not published a policy for yet.",
                value=snapshot.steps_committed - snapshot.status["policy_version"],
            )
    if snapshot.tokens_by_fate:
        yield _labelled(
            CounterMetricFamily,
            "tokens_by_fate",
            "Tokens generated, by what became of them.",
            "fate",
            snapshot.tokens_by_fate,
        )
    if snapshot.trainer_step:
        yield GaugeMetricFamily(
            PREFIX + "trainer_step", "The last step the trainer trained.", value=snapshot.trainer_step
        )
        yield _labelled(
            GaugeMetricFamily, "trainer_figure", "The trainer's figures of its last step.", "figure", snapshot.trainer
        )
    if snapshot.eval_after_step:
        yield GaugeMetricFamily(
            PREFIX + "eval_after_step", "The step after which the last eval round ran.", value=snapshot.eval_after_step
        )
        yield _labelled(
            GaugeMetricFamily,
            "eval_figure",
            "The last eval round's figures (eval/<env>/<figure>).",
            "figure",
            snapshot.eval,
        )


def _labelled(family: type, name: str, doc: str, label: str, values: Mapping[str, float]) -> Metric:
    metric = family(PREFIX + name, doc, labels=[label])
    for key, value in values.items():
        metric.add_metric([key], float(value))
    return metric


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float))  # bool included: healthy, waiting_for_trainer
