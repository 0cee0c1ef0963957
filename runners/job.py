"""The main job: inference servers, the rollout pipeline and (optionally) the reference trainer, as the
parts of one supervisor, with a live progress table and the run observer until max_steps are trained."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape

from beam_rl.config import RunConfig
from beam_rl.observe import RunObserver
from beam_rl.observe.report import LIVE_COLUMNS, RunTail, StepTable, error_lines, fitting_columns, write_plot
from beam_rl.observe.rollout_text import tracker_sample_rows
from beam_rl.processes import Child, Supervisor
from beam_rl.rundir import RunDir
from beam_rl.servers import inference_servers
from runners.rollout_job import RolloutJob, attach_rollouts, start_rollouts

REFRESH_S = 0.5
TABLE_ROWS = 12  # the last steps the progress table shows
SAMPLE_ROLLOUTS = 8  # rollouts of each committed step in W&B's samples table


def run_job(config: RunConfig, console: Console | None = None) -> RunDir:
    console = console or Console()
    run_dir = RunDir(config.run.dir)
    run_dir.check_writable()  # before any server starts
    run_dir.write_config(config.model_dump(mode="json"))
    started = time.monotonic()
    # First: a Prometheus port in use fails here, before anything else starts.
    jobs: list[RolloutJob] = []  # the rollout job, once submitted: its Beam counters go to Prometheus
    observer = RunObserver(run_dir, config, sample_rows=tracker_sample_rows(run_dir, config.model.name, SAMPLE_ROLLOUTS),
                           beam_counters=lambda: jobs[0].counters() if jobs else {})
    with Supervisor() as parts:
        parts.add("run observer", observer.close)
        urls = parts.enter("inference servers", inference_servers(config))
        console.print(f"inference servers: {', '.join(urls)}; runner: {config.runner.name}; run dir: {run_dir.path}")
        job = _rollout_job(config, urls, run_dir, console)
        jobs.append(job)
        parts.add("rollout job", job.cancel)
        if threading.current_thread() is threading.main_thread():
            # Beam's job-server wrapper installs a SIGINT handler that fails when called; Ctrl-C, and
            # SIGTERM alike, must reach this loop as KeyboardInterrupt so the parts are stopped in order.
            signal.signal(signal.SIGINT, _interrupt)
            signal.signal(signal.SIGTERM, _interrupt)
        pipeline = _Waiter(job)
        trainer = None
        if config.trainer.kind == "reference":
            trainer = parts.start("trainer", [sys.executable, "-m", "beam_rl.cli", "train", "--run-dir", str(run_dir.path)],
                                  run_dir.path / "trainer.log")
        _follow(pipeline, trainer, parts, _ProgressView(run_dir, config, started, observer, console))
    plot = write_plot(run_dir)
    console.print(f"done in {time.monotonic() - started:.0f}s; steps under {run_dir.rollouts_dir}; plot {plot}")
    return run_dir


class Interrupted(KeyboardInterrupt):
    """The job was stopped by a signal (Ctrl-C's SIGINT, or SIGTERM); `signal` names it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signal = signal.Signals(signum)


def _interrupt(signum: int, _frame) -> None:
    raise Interrupted(signum)


def _rollout_job(config: RunConfig, urls: list[str], run_dir: RunDir, console: Console) -> RolloutJob:
    """The job a dead submitter left running for this run directory on its Flink cluster, when its
    servers are still there; else a new one."""
    attached = attach_rollouts(config, str(run_dir.path))
    if attached is not None:
        if config.inference.urls:
            console.print(f"following the rollout job still running for {run_dir.path} (job.json)")
            return attached
        # Its embedded servers died with the process that started it: it could only wait for them.
        console.print("cancelling the rollout job left running: its embedded inference servers are gone")
        attached.cancel()
        with contextlib.suppress(RuntimeError):  # "ended as CANCELED before the run was over"
            attached.wait()
    return start_rollouts(config, urls, str(run_dir.path), with_trainer=True)


class _Waiter:
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


def _follow(pipeline: _Waiter, trainer: Child | None, parts: Supervisor, view: _ProgressView) -> None:
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


class _ProgressView:
    """The live table: the last steps (as many columns as the terminal is wide enough for), the run's
    state in the title and each server's load in the caption; under it, the newest causes of errored
    rollouts. Each render polls the run observer and reads only what the run directory gained since the
    last one."""

    def __init__(self, run_dir: RunDir, config: RunConfig, started: float, observer: RunObserver,
                 console: Console) -> None:
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
        table = StepTable(fitting_columns(rows, LIVE_COLUMNS, self.console.width),
                          title=self._title(status), caption=server_line(status))
        for row in rows:
            table.add_step(row)
        return Group(table, *(f"[red]{escape(line)}[/red]" for line in error_lines(status)))

    def _title(self, status: dict) -> str:
        parts = [f"beam-rl {self._tail.run_dir.path}", f"{time.monotonic() - self._started:.0f}s",
                 f"step {self._last_step} of {self._config.run.max_steps}",
                 f"policy v{status.get('policy_version', 0)}", f"in flight {status.get('inflight', 0)}"]
        if status.get("waiting_for_trainer"):
            parts.append("waiting for trainer")
        last_eval = self._tail.last_eval
        if last_eval is not None:
            figures = ", ".join(f"{env} pass@1 {e['pass@1']:.2f}" for env, e in last_eval["envs"].items()
                                if e["pass@1"] is not None)
            parts.append(f"eval@{last_eval['after_step']}: {figures}")
        return "  |  ".join(parts)


def server_line(status: dict) -> str:
    """One entry per inference server: our rollouts on it, and its own running/waiting queue."""
    entries = []
    for server in status.get("servers", []):
        name = server["url"].rsplit("//", 1)[-1]
        queue = (f" (server: {server['running']:.0f} running, {server['waiting']:.0f} waiting)"
                 if server.get("running") is not None else "")
        health = "" if server.get("healthy", True) else " UNHEALTHY"
        entries.append(f"{name}: {server['inflight']} in flight{queue}{health}")
    return "  |  ".join(entries)


