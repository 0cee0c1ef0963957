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


def step_rows(run_dir: RunDir) -> list[StepRow]:
    trainer = {m["trainer"]["step"]: m["trainer"] for m in run_dir.read_metrics() if "trainer" in m}
    rows: list[StepRow] = []
    previous: float | None = None
    for step in run_dir.committed_steps():
        commit = run_dir.read_commit(step)
        window = commit["window"]
        at = commit["committed_at"]
        rate = window.get("rollouts", 0) / (at - previous) if previous is not None and at > previous else None
        previous = at
        rows.append(StepRow(
            step=step, committed_at=at, rollouts=window.get("rollouts", 0),
            trained=window.get("trained_rollouts", 0), reward_mean=window.get("reward_mean"),
            errored=window.get("errored", 0), filtered=window.get("filtered", {}),
            policy_version_min=window.get("policy_version_min"), staleness_max=window.get("staleness_max"),
            rollouts_per_s=rate, trainer=trainer.get(step)))
    return rows


def write_plot(run_dir: RunDir, path: Path | None = None) -> Path:
    """reward, off-policy lag and throughput per step, as one PNG beside the run's metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = step_rows(run_dir)
    path = path or run_dir.path / "report.png"
    steps = [r.step for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(7, 8), sharex=True)
    axes[0].plot(steps, [r.reward_mean if r.reward_mean is not None else float("nan") for r in rows], "o-")
    axes[0].set_ylabel("mean reward")
    axes[1].plot(steps, [r.staleness_max if r.staleness_max is not None else float("nan") for r in rows], "o-")
    axes[1].set_ylabel("max lag in window")  # filtered-as-stale rollouts included
    axes[2].plot(steps, [r.rollouts_per_s or float("nan") for r in rows], "o-")
    axes[2].set_ylabel("rollouts / s")
    axes[2].set_xlabel("step")
    fig.suptitle(f"beam-rl run {run_dir.path.name}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
