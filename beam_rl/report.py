"""Per-step figures of a run, read back from its run directory: the progress table and the PNG plot."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from beam_rl.rundir import RunDir


@dataclass
class StepRow:
    step: int
    committed_at: float
    rollouts: int
    trained: int
    reward_mean: float | None
    errored: int
    filtered: dict[str, int]
    policy_version_min: int | None
    staleness_max: int | None
    rollouts_per_s: float | None  # window rollouts / time since the previous commit
    trainer: dict[str, Any] | None = None
    permits_in_use: float | None = None  # mean share of max_inflight running since the previous commit
    server_inflight: dict[str, float] | None = None  # mean rollouts running per server, same span


def _dispatch_means(samples: list[dict[str, Any]]) -> tuple[float | None, dict[str, float] | None]:
    if not samples:
        return None, None
    share = sum(d["inflight"] / d["max_inflight"] for d in samples) / len(samples)
    per_server: dict[str, list[int]] = {}
    for d in samples:
        for server in d["servers"]:
            per_server.setdefault(server["url"], []).append(server["inflight"])
    return share, {url: sum(v) / len(v) for url, v in per_server.items()}


def step_rows(run_dir: RunDir, metrics: list[dict[str, Any]] | None = None) -> list[StepRow]:
    """One row per committed step; `metrics` are the run's metrics.jsonl records when already read."""
    metrics = run_dir.read_metrics() if metrics is None else metrics
    trainer = {m["trainer"]["step"]: m["trainer"] for m in metrics if "trainer" in m}
    dispatch = sorted((m["dispatch"] for m in metrics if "dispatch" in m), key=lambda d: d["t"])
    rows: list[StepRow] = []
    previous: float | None = None
    for step in run_dir.committed_steps():
        commit = run_dir.read_commit(step)
        window = commit["window"]
        at = commit["committed_at"]
        rate = window.get("rollouts", 0) / (at - previous) if previous is not None and at > previous else None
        # The dispatcher's load samples since the previous commit; the last one before, if none.
        span = [d for d in dispatch if (previous is None or d["t"] > previous) and d["t"] <= at]
        span = span or [d for d in dispatch if d["t"] <= at][-1:]
        share, per_server = _dispatch_means(span)
        previous = at
        rows.append(StepRow(
            step=step, committed_at=at, rollouts=window.get("rollouts", 0),
            trained=window.get("trained_rollouts", 0), reward_mean=window.get("reward_mean"),
            errored=window.get("errored", 0), filtered=window.get("filtered", {}),
            policy_version_min=window.get("policy_version_min"), staleness_max=window.get("staleness_max"),
            rollouts_per_s=rate, trainer=trainer.get(step), permits_in_use=share, server_inflight=per_server))
    return rows


def write_plot(run_dir: RunDir, path: Path | None = None) -> Path:
    """reward, off-policy lag, throughput and dispatcher utilization per step, as one PNG beside the
    run's metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = step_rows(run_dir)
    path = path or run_dir.path / "report.png"
    steps = [r.step for r in rows]
    fig, axes = plt.subplots(4, 1, figsize=(7, 10), sharex=True)
    axes[0].plot(steps, [r.reward_mean if r.reward_mean is not None else float("nan") for r in rows], "o-")
    axes[0].set_ylabel("mean reward")
    axes[1].plot(steps, [r.staleness_max if r.staleness_max is not None else float("nan") for r in rows], "o-")
    axes[1].set_ylabel("max lag in window")  # filtered-as-stale rollouts included
    axes[2].plot(steps, [r.rollouts_per_s or float("nan") for r in rows], "o-")
    axes[2].set_ylabel("rollouts / s")
    nan = float("nan")
    axes[3].plot(steps, [100 * r.permits_in_use if r.permits_in_use is not None else nan for r in rows], "o-",
                 label="permits in use (% of max_inflight)")
    urls = sorted({url for r in rows for url in (r.server_inflight or {})})
    for url in urls:
        axes[3].plot(steps, [(r.server_inflight or {}).get(url, nan) for r in rows], ".--",
                     label=f"{url.rsplit('//', 1)[-1]}: rollouts in flight")
    axes[3].set_ylabel("utilization")
    axes[3].legend(fontsize=7)
    axes[3].set_xlabel("step")
    fig.suptitle(f"beam-rl run {run_dir.path.name}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
