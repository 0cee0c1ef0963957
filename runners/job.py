"""The main job: inference servers + the rollout pipeline + (optionally) the reference trainer,
with a live progress display, until max_steps are trained."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time

from rich.console import Console
from rich.live import Live
from rich.table import Table

from beam_rl.config import RunConfig
from beam_rl.report import RunTail, write_plot
from beam_rl.rundir import RunDir
from beam_rl.servers import inference_servers
from runners.pipeline import start_rollouts

REFRESH_S = 0.5
TABLE_ROWS = 12  # the last steps the progress table shows


def progress_table(tail: RunTail, config: RunConfig, started: float) -> Table:
    """Called every REFRESH_S for days: `tail` reads only what the run directory gained since the last call."""
    run_dir = tail.run_dir
    status = run_dir.read_status()
    rows = tail.update()
    last_eval = ""
    if tail.last_eval is not None:
        figures = ", ".join(f"{env} pass@1 {e['pass@1']:.2f}" for env, e in tail.last_eval["envs"].items()
                            if e["pass@1"] is not None)
        last_eval = f"  |  eval@{tail.last_eval['after_step']}: {figures}"
    table = Table(title=(
        f"beam-rl  {run_dir.path}  |  {time.monotonic() - started:.0f}s  |  policy v{status.get('policy_version', 0)}"
        f"  |  in flight {status.get('inflight', 0)}"
        + ("  |  waiting for trainer" if status.get("waiting_for_trainer") else "") + last_eval))
    for column in ("step", "reward", "rollouts/s", "trained", "errored", "filtered", "lag max", "loss", "trainer wait s"):
        table.add_column(column, justify="right")
    table.caption = server_line(status)
    for row in rows:
        trainer = row.trainer or {}
        table.add_row(
            f"{row.step}/{config.run.max_steps}",
            f"{row.reward_mean:.3f}" if row.reward_mean is not None else "-",
            f"{row.rollouts_per_s:.1f}" if row.rollouts_per_s else "-",
            str(row.trained), str(row.errored),
            str(sum(row.filtered.values())),
            str(row.staleness_max if row.staleness_max is not None else "-"),
            f"{trainer['loss']:.4f}" if "loss" in trainer else "-",
            f"{trainer['wait_s']:.1f}" if "wait_s" in trainer else "-",
        )
    return table


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


def _start_trainer(run_dir: RunDir) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "beam_rl.cli", "train", "--run-dir", str(run_dir.path)]
    log = open(run_dir.path / "trainer.log", "ab")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def run_job(config: RunConfig, console: Console | None = None) -> RunDir:
    console = console or Console()
    run_dir = RunDir(config.run.dir)
    run_dir.check_writable()  # before any server starts
    run_dir.write_config(config.model_dump(mode="json"))
    started = time.monotonic()
    trainer: subprocess.Popen | None = None
    with inference_servers(config) as urls:
        console.print(f"inference servers: {', '.join(urls)}; runner: {config.runner.name}; run dir: {run_dir.path}")
        job = start_rollouts(config, urls, str(run_dir.path), with_trainer=True)
        if threading.current_thread() is threading.main_thread():
            # Beam's job-server wrapper installs a SIGINT handler that fails when called; Ctrl-C
            # must reach this loop as KeyboardInterrupt so everything below is stopped in order.
            signal.signal(signal.SIGINT, signal.default_int_handler)
        pipeline_error: list[BaseException] = []

        def wait_pipeline() -> None:
            try:
                job.wait()
            except BaseException as err:  # shown after the live display closes
                pipeline_error.append(err)

        waiter = threading.Thread(target=wait_pipeline, name="beam-rl-pipeline", daemon=True)
        waiter.start()
        if config.trainer.kind == "reference":
            trainer = _start_trainer(run_dir)
        tail = RunTail(run_dir, keep=TABLE_ROWS)
        try:
            with Live(progress_table(tail, config, started), console=console, refresh_per_second=2) as live:
                while waiter.is_alive() or (trainer is not None and trainer.poll() is None):
                    if trainer is not None and trainer.poll() not in (None, 0):
                        raise RuntimeError(f"the trainer exited with {trainer.returncode}; see {run_dir.path}/trainer.log")
                    if pipeline_error:
                        break
                    time.sleep(REFRESH_S)
                    live.update(progress_table(tail, config, started))
                live.update(progress_table(tail, config, started))
        except KeyboardInterrupt:
            with contextlib.suppress(Exception):  # Ctrl-C reached the runner's process too
                job.cancel()
            raise
        except BaseException:
            job.cancel()
            raise
        finally:
            if trainer is not None and trainer.poll() is None:
                trainer.terminate()
                trainer.wait(timeout=30)
    if pipeline_error:
        raise pipeline_error[0]
    plot = write_plot(run_dir)
    console.print(f"done in {time.monotonic() - started:.0f}s; steps under {run_dir.rollouts_dir}; plot {plot}")
    return run_dir
