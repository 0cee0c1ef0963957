"""What a user watches while a run goes on: the live progress table, refreshed until the rollout job and
the trainer are both done."""

from __future__ import annotations

import threading
import time

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape

from beam_rl.config import RunConfig
from beam_rl.job.rollouts import RolloutJob
from beam_rl.observe import RunObserver
from beam_rl.observe.report import LIVE_COLUMNS, RunTail, StepTable, error_lines, fitting_columns
from beam_rl.processes import Child, Supervisor
from beam_rl.rundir import RunDir

REFRESH_S = 0.5
TABLE_ROWS = 12  # the last steps the progress table shows


class PipelineWaiter:
    """Waits for the rollout job on a thread of its own, keeping the error it ended with."""

    def __init__(self, job: RolloutJob) -> None:
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._wait, args=(job,), name="beam-rl-pipeline", daemon=True)
        self._thread.start()

    def _wait(self, job: RolloutJob) -> None:
        try:
            job.wait()
        except BaseException as err:  # raised once the live display has closed
            self.error = err

    def running(self) -> bool:
        return self._thread.is_alive()


def follow(pipeline: PipelineWaiter, trainer: Child | None, parts: Supervisor, view: ProgressView) -> None:
    """Refresh the view until the pipeline and the trainer are both done; raise what stopped either."""
    try:
        with Live(view.render(), console=view.console, refresh_per_second=2) as live:
            while pipeline.running() or (trainer is not None and trainer.exit_code() is None):
                parts.raise_if_failed()
                if pipeline.error is not None:
                    break
                time.sleep(REFRESH_S)
                live.update(view.render())
            live.update(view.render())
    finally:
        if not view.console.is_terminal:
            view.console.line()  # a file or a pipe gets the last table without a newline after its caption
    if pipeline.error is not None:
        raise pipeline.error
    parts.raise_if_failed()  # a trainer that failed after the pipeline's end


class ProgressView:
    """The live table: the last steps (as many columns as the terminal is wide enough for), the run's
    state in the title and each server's load in the caption; under it, the newest causes of errored
    rollouts. Each render polls the run observer and reads only what the run directory gained since the
    last one."""

    def __init__(
        self, run_dir: RunDir, config: RunConfig, started: float, observer: RunObserver, console: Console
    ) -> None:
        self.console = console
        self._config = config
        self._started = started
        self._observer = observer
        self._tail = RunTail(run_dir, keep=TABLE_ROWS)
        self._last_step = 0

    def render(self) -> Group:
        self._observer.poll()
        rows = self._tail.update()
        self._last_step = rows[-1].step if rows else 0
        status = self._tail.run_dir.read_status()
        table = StepTable(
            fitting_columns(rows, LIVE_COLUMNS, self.console.width),
            title=self._title(status),
            caption=server_line(status),
        )
        for row in rows:
            table.add_step(row)
        return Group(table, *(f"[red]{escape(line)}[/red]" for line in error_lines(status)))

    def _title(self, status: dict) -> str:
        parts = [
            f"beam-rl {self._tail.run_dir.path}",
            f"{time.monotonic() - self._started:.0f}s",
            f"step {self._last_step} of {self._config.run.max_steps}",
            f"policy v{status.get('policy_version', 0)}",
            f"in flight {status.get('inflight', 0)}",
        ]
        if status.get("waiting_for_trainer"):
            parts.append("waiting for trainer")
        last_eval = self._tail.last_eval
        if last_eval is not None:
            figures = ", ".join(
                f"{env} pass@1 {e['pass@1']:.2f}" for env, e in last_eval["envs"].items() if e["pass@1"] is not None
            )
            parts.append(f"eval@{last_eval['after_step']}: {figures}")
        return "  |  ".join(parts)


def server_line(status: dict) -> str:
    """One entry per inference server: our rollouts on it, and its own running/waiting queue."""
    entries = []
    for server in status.get("servers", []):
        name = server["url"].rsplit("//", 1)[-1]
        queue = (
            f" (server: {server['running']:.0f} running, {server['waiting']:.0f} waiting)"
            if server.get("running") is not None
            else ""
        )
        health = "" if server.get("healthy", True) else " UNHEALTHY"
        entries.append(f"{name}: {server['inflight']} in flight{queue}{health}")
    return "  |  ".join(entries)
