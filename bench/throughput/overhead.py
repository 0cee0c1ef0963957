"""Figures 3, 4 and 5: the whole pipeline against instant servers (rollouts/s to committed Arrow
steps, CPU-ms per rollout), step commit latency, and resident memory, against a lower bound measured
in the same run: a plain Python loop doing the same work in-process without Beam.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from typing import Any

import numpy as np

from beam_rl import wiring
from beam_rl.model.location import tokenizer_for
from beam_rl.rundir import RunDir
from beam_rl.scoring.group import score_group
from beam_rl.standin.generator import InstantGenerator
from bench.common import procs
from bench.common.pipeline import ENV, bench_config, instant_rollouts

class _CommitWatcher(threading.Thread):
    """Follows the committed steps: the orchestrator's RSS as committed rollouts cross each mark, and
    its CPU at each commit (for the steady-state CPU per rollout)."""

    def __init__(self, run_dir: RunDir, per_step: int, marks: list[int], exclude: set[int]) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.per_step, self.exclude = run_dir, per_step, exclude
        self.pending = sorted(marks)
        self.rss: dict[int, int] = {}
        self.rss_by_name: dict[int, dict[str, float]] = {}
        self.cpu_at: list[tuple[int, float]] = []  # (rollouts committed, CPU s) at each commit seen
        self.stop = threading.Event()
        self._pids: list[int] | None = None

    def run(self) -> None:
        seen = 0
        while True:
            committed = len(self.run_dir.committed_steps()) * self.per_step
            if committed > seen:
                seen = committed
                if self._pids is None:  # the tree is whole once a step is committed
                    self._pids = procs.tree_pids(os.getpid(), self.exclude)
                self.cpu_at.append((committed, procs.cpu_s(self._pids)))
                while self.pending and committed >= self.pending[0]:
                    pids = procs.tree_pids(os.getpid(), self.exclude)
                    mark = self.pending.pop(0)
                    self.rss[mark], self.rss_by_name[mark] = procs.rss_bytes(pids), procs.rss_mb_by_name(pids)
            if self.stop.is_set():  # looked once more after the run ended: the last mark lands then
                return
            self.stop.wait(0.05)

    def steady_cpu_ms_per_rollout(self) -> float | None:
        """CPU per rollout from the commit at 10% of the run to the one at 90%. Both ends are then in
        steady state, with as much work in flight (permits, groups on their way to the packer): from
        the first commit on, the work buffered before it would be missing, and from the last one, the
        final drain would be in."""
        if not self.cpu_at:
            return None
        total = self.cpu_at[-1][0]
        inside = [(n, cpu) for n, cpu in self.cpu_at if 0.1 * total <= n <= 0.9 * total]
        if len(inside) < 2:
            return None
        (first_n, first_cpu), (last_n, last_cpu) = inside[0], inside[-1]
        return 1000 * (last_cpu - first_cpu) / (last_n - first_n)


def pipeline_run(size: dict[str, Any], runner: str) -> dict[str, Any]:
    from beam_rl.job.rollouts import run_rollouts  # Beam: only where a pipeline runs

    per_step = size["rollouts_per_step"]
    with procs.servers(size["pipeline_servers"], "instant", 1024) as (urls, server_pids), \
            tempfile.TemporaryDirectory(prefix="bench-pipeline-") as run_dir:
        config = bench_config(run_dir, urls, size, runner)
        exclude = set(server_pids)
        rundir = RunDir(run_dir)
        marks = [size["rss_warm_rollouts"], config.run.max_steps * per_step]
        watcher = _CommitWatcher(rundir, per_step, marks, exclude)
        cpu0 = procs.cpu_s(procs.tree_pids(os.getpid(), exclude))
        server_cpu0 = procs.cpu_s(server_pids)
        t0 = time.time()
        watcher.start()
        run_rollouts(config, urls, with_trainer=False)
        wall = time.time() - t0
        watcher.stop.set()
        watcher.join()
        cpu = procs.cpu_s(procs.tree_pids(os.getpid(), exclude)) - cpu0
        server_cpu = procs.cpu_s(server_pids) - server_cpu0
        steps = rundir.committed_steps()
        commits = [rundir.read_commit(s) for s in steps]
        rollouts = sum(c.window.rollouts for c in commits)
        tokens = sum(c.counts.tokens for c in commits)
        committed_at = np.array([c.committed_at for c in commits])
        latency = np.array([c.committed_at - c.extra["last_rollout_finished_at"] for c in commits])
        # Sustained: from the first rollout's start to the last commit, so runner start-up is not in
        # the rate (first-to-last commit would overstate it when several steps commit at once).
        first_start = min(min(rundir.read_window(s).column("t_sent").to_pylist()) for s in steps)
        sustained = rollouts / (committed_at[-1] - first_start)
        warm, last = watcher.rss.get(marks[0]), watcher.rss.get(marks[1])
        steady_cpu = watcher.steady_cpu_ms_per_rollout()
        return {
            "runner": runner,
            "steps": len(steps),
            "rollouts": rollouts,
            "tokens_committed": tokens,
            "wall_s": round(wall, 3),
            "rollouts_per_s_wall": round(rollouts / wall, 1),
            "rollouts_per_s_sustained": round(sustained, 1) if sustained else None,
            # Steady state (10% to 90% of the commits): without the runner's start-up, as the loop's
            # figure leaves out its set-up; the whole run's is next to it.
            "orchestrator_cpu_ms_per_rollout": round(steady_cpu, 3) if steady_cpu else None,
            "orchestrator_cpu_ms_per_rollout_whole_run": round(1000 * cpu / rollouts, 3),
            "servers_cpu_ms_per_rollout": round(1000 * server_cpu / rollouts, 3),
            "commit_latency_s": {"p50": round(float(np.percentile(latency, 50)), 4),
                                 "p99": round(float(np.percentile(latency, 99)), 4),
                                 "max": round(float(latency.max()), 4)},
            "rss_mb": {str(k): round(v / 2**20, 1) for k, v in sorted(watcher.rss.items())},
            "rss_mb_by_process": {str(k): v for k, v in sorted(watcher.rss_by_name.items())},
            "rss_growth_after_warmup": round((last - warm) / warm, 4) if warm and last else None,
        }


def plain_loop(size: dict[str, Any]) -> dict[str, Any]:
    """The lower bound: render, generate instantly, reward, group, GRPO, pack, write Arrow, in one loop."""
    with tempfile.TemporaryDirectory(prefix="bench-loop-") as run_dir:
        config = bench_config(run_dir, ["http://unused"], size, "direct")
        envs = wiring.build_envs(config)
        env = envs[ENV]
        tokenizer = tokenizer_for(config.model.name)
        generator = InstantGenerator(len(tokenizer), set(tokenizer.all_special_ids))
        schedule = wiring.build_schedule(config, envs)
        algorithm = wiring.algorithms(config)[ENV]
        filters = wiring.pre_batch_filters(config)
        builder = wiring.batch_builder(config, 1, check_staleness=False)
        rundir = RunDir(run_dir)
        groups = config.run.max_steps * config.batch.rollouts_per_step // size["group_size"]
        cpu0, t0 = time.process_time(), time.perf_counter()
        rollouts = steps = 0
        for position in range(groups):
            group = score_group(instant_rollouts(config, env, generator, position, schedule), algorithm, filters,
                                config.inference.temperature)
            rollouts += len(group.rollouts)
            for batch in builder.add(group):
                rundir.write_step(batch, offsets={r.prompt_offset for r in batch.rollouts},
                                  window=batch.rollouts, extra={"last_rollout_finished_at": time.time()})
                steps += 1
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"rollouts": rollouts, "steps": steps, "wall_s": round(wall, 3),
            "rollouts_per_s": round(rollouts / wall, 1), "cpu_ms_per_rollout": round(1000 * cpu / rollouts, 3)}


def measure(size: dict[str, Any], runners: list[str]) -> dict[str, Any]:
    """The pipeline on each runner against the loop, run before the pipelines and again after them. On a
    shared 2-core machine the same loop's rate moves by a quarter from run to run, so the ratios are taken
    against its best rate and its lowest CPU of the two runs: the pipeline is not flattered by a slow draw."""
    loops = [plain_loop(size)]
    pipelines = {runner: pipeline_run(size, runner) for runner in runners}
    loops.append(plain_loop(size))
    # Both runs do the same rollouts; their wall times stay in lower_bound_loop_runs.
    lower = {"rollouts": loops[0]["rollouts"], "rollouts_per_s": max(loop["rollouts_per_s"] for loop in loops),
             "cpu_ms_per_rollout": min(loop["cpu_ms_per_rollout"] for loop in loops)}
    out: dict[str, Any] = {"tokens_per_rollout": size["tokens"], "group_size": size["group_size"],
                           "rollouts_per_step": size["rollouts_per_step"], "lower_bound_loop": lower,
                           "lower_bound_loop_runs": loops, "runners": {}}
    for runner, run in pipelines.items():
        rate = run["rollouts_per_s_sustained"] or run["rollouts_per_s_wall"]
        run["throughput_ratio_vs_loop"] = round(lower["rollouts_per_s"] / rate, 2)
        cpu_ms = run["orchestrator_cpu_ms_per_rollout"] or run["orchestrator_cpu_ms_per_rollout_whole_run"]
        run["cpu_ratio_vs_loop"] = round(cpu_ms / lower["cpu_ms_per_rollout"], 2)
        out["runners"][runner] = run
    return out


def main() -> None:
    """Figures 3-5 alone (the pipeline against the plain loop, commit latency, memory), e.g. a longer run that
    shows whether memory keeps growing: `python -m bench.throughput.overhead --size full --runners flink-local
    --pipeline-rollouts 40000 --warm-rollouts 20000 --out bench/throughput/memory-40k.json`."""
    import argparse
    import json

    from bench.common.pipeline import SIZES

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--runners", default="direct,flink-local")
    parser.add_argument("--pipeline-rollouts", type=int, help="default: the size's")
    parser.add_argument("--warm-rollouts", type=int, help="the first RSS mark (default: the size's)")
    parser.add_argument("--out", default="bench/throughput/overhead.json")
    args = parser.parse_args()
    size = dict(SIZES[args.size])
    if args.pipeline_rollouts:
        size["pipeline_rollouts"] = args.pipeline_rollouts
    if args.warm_rollouts:
        size["rss_warm_rollouts"] = args.warm_rollouts
    result = {"command": "python -m bench.throughput.overhead " + " ".join(f"--{k.replace('_', '-')} {v}"
                                                               for k, v in vars(args).items() if v is not None),
              **measure(size, args.runners.split(","))}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
