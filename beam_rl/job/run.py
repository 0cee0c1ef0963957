"""The main job: inference servers, the rollout pipeline and (optionally) the reference trainer, as the
parts of one supervisor, with a live progress table and the run observer until max_steps are trained."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
from types import FrameType

from rich.console import Console

from beam_rl.config import RunConfig
from beam_rl.job.live import PipelineWaiter, ProgressView, follow
from beam_rl.job.rollouts import RolloutJob, attach_rollouts, start_rollouts
from beam_rl.job.servers import inference_servers
from beam_rl.observe import RunObserver
from beam_rl.observe.report import write_plot
from beam_rl.observe.rollout_text import tracker_sample_rows
from beam_rl.processes import Supervisor
from beam_rl.rundir import RunDir
from beam_rl.wiring import JobParts, job_parts

SAMPLE_ROLLOUTS = 8  # rollouts of each committed step in W&B's samples table


def run_job(config: RunConfig, console: Console | None = None) -> RunDir:
    console = console or Console()
    run_dir = RunDir(config.run.dir)
    run_dir.check_writable()  # before any server starts
    run_dir.write_config(config.model_dump(mode="json"))
    started = time.monotonic()
    # First: a Prometheus port in use fails here, before anything else starts.
    jobs: list[RolloutJob] = []  # the rollout job, once submitted: its Beam counters go to Prometheus
    observer = RunObserver(
        run_dir,
        config,
        sample_rows=tracker_sample_rows(run_dir, config.model.name, SAMPLE_ROLLOUTS),
        beam_counters=lambda: jobs[0].counters() if jobs else {},
    )
    with Supervisor() as parts:
        parts.add("run observer", observer.close)
        wired = job_parts(config)  # the job's parts, built once: the servers' key, the schedule
        urls = parts.enter("inference servers", inference_servers(wired))
        console.print(f"inference servers: {', '.join(urls)}; runner: {config.runner.name}; run dir: {run_dir.path}")
        job = _rollout_job(wired, urls, run_dir, console)
        jobs.append(job)
        parts.add("rollout job", job.cancel)
        if threading.current_thread() is threading.main_thread():
            # Beam's job-server wrapper installs a SIGINT handler that fails when called; Ctrl-C, and
            # SIGTERM alike, must reach this loop as KeyboardInterrupt so the parts are stopped in order.
            signal.signal(signal.SIGINT, _interrupt)
            signal.signal(signal.SIGTERM, _interrupt)
        pipeline = PipelineWaiter(job)
        trainer = None
        if config.trainer.kind == "reference":
            trainer = parts.start(
                "trainer",
                [sys.executable, "-m", "beam_rl.cli", "train", "--run-dir", str(run_dir.path)],
                run_dir.path / "trainer.log",
            )
        follow(pipeline, trainer, parts, ProgressView(run_dir, config, started, observer, console))
    plot = write_plot(run_dir)
    console.print(f"done in {time.monotonic() - started:.0f}s; steps under {run_dir.rollouts_dir}; plot {plot}")
    return run_dir


class Interrupted(KeyboardInterrupt):
    """The job was stopped by a signal (Ctrl-C's SIGINT, or SIGTERM); `signal` names it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signal = signal.Signals(signum)


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    raise Interrupted(signum)


def _rollout_job(wired: JobParts, urls: list[str], run_dir: RunDir, console: Console) -> RolloutJob:
    """The job a dead submitter left running for this run directory on its Flink cluster, when its
    servers are still there; else a new one."""
    config = wired.config
    attached = attach_rollouts(config, str(run_dir.path), parts=wired)
    if attached is not None:
        if config.inference.urls:
            console.print(f"following the rollout job still running for {run_dir.path} (job.json)")
            return attached
        # Its embedded servers died with the process that started it: it could only wait for them.
        console.print("cancelling the rollout job left running: its embedded inference servers are gone")
        attached.cancel()
        with contextlib.suppress(RuntimeError):  # "ended as CANCELED before the run was over"
            attached.wait()
    return start_rollouts(config, urls, str(run_dir.path), with_trainer=True, parts=wired)
