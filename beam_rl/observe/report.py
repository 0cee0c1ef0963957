"""Per-step figures of a run, read back from its run directory: one row type (`StepRow`) and one
table of it for every view (the live progress display, `beam-rl inspect`, `beam-rl report`), and the
PNG plot."""

from __future__ import annotations

from bisect import bisect_right, insort
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from beam_rl.packing import goodput
from beam_rl.rundir import CommitRecord, MetricsTail, RunDir


@dataclass
class StepRow:
    step: int
    committed_at: float
    rollouts: int
    trained: int
    tokens: int  # packed tokens, prompts included
    reward_mean: float | None
    errored: int
    filtered: dict[str, int]
    policy_version_min: int | None
    staleness_max: int | None
    tokens_by_fate: dict[str, int]  # generated tokens whose fate this step decided (beam_rl/packing/goodput.py)
    rollouts_per_s: float | None = None  # window rollouts / time since the previous commit
    trainer: dict[str, Any] | None = None
    permits_in_use: float | None = None  # mean share of max_inflight running since the previous commit
    server_inflight: dict[str, float] | None = None  # mean rollouts running per server, same span

    @classmethod
    def from_commit(cls, commit: CommitRecord, **derived: Any) -> StepRow:
        """The step's own figures; `derived` adds what needs other records (rate, trainer, load)."""
        window = commit.window
        return cls(
            step=commit.step,
            committed_at=commit.committed_at,
            rollouts=window.rollouts,
            trained=window.trained_rollouts,
            tokens=commit.counts.tokens,
            reward_mean=window.reward_mean,
            errored=window.errored,
            filtered=dict(window.filtered),
            policy_version_min=window.policy_version_min,
            staleness_max=window.staleness_max,
            tokens_by_fate=dict(window.tokens_by_fate),
            **derived,
        )

    @property
    def goodput(self) -> float | None:
        """Trained tokens over the tokens whose fate this step decided; None when it decided none."""
        return goodput.goodput(self.tokens_by_fate)


@dataclass(frozen=True)
class StepColumn:
    header: str
    cell: Callable[[StepRow], str]


def _trainer(key: str, spec: str) -> Callable[[StepRow], str]:
    return lambda row: format((row.trainer or {})[key], spec) if key in (row.trainer or {}) else "-"


# Every column a step table can show, in the order they are shown.
STEP_COLUMNS: dict[str, StepColumn] = {
    c.header: c
    for c in (
        StepColumn("step", lambda r: str(r.step)),
        StepColumn("rollouts", lambda r: str(r.rollouts)),
        StepColumn("trained", lambda r: str(r.trained)),
        StepColumn("tokens", lambda r: str(r.tokens)),
        StepColumn("reward mean", lambda r: f"{r.reward_mean or 0.0:.3f}"),
        StepColumn("errored", lambda r: str(r.errored)),
        StepColumn("filtered", lambda r: ", ".join(f"{k}={v}" for k, v in sorted(r.filtered.items())) or "0"),
        StepColumn("lag max", lambda r: "" if r.staleness_max is None else str(r.staleness_max)),
        StepColumn("good", lambda r: "-" if r.goodput is None else f"{100 * r.goodput:.0f}%"),
        StepColumn("rollouts/s", lambda r: f"{r.rollouts_per_s:.1f}" if r.rollouts_per_s else "-"),
        StepColumn("permits used", lambda r: "-" if r.permits_in_use is None else f"{100 * r.permits_in_use:.0f}%"),
        StepColumn("loss", _trainer("loss", ".4f")),
        StepColumn("trainer wait s", _trainer("wait_s", ".1f")),
    )
}
# `beam-rl inspect` and `beam-rl report`: what the commit records alone hold.
COMMITTED_COLUMNS = ("step", "rollouts", "trained", "tokens", "reward mean", "errored", "filtered", "lag max", "good")
# The live table, most wanted first: as many as the terminal is wide enough for (`fitting_columns`).
LIVE_COLUMNS = (
    "step",
    "reward mean",
    "rollouts/s",
    "trained",
    "lag max",
    "good",
    "loss",
    "errored",
    "filtered",
    "trainer wait s",
    "rollouts",
    "tokens",
    "permits used",
)


