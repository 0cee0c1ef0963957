"""Where a rollout's time goes, read back from the windows' timelines: each stage's latency (p50/p99, as a
table and a chart) and every inference server's requests over time (a Gantt-style lane per server)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
from rich.table import Table

from beam_rl.rundir import RunDir

if TYPE_CHECKING:
    from matplotlib.axes import Axes

# (stage, from stamp, to stamp), in the order a rollout goes through them (schemas/fields.py: the stamps).
PHASES: tuple[tuple[str, str, str], ...] = (
    ("queueing", "t_admitted", "t_sent"),
    ("generation", "t_sent", "t_finished"),
    ("time to first token", "t_sent", "t_first_token"),
    ("scoring", "t_finished", "t_scored"),
    ("packing", "t_scored", "t_packed"),
    ("commit", "t_packed", "t_committed"),
)
_COLUMNS = (
    "rollout_id",
    "status",
    "server",
    "t_admitted",
    "t_sent",
    "t_first_token",
    "t_finished",
    "t_scored",
    "t_packed",
    "t_committed",
)
# Rollouts on the Gantt chart, by status.
STATUS_COLORS = {"ok": "#2e7d32", "error": "#c62828", "reward_error": "#ef6c00", "cancelled": "#9e9e9e"}
TIMELINE_FILE = "timeline.png"


class StepRangeError(ValueError):
    pass


def parse_steps(text: str | None, committed: Sequence[int]) -> list[int]:
    """The committed steps a range names: "A:B" (both included), "A:", ":B", "N"; None: every step."""
    if not committed:
        raise StepRangeError("the run has no committed step")
    if text is None:
        return list(committed)
    first, sep, last = text.partition(":")
    try:
        lo = int(first) if first.strip() else committed[0]
        hi = (int(last) if last.strip() else committed[-1]) if sep else lo
    except ValueError:
        raise StepRangeError(f"--steps {text!r}: expected A:B, A:, :B or N (step numbers)") from None
    steps = [s for s in committed if lo <= s <= hi]
    if not steps:
        raise StepRangeError(
            f"--steps {text!r}: no committed step in {lo}..{hi} (committed: {committed[0]}..{committed[-1]})"
        )
    return steps


def read_timelines(run_dir: RunDir, steps: Sequence[int]) -> pa.Table:
    """The timeline columns of the windows of `steps`, one row per rollout, plus its step."""
    tables = []
    for step in steps:
        window = run_dir.read_window(step).select(list(_COLUMNS))
        tables.append(window.append_column("step", pa.array(np.full(window.num_rows, step, np.int64))))
    return pa.concat_tables(tables)


@dataclass(frozen=True)
class PhaseLatency:
    phase: str
    rollouts: int  # with both stamps
    p50_s: float | None
    p99_s: float | None
    max_s: float | None


def latency_breakdown(timelines: pa.Table) -> list[PhaseLatency]:
    """p50, p99 and max of every stage over the rollouts that went through it (both stamps present;
    generation and first token only for rollouts that were sent to a server)."""
    sent = np.array([s is not None for s in timelines.column("server").to_pylist()], dtype=bool)
    out = []
    for phase, start, end in PHASES:
        a, b = (_seconds(timelines.column(c)) for c in (start, end))
        spans = b - a
        keep = ~np.isnan(spans)
        if start == "t_sent":
            keep &= sent
        spans = spans[keep]
        if spans.size:
            p50, p99 = np.percentile(spans, [50, 99])
            out.append(PhaseLatency(phase, int(spans.size), float(p50), float(p99), float(spans.max())))
        else:
            out.append(PhaseLatency(phase, 0, None, None, None))
    return out


def _seconds(column: pa.ChunkedArray) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in column.to_pylist()], dtype=np.float64)


def latency_table(breakdown: Sequence[PhaseLatency], steps: Sequence[int]) -> Table:
    span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}..{steps[-1]}"
    table = Table(title=f"rollout latency, {span}")
    for column in ("stage", "rollouts", "p50", "p99", "max"):
        table.add_column(column, justify="left" if column == "stage" else "right")
    for row in breakdown:
        table.add_row(row.phase, str(row.rollouts), *(_duration(v) for v in (row.p50_s, row.p99_s, row.max_s)))
    return table


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.1f} ms" if abs(seconds) < 1 else f"{seconds:.2f} s"


@dataclass(frozen=True)
class Request:
    """One rollout's time on its server, and the row of its server's lane it is drawn on."""

    start: float
    end: float
    status: str
    level: int


def server_lanes(timelines: pa.Table) -> dict[str, list[Request]]:
    """Per server, its rollouts from t_sent to t_finished, each on the lowest free row of the lane, so
    the lane's height at any moment is the number of rollouts the server held (its concurrency)."""
    rows = timelines.select(["server", "t_sent", "t_finished", "status"]).to_pylist()
    by_server: dict[str, list[tuple[float, float, str]]] = {}
    for row in rows:
        if row["server"] is not None:
            by_server.setdefault(row["server"], []).append((row["t_sent"], row["t_finished"], row["status"]))
    lanes = {}
    for server, spans in sorted(by_server.items()):
        busy: list[tuple[float, int]] = []  # (end, level) of the requests still running
        free: list[int] = []
        placed = []
        for start, end, status in sorted(spans):
            while busy and busy[0][0] <= start:
                heapq.heappush(free, heapq.heappop(busy)[1])
            level = heapq.heappop(free) if free else len(busy)
            heapq.heappush(busy, (end, level))
            placed.append(Request(start, end, status, level))
        lanes[server] = placed
    return lanes


