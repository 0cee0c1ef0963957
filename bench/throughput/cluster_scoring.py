"""Scoring throughput on a Flink cluster: one Python worker against two, side by side in one run.

A standalone cluster (JobManager + 2 TaskManagers, each with a worker pool) runs the same rollout pipeline
twice against instant inference servers, with a CPU-heavy reward (arithmetic's `reward_cpu_ms`): at
parallelism 1 all stages run in one worker, at parallelism 2 dispatch (2 shards) and scoring spread over
two. Throughput is rollouts per second from the first rollout's start to the last commit: job start-up is
left out, and with 20 ms of reward CPU per rollout against ~1 ms of dispatch and packing, scoring sets it.

    python -m bench.throughput.cluster_scoring --reward-cpu-ms 20 --prompts 96
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from beam_rl.config import config_from_dict
from beam_rl.rundir import RunDir
from beam_rl.standin.server import EmbeddedServer
from runners.flink_cluster import start_cluster
from beam_rl.job.rollouts import run_rollouts

GROUP_SIZE, ROLLOUTS_PER_STEP = 8, 64


def _run(cluster, urls: list[str], parallelism: int, prompts: int, reward_cpu_ms: float) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"cluster-scoring-p{parallelism}-"))
    config = config_from_dict({
        "run": {"dir": str(run_dir), "max_steps": 10_000},
        "envs": [{"name": "arithmetic", "group_size": GROUP_SIZE, "limit": prompts, "epochs": 1,
                  "args": {"reward_cpu_ms": reward_cpu_ms}}],
        "batch": {"rollouts_per_step": ROLLOUTS_PER_STEP},
        "filters": {"zero_advantage": {"mode": "monitor"}},  # every group trains: full, regular steps
        "inference": {"max_tokens": 8, "max_inflight": 128},
        "dispatch": {"shards": 2},
        "runner": {"name": "flink", "flink_master": cluster.master, "parallelism": parallelism,
                   "environment": "external", "worker_pool": cluster.worker_pool},
    })
    started = time.monotonic()
    run_rollouts(config, urls, str(run_dir), with_trainer=False)
    wall_s = time.monotonic() - started
    directory = RunDir(run_dir)
    steps = directory.committed_steps()
    commits = [directory.read_commit(step) for step in steps]
    first_start = min(min(directory.read_window(step).column("t_sent").to_pylist()) for step in steps)
    span_s = commits[-1].committed_at - first_start
    rollouts = sum(c.window.rollouts for c in commits)
    workers = {role: sorted({w for c in commits for w in c.extra["workers"][role]}) for role in ("dispatch", "score")}
    return {"parallelism": parallelism, "steps": len(commits), "rollouts": sum(c.window.rollouts for c in commits),
            "rollouts_per_s": round(rollouts / span_s, 2), "first_start_to_last_commit_s": round(span_s, 2),
            "wall_s": round(wall_s, 1), "workers": workers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reward-cpu-ms", type=float, default=20.0)
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=1, help="alternate 1 and 2 workers this many times")
    parser.add_argument("--out", default="bench/throughput/cluster_scoring.json")
    args = parser.parse_args()
    cluster = start_cluster(taskmanagers=2, slots_per_taskmanager=2)
    servers = [EmbeddedServer(mode="instant", max_num_seqs=256) for _ in range(2)]
    urls = [s.start() for s in servers]
    try:
        runs = [_run(cluster, urls, parallelism, args.prompts, args.reward_cpu_ms)
                for _ in range(args.rounds) for parallelism in (1, 2)]
    finally:
        cluster.stop()
        for s in servers:
            s.stop()
    one = [r["rollouts_per_s"] for r in runs if r["parallelism"] == 1]
    two = [r["rollouts_per_s"] for r in runs if r["parallelism"] == 2]
    result = {"reward_cpu_ms": args.reward_cpu_ms, "prompts": args.prompts, "runs": runs,
              "speedup_2_over_1": round(sum(two) / sum(one), 3)}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for r in runs:
        print(f"{r['parallelism']} worker(s): {r['rollouts_per_s']:8.1f} rollouts/s scored "
              f"({r['rollouts']} rollouts, {r['steps']} steps; workers {r['workers']})")
    print(f"2 workers / 1 worker: {result['speedup_2_over_1']:.2f}x")


if __name__ == "__main__":
    main()
