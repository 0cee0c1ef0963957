"""The per-step figures of a run, named for the trackers: every numeric leaf of a record under a stable
"section/path" name, the figures an RL engineer looks at first under short explicit names."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from beam_rl.packing.goodput import goodput

Figures = dict[str, float]

# The three streams of per-step records, each on the trainer-step axis: a committed step's record
# (COMMIT.json), the trainer's record of training that step, and a held-out eval round after it.
ROLLOUTS, TRAINER, EVAL = "rollouts", "trainer", "eval"
STREAMS = (ROLLOUTS, TRAINER, EVAL)

# Explicit names for the headline figures of a step's window (every rollout since the previous step).
WINDOW_NAMES = {
    "reward_mean": "reward/mean",
    "staleness_max": "lag/max",
    "policy_version_min": "policy/version_min",
    "policy_version_max": "policy/version_max",
    "rollouts": "rollouts/seen",
    "trained_rollouts": "rollouts/trained",
    "errored": "rollouts/errored",
}
# Window keys holding a dict of counts or statistics get a chart section of their own
# ("filtered/zero_advantage", "goodput/trained", ...); others land under "rollouts/".
WINDOW_SECTIONS = frozenset({"filtered", "flagged", "goodput", "tokens_by_fate", "advantages", "lag", "latency"})
# Parts of the commit record and where their leaves go; the rest of it (ids, offsets, files) is not a figure.
COMMIT_SECTIONS = {"counts": "batch", "timings": "timings", "extra": "extra"}
_NOT_FIGURES = frozenset({"step", "schema_version", "record_version", "after_step"})


def numeric_leaves(record: Mapping[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], float]]:
    """(path, value) for every int, float or bool leaf of nested dicts. Lists are not figures (per-rank
    counts, id lists); absolute times (keys ending in "_at") are not either: a chart of them says nothing,
    and TensorBoard's float32 would round them to minutes."""
    for key, value in record.items():
        key = str(key)
        if isinstance(value, Mapping):
            yield from numeric_leaves(value, (*path, key))
        elif isinstance(value, (int, float)) and not key.endswith("_at"):
            yield (*path, key), float(value)


def step_figures(
    commit: Mapping[str, Any], previous_committed_at: float | None = None, dispatch: Sequence[Mapping[str, Any]] = ()
) -> Figures:
    """A committed step's figures from its commit record.

    `previous_committed_at`: the commit time of the step before (None for a run's first step): gives the
    throughput since then. `dispatch`: the dispatcher's load samples ({"t", "inflight", "max_inflight",
    "servers"}) taken since then: gives the mean share of permits in use and rollouts per server.
    """
    figures: Figures = {}
    for path, value in numeric_leaves(commit.get("window") or {}):
        if path[0] in _NOT_FIGURES:
            continue
        if len(path) == 1 and path[0] in WINDOW_NAMES:
            figures[WINDOW_NAMES[path[0]]] = value
        elif len(path) > 1 and path[0] in WINDOW_SECTIONS:
            figures["/".join(path)] = value
        else:
            figures["rollouts/" + "/".join(path)] = value
    share = goodput((commit.get("window") or {}).get("tokens_by_fate") or {})
    if share is not None:
        figures["goodput/trained_share"] = share  # of the tokens whose fate the step decided
    for part, section in COMMIT_SECTIONS.items():
        for path, value in numeric_leaves(commit.get(part) or {}):
            figures[f"{section}/{'/'.join(path)}"] = value
    committed_at = commit.get("committed_at")
    if previous_committed_at is not None and committed_at is not None and committed_at > previous_committed_at:
        interval = committed_at - previous_committed_at
        figures["throughput/step_interval_s"] = interval
        figures["throughput/rollouts_per_s"] = (commit.get("window") or {}).get("rollouts", 0) / interval
        figures["throughput/tokens_per_s"] = (commit.get("counts") or {}).get("tokens", 0) / interval
    if dispatch:
        figures["dispatch/permits_in_use"] = sum(d["inflight"] / d["max_inflight"] for d in dispatch) / len(dispatch)
        per_server: dict[str, list[float]] = {}
        for sample in dispatch:
            for server in sample.get("servers", ()):
                per_server.setdefault(server_name(server["url"]), []).append(server["inflight"])
        for name, values in per_server.items():
            figures[f"dispatch/rollouts_in_flight/{name}"] = sum(values) / len(values)
    return figures


def trainer_figures(record: Mapping[str, Any]) -> Figures:
    """The trainer's figures of one step: "trainer/<key>" for each numeric one (loss, grad_norm, ...)."""
    return {"trainer/" + "/".join(path): value for path, value in numeric_leaves(record) if path[0] not in _NOT_FIGURES}


def eval_figures(record: Mapping[str, Any]) -> Figures:
    """A held-out eval round's figures: "eval/<env>/<key>" (pass@1, mean_reward, ...) per environment."""
    figures: Figures = {}
    for path, value in numeric_leaves(record):
        if path[0] in _NOT_FIGURES:
            continue
        figures["eval/" + "/".join(path[1:] if path[0] == "envs" else path)] = value
    return figures


def server_name(url: str) -> str:
    """host:port of a server URL: short, and free of the '//' that would nest a tracker's sections."""
    return url.rsplit("//", 1)[-1].rstrip("/")