def write_timeline(
    run_dir: RunDir, steps: Sequence[int], timelines: pa.Table | None = None, path: Path | None = None
) -> Path:
    """The PNG beside report.png: the stages' p50/p99 on top, each server's requests over time below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    timelines = read_timelines(run_dir, steps) if timelines is None else timelines
    breakdown = latency_breakdown(timelines)
    lanes = server_lanes(timelines)
    path = path or run_dir.path / TIMELINE_FILE
    span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}..{steps[-1]}"
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(11, 4 + 1.6 * max(len(lanes), 1)), gridspec_kw={"height_ratios": [1.4, 1.6 * max(len(lanes), 1)]}
    )
    _draw_latency(top, breakdown)
    top.set_title(f"where a rollout's time goes ({span}, {timelines.num_rows} rollouts)")
    origin = _draw_lanes(bottom, lanes, timelines)
    bottom.set_title(
        "requests per inference server over time (a row per rollout in flight; dotted: a step committed)", pad=14
    )
    bottom.legend(
        handles=[Patch(color=c, label=s) for s, c in STATUS_COLORS.items()],
        loc="upper left",
        bbox_to_anchor=(1.005, 1),
        fontsize=8,
        title="status",
        title_fontsize=8,
    )
    top.set_xlabel("seconds (log scale)")
    if origin is not None:
        bottom.set_xlabel(f"seconds since the first request of {span}", labelpad=2)
    fig.suptitle(f"beam-rl run {run_dir.path.name}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _draw_latency(ax: Axes, breakdown: Sequence[PhaseLatency]) -> None:
    shown = [row for row in breakdown if row.rollouts]
    if not shown:
        ax.text(0.5, 0.5, "no rollout in this range", ha="center", transform=ax.transAxes)
        return
    y = np.arange(len(shown))
    # A log scale: queueing and packing take milliseconds, generation and commit seconds.
    floor = 1e-4
    p50 = [max(row.p50_s or 0.0, floor) for row in shown]  # a row with rollouts has its percentiles
    p99 = [max(row.p99_s or 0.0, floor) for row in shown]
    ax.barh(y - 0.2, p50, height=0.4, color="#1565c0", label="p50")
    ax.barh(y + 0.2, p99, height=0.4, color="#90caf9", label="p99")
    for i, row in enumerate(shown):
        ax.text(p99[i], i + 0.2, f" {_duration(row.p99_s)}", va="center", fontsize=7)
        ax.text(p50[i], i - 0.2, f" {_duration(row.p50_s)}", va="center", fontsize=7)
    ax.set_yticks(y, [f"{row.phase} ({row.rollouts})" for row in shown], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(right=max(p99) * 8)  # room for the labels
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.005, 1))


def _draw_lanes(ax: Axes, lanes: dict[str, list[Request]], timelines: pa.Table) -> float | None:
    """Each server a band of height 1, its rows of requests stacked inside; returns the time origin."""
    starts = [r.start for requests in lanes.values() for r in requests]
    if not starts:
        ax.text(0.5, 0.5, "no rollout was sent to a server in this range", ha="center", transform=ax.transAxes)
        return None
    origin = min(starts)
    names = []
    for lane, (server, requests) in enumerate(lanes.items()):
        depth = max(r.level for r in requests) + 1
        height = 0.9 / depth
        ax.barh(
            [lane + 0.05 + r.level * height for r in requests],
            [max(r.end - r.start, 1e-3) for r in requests],
            left=[r.start - origin for r in requests],
            height=height,
            align="edge",
            color=[STATUS_COLORS.get(r.status, "black") for r in requests],
            edgecolor="white",
            linewidth=0.3 if depth <= 64 else 0,
        )  # a thin gap tells requests apart while rows are thick enough
        names.append(f"{server.rsplit('//', 1)[-1]}\nup to {depth} in flight")
    ax.set_yticks(np.arange(len(names)) + 0.5, names, fontsize=8)
    ax.set_ylim(0, len(names))
    ax.invert_yaxis()
    # Where each step was committed: the steps' boundaries.
    commits = sorted(
        {
            (step, t)
            for step, t in zip(timelines.column("step").to_pylist(), timelines.column("t_committed").to_pylist())
            if t is not None
        }
    )
    for step, at in commits:
        ax.axvline(at - origin, color="black", linestyle=":", linewidth=0.6)
        ax.text(at - origin, 0, f"{step}", fontsize=6, ha="center", va="bottom")
    return origin
