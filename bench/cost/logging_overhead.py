"""All logging on against all off, side by side on the small bench's pipeline (figure 3's run: instant servers,
1,024 rollouts of 256 tokens, 128 a step, Prism):

    .venv/bin/python -m bench.cost.logging_overhead --pairs 6 --out bench/cost/logging_overhead.json

"On" is W&B offline (with its samples table: beam_rl.observe.rollout_text.tracker_sample_rows), TensorBoard and
Prometheus /metrics scraped once a second. The bench's pipeline (beam_rl.job.rollouts.run_rollouts) has no
run observer; the job (beam_rl/job/run.py) polls one every 0.5 s in the orchestrator's process beside the
pipeline, so it runs here likewise, on a thread, then is closed. Runs alternate off, on, off, on, ... on the same servers. Per run: the
pipeline's wall time and sustained rollouts/s; the CPU of this process tree (Prism and W&B's service
process included, the inference servers not) per rollout, with and without opening the trackers (once
per process: W&B starts its service); and the observer's own CPU per committed step (its thread's CPU
time, plus W&B's service process, measured while it runs; closing it is reported apart). Then where the
difference lies: each thread's CPU during the runs, on minus off, and the observer's first poll of a
finished run of the same bench, with and without W&B's samples table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from beam_rl.config import LoggingSection, config_from_dict
from beam_rl.observe import RunObserver
from beam_rl.observe.rollout_text import tracker_sample_rows
from beam_rl.rundir import RunDir
from bench.common import procs
from bench.common.pipeline import SIZES, bench_config

POLL_S = 0.5
SCRAPE_S = 1.0


def thread_cpu() -> dict[int, tuple[str, float]]:
    """native thread id -> (name with numbers generalised, e.g. "Thread-N (run)"; CPU seconds so far) of this
    process's live Python threads."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for thread in threading.enumerate():
        try:
            with open(f"/proc/self/task/{thread.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, TypeError):
            continue
        out[thread.native_id] = (re.sub(r"\d+", "N", thread.name), (int(fields[11]) + int(fields[12])) / tick)
    return out


def thread_cpu_since(before: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each (generalised) thread name spent since `before`, over the threads alive now."""
    out: dict[str, float] = {}
    for tid, (name, cpu) in thread_cpu().items():
        out[name] = out.get(name, 0.0) + cpu - before.get(tid, (name, 0.0))[1]
    return out


def poll_cost(run_dir: Path, with_samples: bool) -> float:
    """CPU ms per step of the observer's first poll of a finished run (W&B offline + TensorBoard), with or
    without W&B's samples table; trackers' files are made afresh each time."""
    for name in ("wandb", "tensorboard"):
        shutil.rmtree(run_dir / name, ignore_errors=True)
    config = config_from_dict({"envs": [{"name": "arithmetic"}],
                               "logging": {"wandb": {"mode": "offline"}, "tensorboard": {"enabled": True}}})
    rundir = RunDir(run_dir)
    observer = RunObserver(rundir, config, sample_rows=tracker_sample_rows(rundir, "tiny") if with_samples else None)
    c0 = time.process_time()
    observer.poll()
    cpu = time.process_time() - c0
    observer.close()
    return round(1000 * cpu / len(rundir.committed_steps()), 2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Follower(threading.Thread):
    """The run observer on a thread, as the job runs it, plus a Prometheus scraper."""

    def __init__(self, observer: RunObserver, server_pids: set[int]) -> None:
        super().__init__(daemon=True, name="run-observer")
        self.observer = observer
        self.server_pids = server_pids
        self.stop = threading.Event()
        self.thread_cpu_s = 0.0
        self.service_cpu_s = 0.0  # W&B's service process (and any other child the observer started)
        self.scrapes = 0
        self._children0 = self._children_cpu()

    def _children_cpu(self) -> float:
        pids = [p for p in procs.tree_pids(os.getpid(), self.server_pids) if p != os.getpid()
                and procs.name(p) not in ("prism",)]
        return procs.cpu_s(pids)

    def run(self) -> None:
        start = time.thread_time()
        last_scrape = 0.0
        while not self.stop.is_set():
            self.observer.poll()
            if time.monotonic() - last_scrape >= SCRAPE_S:
                url = f"http://127.0.0.1:{self.observer.prometheus_port}/metrics"
                with urllib.request.urlopen(url, timeout=5) as response:
                    response.read()
                self.scrapes += 1
                last_scrape = time.monotonic()
            self.stop.wait(POLL_S)
        self.observer.poll()  # the last steps
        self.thread_cpu_s = time.thread_time() - start
        time.sleep(0.5)  # let W&B's service take what the last poll handed it
        self.service_cpu_s = self._children_cpu() - self._children0


def one_run(size: dict[str, Any], urls: list[str], server_pids: set[int], logging_on: bool,
            keep: Path | None = None) -> dict[str, Any]:
    """One pipeline run, with all logging on or all off; `keep`: copy its run directory there."""
    from beam_rl.job.rollouts import run_rollouts  # Beam: only where a pipeline runs

    with tempfile.TemporaryDirectory(prefix="bench-logging-") as run_dir:
        config = bench_config(run_dir, urls, size, "direct")
        if logging_on:
            config = config.model_copy(update={"logging": LoggingSection.model_validate({
                "wandb": {"mode": "offline"}, "tensorboard": {"enabled": True},
                "prometheus_port": _free_port(), "prometheus_host": "127.0.0.1"})})
        rundir = RunDir(run_dir)
        threads0 = thread_cpu()
        cpu0 = procs.cpu_s(procs.tree_pids(os.getpid(), server_pids))
        t0 = time.time()
        follower, open_cpu = None, 0.0
        if logging_on:
            observer = RunObserver(rundir, config, sample_rows=tracker_sample_rows(rundir, config.model.name))
            open_cpu = procs.cpu_s(procs.tree_pids(os.getpid(), server_pids)) - cpu0  # imports at the first
            follower = _Follower(observer, server_pids)
            follower.start()
        run_rollouts(config, urls, with_trainer=False)
        wall = time.time() - t0
        threads = thread_cpu_since(threads0)
        observer_figures = {}
        if follower is not None:
            follower.stop.set()
            follower.join()
            cpu_before_close = procs.cpu_s(procs.tree_pids(os.getpid(), server_pids))
            c0 = time.process_time()
            follower.observer.close()
            observer_figures = {"close_cpu_s": round(time.process_time() - c0, 3),
                                "close_tree_cpu_s": round(procs.cpu_s(procs.tree_pids(os.getpid(), server_pids))
                                                          - cpu_before_close, 3)}
        cpu = procs.cpu_s(procs.tree_pids(os.getpid(), server_pids)) - cpu0
        steps = rundir.committed_steps()
        commits = [rundir.read_commit(s) for s in steps]
        rollouts = sum(c.window.rollouts for c in commits)
        first_sent = min(min(rundir.read_window(s).column("t_sent").to_pylist()) for s in steps)
        if keep is not None:
            shutil.copytree(run_dir, keep)
        result = {
            "logging": "on" if logging_on else "off",
            "steps": len(steps),
            "rollouts": rollouts,
            "wall_s": round(wall, 2),
            "rollouts_per_s_sustained": round(rollouts / (commits[-1].committed_at - first_sent), 1),
            "tree_cpu_ms_per_rollout": round(1000 * cpu / rollouts, 3),
            # Without opening the trackers (W&B starts its service): once per process, not per step.
            "tree_cpu_ms_per_rollout_after_open": round(1000 * (cpu - open_cpu) / rollouts, 3),
            "thread_cpu_s": {name: round(v, 3) for name, v in sorted(threads.items())},
        }
        if follower is not None:
            result |= {
                "open_tree_cpu_s": round(open_cpu, 3),
                "observer_thread_cpu_ms_per_step": round(1000 * follower.thread_cpu_s / len(steps), 2),
                "wandb_service_cpu_ms_per_step": round(1000 * follower.service_cpu_s / len(steps), 2),
                "scrapes": follower.scrapes,
                "wandb_files": sum(1 for _ in (rundir.path / "wandb").rglob("*") if _.is_file()),
                "tensorboard_files": sum(1 for _ in (rundir.path / "tensorboard").rglob("*") if _.is_file()),
                **observer_figures,
            }
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    size = SIZES[args.size]
    runs: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="bench-logging-keep-"))
    try:
        with procs.servers(size["pipeline_servers"], "instant", 1024) as (urls, server_pids):
            for pair in range(args.pairs):
                for logging_on in (False, True):
                    keep = work / "run" if pair == 0 and not logging_on else None
                    runs.append(one_run(size, urls, set(server_pids), logging_on, keep))
                    print(json.dumps(runs[-1]), flush=True)
        # Where the observer's CPU goes: its first poll of a finished run of the same bench, per step.
        poll = {"with_samples_table": poll_cost(work / "run", True),
                "without_samples_table": poll_cost(work / "run", False)}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def median(key: str, logging: str) -> float:
        return statistics.median(r[key] for r in runs if r["logging"] == logging)

    summary = {}
    for key in ("wall_s", "rollouts_per_s_sustained", "tree_cpu_ms_per_rollout", "tree_cpu_ms_per_rollout_after_open"):
        off, on = median(key, "off"), median(key, "on")
        summary[key] = {"off": off, "on": on, "on_over_off": round(on / off, 3)}
    for key in ("open_tree_cpu_s", "observer_thread_cpu_ms_per_step", "wandb_service_cpu_ms_per_step", "close_cpu_s"):
        summary[key] = median(key, "on")
    # Per thread name, CPU per step of "on" runs minus "off" runs (medians): where the difference is.
    names = sorted({name for r in runs for name in r["thread_cpu_s"]})
    summary["thread_cpu_ms_per_step_on_minus_off"] = {
        name: round(statistics.median(1000 * r["thread_cpu_s"].get(name, 0.0) / r["steps"]
                                      for r in runs if r["logging"] == "on")
                    - statistics.median(1000 * r["thread_cpu_s"].get(name, 0.0) / r["steps"]
                                        for r in runs if r["logging"] == "off"), 2)
        for name in names}
    summary["observer_first_poll_cpu_ms_per_step"] = poll
    pairs = [(runs[i], runs[i + 1]) for i in range(0, len(runs), 2)]
    summary["tree_cpu_per_rollout_on_over_off_by_pair"] = [
        round(on["tree_cpu_ms_per_rollout_after_open"] / off["tree_cpu_ms_per_rollout"], 3) for off, on in pairs]
    results = {"command": f"python -m bench.cost.logging_overhead --pairs {args.pairs} --size {args.size}",
               "size": args.size, "pairs": args.pairs, "machine_cpus": os.cpu_count(), "summary": summary,
               "runs": runs}
    print(json.dumps(results["summary"], indent=2))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
