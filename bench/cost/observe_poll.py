"""The run observer's CPU per poll on a run directory of N committed steps, beside re-reading it whole.

    .venv/bin/python -m bench.cost.observe_poll --steps 1000 --out bench/cost/observe_poll.json

CPU is the observer process tree's (user + system: W&B's service process included), per
configuration: no tracker (Prometheus snapshot only), TensorBoard, TensorBoard + W&B offline. Figures:
opening the trackers, the first poll (reads the whole run), an idle poll (nothing new), and a poll
after one more step (a commit, a trainer record, two load samples, a status update): the CPU of a loop
that grows the run and polls, minus the same loop without polls, per step. Beside it, what re-reading
the run whole costs (`beam_rl.observe.report.step_rows`: every commit record and all of metrics.jsonl).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from beam_rl.config import config_from_dict
from beam_rl.observe import RunObserver
from beam_rl.observe.report import step_rows
from beam_rl.rundir import RunDir
from beam_rl.types import TrainBatch
from bench.common.procs import cpu_s, tree_pids

CONFIGS = {
    "none": {},
    "tensorboard": {"tensorboard": {"enabled": True}},
    "tensorboard+wandb": {"tensorboard": {"enabled": True}, "wandb": {"mode": "offline"}},
}


def window(step: int) -> dict:
    """A step's window stats shaped as the packer writes them: 64 rollouts in 8 groups."""
    return {
        "step": step, "rollouts": 64, "status": {"ok": 62, "error": 2, "cancelled": 0}, "errored": 2,
        "filtered": {"zero_advantage": step % 4}, "flagged": {"zero_advantage": step % 4},
        "trained_rollouts": 56, "reward_mean": 0.1 + step / 10_000, "completion_tokens_mean": 7.5,
        "policy_version_min": step - 2, "policy_version_max": step - 1, "staleness_max": 1,
        "samples": 56, "tokens": 2_000, "micro_batches": [2],
        "group_ids": [f"e0-i{8 * step + g}" for g in range(8)],
    }


def add_step(run: RunDir, step: int) -> None:
    """What the pipeline and the trainer write for one step (transforms/write.py, trainer.py, the source)."""
    servers = [{"url": f"http://127.0.0.1:{8000 + i}", "inflight": 30 + i, "healthy": True} for i in range(2)]
    for _ in range(2):
        run.append_metrics({"dispatch": {"t": time.time(), "inflight": 62, "max_inflight": 64, "servers": servers}})
    w = window(step)
    run.write_step(TrainBatch(step=step, micro_batches=[], group_ids=w["group_ids"], window=w),
                   offsets=[("arithmetic", 0, 8 * step + g) for g in range(8)],
                   extra={"last_rollout_finished_at": time.time()})
    run.append_metrics({"step": step, "committed_at": time.time(), **w})
    if step > 1:
        run.append_metrics({"trainer": {"step": step - 1, "policy_version": step - 1, "loss": 0.5, "grad_norm": 1.0,
                                        "clip_fraction": 0.01, "tokens": 2_000, "wait_s": 0.1, "compute_s": 1.0}})
    if step % 5 == 0:
        run.append_metrics({"eval": {"after_step": step, "policy_version": step,
                                     "envs": {"arithmetic": {"prompts": 20, "mean_reward": 0.2, "pass@1": 0.1}}}})
    run.write_status({"updated_at": time.time(), "policy_version": step - 1, "inflight": 62, "max_inflight": 64,
                      "servers": [{**s, "running": 30.0, "waiting": 0.0, "kv_cache_usage": 0.2} for s in servers],
                      "started": 64 * step, "ok": 62 * step, "errored": 2 * step, "cancelled": 0})


def tree_cpu() -> float:
    """This process's CPU (all threads, to the nanosecond) plus its children's (W&B's service; /proc ticks)."""
    time.sleep(0.5)  # let the tracker threads and W&B's service finish what a poll handed them
    return time.process_time() + cpu_s([pid for pid in tree_pids(os.getpid()) if pid != os.getpid()])


def measure(base: Path, work: Path, name: str, logging: dict, grow_steps: int, idle_polls: int) -> dict:
    path = work / name
    shutil.copytree(base, path)
    run = RunDir(path)
    config = config_from_dict({"envs": [{"name": "arithmetic"}], "logging": logging})
    last = run.last_committed_step()
    before = tree_cpu()
    observer = RunObserver(run, config)
    opened = tree_cpu()
    observer.poll()
    first = tree_cpu()
    for _ in range(idle_polls):
        observer.poll()
    idle = tree_cpu()
    for step in range(last + 1, last + 1 + grow_steps):
        add_step(run, step)
        observer.poll()
    grown = tree_cpu()
    for step in range(last + 1 + grow_steps, last + 1 + 2 * grow_steps):  # the same writes, no poll
        add_step(run, step)
    written = tree_cpu()
    observer.close()
    return {
        "open_cpu_s": round(opened - before, 4),
        "first_poll_cpu_s": round(first - opened, 4),
        "idle_poll_cpu_ms": round(1000 * (idle - first) / idle_polls, 4),
        "new_step_poll_cpu_ms": round(1000 * ((grown - idle) - (written - grown)) / grow_steps, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--grow", type=int, default=50, help="steps added one poll at a time")
    parser.add_argument("--idle-polls", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="observe-bench-"))
    try:
        base = RunDir(work / "base")
        t0 = time.monotonic()
        for step in range(1, args.steps + 1):
            add_step(base, step)
        print(f"built {args.steps} steps in {time.monotonic() - t0:.0f}s; metrics.jsonl "
              f"{base.metrics_path.stat().st_size / 1e6:.1f} MB", file=sys.stderr)
        before = tree_cpu()
        rows = step_rows(base)
        reread = tree_cpu() - before
        assert len(rows) == args.steps
        results = {"steps": args.steps, "reread_whole_run_cpu_ms": round(1000 * reread, 2), "configs": {}}
        for name, logging in CONFIGS.items():
            results["configs"][name] = measure(base.path, work, name, logging, args.grow, args.idle_polls)
            print(name, results["configs"][name], file=sys.stderr)
        print(json.dumps(results, indent=2))
        if args.out:
            args.out.write_text(json.dumps(results, indent=2) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