class StepTable(Table):
    """A rich table of StepRows showing `columns` (names in STEP_COLUMNS), in STEP_COLUMNS' order."""

    def __init__(self, columns: Iterable[str], **table_args: Any) -> None:
        super().__init__(**table_args)
        wanted = set(columns)
        self.step_columns = [column for name, column in STEP_COLUMNS.items() if name in wanted]
        for column in self.step_columns:
            self.add_column(column.header, justify="right")

    def add_step(self, row: StepRow) -> None:
        self.add_row(*(column.cell(row) for column in self.step_columns))


def fitting_columns(rows: Sequence[StepRow], columns: Sequence[str], width: int) -> list[str]:
    """The longest prefix of `columns` whose table, with these rows, fits in `width` characters: each
    column takes its widest cell or header plus two of padding and one of border."""
    kept, used = [], 1
    for name in columns:
        column = STEP_COLUMNS[name]
        need = max([len(column.header), *(len(column.cell(row)) for row in rows)]) + 3
        if used + need > width:
            break
        kept.append(name)
        used += need
    return kept


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
    dispatch = sorted((m["dispatch"] for m in metrics if "dispatch" in m), key=_time)
    commits = (run_dir.read_commit(step) for step in run_dir.committed_steps())
    return _rows(commits, None, dispatch, trainer)


class RunTail:
    """What the live progress display shows of a run directory, kept current by reading only what the
    run gained since the last `update`: the new lines of metrics.jsonl and the commit records of the
    steps committed since. Memory stays bounded however long the run: the last `keep` steps' commit
    records (plus the one before, for its commit time), their trainer records, and the dispatch
    samples from the commit before the first shown step on."""

    def __init__(self, run_dir: RunDir, keep: int) -> None:
        self.run_dir = run_dir
        self.keep = keep
        self.last_eval: dict[str, Any] | None = None
        self._metrics = MetricsTail(run_dir.metrics_path)
        self._commits: deque[CommitRecord] = deque(maxlen=keep + 1)
        self._next_step: int | None = None  # the step whose commit record comes next
        self._trainer: dict[int, dict[str, Any]] = {}
        self._dispatch: list[dict[str, Any]] = []  # sorted by time, as in `step_rows`

    def update(self) -> list[StepRow]:
        """Read what is new; the rows of the last `keep` committed steps, equal to `step_rows`' last ones."""
        # Commits before metrics: the dispatch samples taken before a commit seen are then written too.
        self._read_new_commits()
        for record in self._metrics.read_new():
            if "trainer" in record:
                self._trainer[record["trainer"]["step"]] = record["trainer"]
            if "dispatch" in record:
                insort(self._dispatch, record["dispatch"], key=_time)
            if "eval" in record:
                self.last_eval = record["eval"]
        commits = list(self._commits)
        if len(commits) <= self.keep:
            return _rows(commits, None, self._dispatch, self._trainer)  # every step since the first
        before = commits.pop(0)
        self._forget_before(before)
        return _rows(commits, before.committed_at, self._dispatch, self._trainer)

    def _read_new_commits(self) -> None:
        if self._next_step is None:
            # Listing the step directories costs O(all steps): once. Then steps commit in order
            # (`RunDir.next_step`), so probing the next one finds each new commit.
            steps = self.run_dir.committed_steps()
            self._commits.extend(self.run_dir.read_commit(step) for step in steps[-(self.keep + 1) :])
            self._next_step = steps[-1] + 1 if steps else 1
        while self.run_dir.is_committed(self._next_step):
            self._commits.append(self.run_dir.read_commit(self._next_step))
            self._next_step += 1

    def _forget_before(self, commit: CommitRecord) -> None:
        """Drop what no shown row needs: `commit` is the one before the first shown step."""
        self._trainer = {step: record for step, record in self._trainer.items() if step > commit.step}
        # The last sample at or before that commit stays: a step with no sample of its own shows it.
        at_or_before = bisect_right(self._dispatch, commit.committed_at, key=_time)
        del self._dispatch[: max(at_or_before - 1, 0)]


def _time(sample: dict[str, Any]) -> float:
    return sample["t"]


def _rows(
    commits: Iterable[CommitRecord],
    previous: float | None,
    dispatch: list[dict[str, Any]],
    trainer: dict[int, dict[str, Any]],
) -> list[StepRow]:
    """One row per commit record, in step order. `previous`: the commit time of the step before the first
    (None: the first is the run's first); `dispatch`: load samples sorted by time."""
    times = [d["t"] for d in dispatch]
    rows: list[StepRow] = []
    for commit in commits:
        at = commit.committed_at
        rate = commit.window.rollouts / (at - previous) if previous is not None and at > previous else None
        # The dispatcher's load samples since the previous commit; the last one before, if none.
        end = bisect_right(times, at)
        start = 0 if previous is None else bisect_right(times, previous)
        share, per_server = _dispatch_means(dispatch[start:end] or dispatch[max(end - 1, 0) : end])
        previous = at
        rows.append(
            StepRow.from_commit(
                commit,
                rollouts_per_s=rate,
                trainer=trainer.get(commit.step),
                permits_in_use=share,
                server_inflight=per_server,
            )
        )
    return rows


def error_lines(status: dict[str, Any], limit: int = 3) -> list[str]:
    """The newest causes of errored rollouts in a run's live status (RunDir.read_status), one line each:
    the cause, how many, and its newest example (which names the environment and row)."""
    return [
        f"{entry['count']} errored: {entry['cause']}; the newest: {entry['example']}"
        for entry in status.get("errors", [])[:limit]
    ]


def weight_update_summary(metrics: list[dict[str, Any]]) -> str | None:
    """The run's weight updates in one line: how many, in which modes, the engine time each took from
    each server (paused, or loading in reload mode) and the rollouts they made too stale; None before any."""
    updates = [m["weight_update"] for m in metrics if "weight_update" in m]
    per_server = [s for u in updates for s in u["servers"]]
    if not per_server:
        return None
    idle = [s["engine_idle_s"] for s in per_server]
    modes = "/".join(sorted({s["mode"] for s in per_server}))
    return (
        f"weight updates: {len(updates)} ({modes}); engine time lost per update and server: "
        f"mean {sum(idle) / len(idle):.3f} s, max {max(idle):.3f} s; stale rollouts regenerated "
        f"{sum(u['regenerated_rollouts'] for u in updates)}, cancelled "
        f"{sum(u['cancelled_stale_rollouts'] for u in updates)}"
    )


def plot_tokens_by_fate(ax: Any, rows: list[StepRow]) -> None:
    """Generated tokens per step stacked by fate (trained at the bottom), and goodput on its own axis."""
    steps = [r.step for r in rows]
    fates = sorted({f for r in rows for f in r.tokens_by_fate}, key=lambda f: (f != goodput.TRAINED, f))
    bottom = [0] * len(rows)
    for fate in fates:
        heights = [r.tokens_by_fate.get(fate, 0) for r in rows]
        ax.bar(steps, heights, bottom=bottom, label=fate)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel("tokens by fate")
    if fates:
        ax.legend(fontsize=7, loc="upper left")
    share = ax.twinx()
    share.plot(steps, [r.goodput if r.goodput is not None else float("nan") for r in rows], "k.-")
    share.set_ylim(0, 1.05)
    share.set_ylabel("goodput")


def write_plot(run_dir: RunDir, path: Path | None = None) -> Path:
    """reward, off-policy lag, throughput, dispatcher utilization and tokens by fate per step, as one PNG
    beside the run's metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = step_rows(run_dir)
    path = path or run_dir.path / "report.png"
    steps = [r.step for r in rows]
    fig, axes = plt.subplots(5, 1, figsize=(7, 12.5), sharex=True)
    axes[0].plot(steps, [r.reward_mean if r.reward_mean is not None else float("nan") for r in rows], "o-")
    axes[0].set_ylabel("mean reward")
    axes[1].plot(steps, [r.staleness_max if r.staleness_max is not None else float("nan") for r in rows], "o-")
    axes[1].set_ylabel("max lag in window")  # filtered-as-stale rollouts included
    axes[2].plot(steps, [r.rollouts_per_s or float("nan") for r in rows], "o-")
    axes[2].set_ylabel("rollouts / s")
    nan = float("nan")
    axes[3].plot(
        steps,
        [100 * r.permits_in_use if r.permits_in_use is not None else nan for r in rows],
        "o-",
        label="permits in use (% of max_inflight)",
    )
    urls = sorted({url for r in rows for url in (r.server_inflight or {})})
    for url in urls:
        axes[3].plot(
            steps,
            [(r.server_inflight or {}).get(url, nan) for r in rows],
            ".--",
            label=f"{url.rsplit('//', 1)[-1]}: rollouts in flight",
        )
    axes[3].set_ylabel("utilization")
    axes[3].legend(fontsize=7)
    plot_tokens_by_fate(axes[4], rows)
    axes[4].set_xlabel("step")
    fig.suptitle(f"beam-rl run {run_dir.path.name}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
