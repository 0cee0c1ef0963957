"""Tokens lost per killed dispatcher worker: rollouts in flight restarted from their prompts after the
restore, against continued from the tokens the checkpoint kept (`dispatch.checkpoint_tokens`), side by side.

Each run: simulated inference servers in this process (every request and engine step recorded), a rollout
pipeline on flink-local with checkpointing and its Python stages in a separate worker process, SIGKILL of
that worker once a checkpoint has passed, Flink's restore, the run to its end. Tokens lost = tokens the
servers sampled - tokens of the rollouts in the committed windows (a run without a kill loses 0: the
control). The bound to meet: no more than the servers sampled between the restored checkpoint and the kill.

    .venv/bin/python -m bench.recovery.worker_kill --runs 3 --out bench/recovery/worker_kill.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from beam_rl.standin.server import SeenRequest

REPO = Path(__file__).resolve().parents[2]
VARIANTS = {"restart": False, "continue": True}  # -> dispatch.checkpoint_tokens
GROUP_SIZE = 8
PROMPTS = 48
CHECKPOINT_MS = 2000
# Long-tailed generations (median 48 tokens, p99 ~500 clipped to 256) at 50 ms a decode step: a rollout
# runs 0.05-15 s, so at any moment many groups hold some finished rollouts and some still generating.
SIM = {"decode_base_s": 0.05, "length_median": 48.0, "length_sigma": 1.0}
MAX_TOKENS = 256
SERVERS, SLOTS, PERMITS = 2, 64, 64
KILL_AFTER = 0.3  # share of the run's rollouts finished before the kill waits for the next checkpoint
RUN_TIMEOUT_S = 600


def _config(run_dir: Path, variant: str) -> dict:
    return {
        "run": {"dir": str(run_dir), "max_steps": 1000},
        "envs": [{"name": "reverse_text", "group_size": GROUP_SIZE, "limit": PROMPTS, "mode": "rollout"}],
        "batch": {"rollouts_per_step": 64},
        "inference": {"max_tokens": MAX_TOKENS, "max_inflight": PERMITS},
        "dispatch": {"checkpoint_tokens": VARIANTS[variant]},
        "eval": {"every_steps": 0},
        "runner": {"name": "flink-local", "checkpointing_interval_ms": CHECKPOINT_MS, "state_backend": "filesystem",
                   "state_backend_storage_path": (run_dir.parent / "checkpoints").as_uri(), "environment": "process"},
    }


# -- the driver: runs in a subprocess, as a user's launcher would ------------------------------------


def _drive(config_path: str, urls: list[str], out: str) -> None:
    """Runs one rollout pipeline to its end, then writes every rollout of the committed windows to `out`."""
    from beam_rl.config import config_from_dict
    from beam_rl.rundir import RunDir
    from beam_rl.job import rollouts as rollout_job

    config = config_from_dict(json.loads(Path(config_path).read_text()))
    rollout_job.run_rollouts(config, urls, config.run.dir, with_trainer=False)
    run_dir = RunDir(config.run.dir)
    rollouts = []
    for step in run_dir.committed_steps():
        window = run_dir.read_window(step).select(["rollout_id", "group_id", "attempt", "completion_tokens", "status"])
        rollouts += [list(row.values()) for row in window.to_pylist()]
    restores = [m["dispatch_restore"] for m in run_dir.read_metrics() if "dispatch_restore" in m]
    Path(out).write_text(json.dumps({"steps": len(run_dir.committed_steps()), "rollouts": rollouts,
                                     "restores": restores}))


# -- the servers: simulated engines that record every request --------------------------------------


def _server(seed: int):
    """A simulated engine; its `requests_seen` records every request: arrival, seed, tokens asked for, end."""
    from beam_rl.standin.server import EmbeddedServer
    from beam_rl.standin.simulated import SimulatedParams

    return EmbeddedServer(mode="simulated", max_num_seqs=SLOTS, served_model_name="tiny",
                          simulated=SimulatedParams(**SIM, seed=seed))


# -- one run ---------------------------------------------------------------------------------------


def _workers(driver_pid: int) -> list[int]:
    """The Python SDK workers the embedded Flink started (`runners.workers boot` processes)."""
    from bench.common.procs import cmdline, tree_pids

    return [pid for pid in tree_pids(driver_pid) if "boot" in (argv := cmdline(pid))
            and any(part.endswith(("runners.workers", "workers.py")) for part in argv)]


def _kill_tree(root: int) -> None:
    from bench.common.procs import tree_pids

    for pid in tree_pids(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class _Checkpoints:
    """Flink's completed checkpoints under `root` as they appear: (started, completed) unix times and their
    size on disk. Each chk-N folder is made as Flink triggers it, so `look` often."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._started: dict[Path, float] = {}
        self.sizes: dict[Path, int] = {}

    def look(self) -> list[tuple[float, float]]:
        now = time.time()
        for folder in self._root.glob("*/chk-*"):
            self._started.setdefault(folder, now)
        done = []
        for metadata in self._root.glob("*/chk-*/_metadata"):
            folder = metadata.parent
            with contextlib.suppress(FileNotFoundError):  # Flink deletes all but the newest
                if folder not in self.sizes:
                    self.sizes[folder] = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
                done.append((self._started[folder], metadata.stat().st_mtime))
        return sorted(done)


@dataclass
class RunResult:
    variant: str
    killed: bool
    wall_s: float
    generated_tokens: int  # sampled by the servers (aborted requests included)
    placed_tokens: int  # completion tokens of the rollouts in the committed windows
    tokens_lost: int
    regenerated_rollouts: int  # answered more than once (same seed)
    regenerated_tokens: int  # tokens of those earlier answers
    # Of those, answered before the restored checkpoint began: finished work the checkpoint did not keep.
    regenerated_though_finished_before_checkpoint: int
    cut_off_tokens: int  # the rest of what was lost: requests in flight when the worker died
    finished_ungrouped_at_kill: int  # answered before the kill, group not yet fully answered
    in_flight_at_kill: int
    # The bound: tokens the servers sampled from the start of the restored checkpoint to the kill.
    sampled_since_restored_checkpoint: int | None = None
    within_bound: bool | None = None
    rollouts_resumed: int = 0  # continued from the tokens the restored checkpoint kept
    # Requests sent after the kill that continue one cut off by it (its seed, fewer tokens to go), as the
    # servers read them.
    continued_after_kill: int = 0
    tokens_resumed: int = 0
    resume_bytes: int = 0  # those tokens' data in the restored checkpoint
    checkpoint_bytes_median: int | None = None  # a completed checkpoint's files before the kill
    checkpoint_s_median: float | None = None  # trigger to completion, as seen from the folder
    workers_at_kill: int = 0
    restore_s: float | None = None  # kill to the first answer to a request sent after it
    steps: int = 0
    rollouts: int = 0
    notes: list[str] = field(default_factory=list)


def run_once(variant: str, kill: bool, work: Path) -> RunResult:
    from beam_rl.dispatch.ledger import rollout_seed

    work.mkdir(parents=True)
    run_dir = work / "run"
    servers = [_server(seed=i) for i in range(SERVERS)]
    urls = [s.start() for s in servers]
    config = _config(run_dir, variant)
    (work / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": str(REPO), "BEAM_RL_WORKER_LOG_DIR": str(work / "workers")}
    argv = [sys.executable, str(Path(__file__).resolve()), "drive", str(work / "config.json"),
            str(work / "rollouts.json"), *urls]
    start = time.time()
    with open(work / "driver.log", "wb") as log:
        driver = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    killed_at, armed_at, workers, notes = None, None, [], []
    watch = _Checkpoints(work / "checkpoints")
    checkpoints: list[tuple[float, float]] = []
    try:
        while kill and killed_at is None and driver.poll() is None:
            time.sleep(0.1)
            checkpoints = watch.look()
            answered = [r for s in servers for r in s.requests_seen if r.tokens is not None]
            if len(answered) < KILL_AFTER * PROMPTS * GROUP_SIZE:
                armed_at = None
                continue
            armed_at = armed_at or time.time()
            # Past a checkpoint completed after the mark, half an interval on: mid-way between two.
            done = [t for _, t in checkpoints if t > armed_at]
            if done and time.time() > done[0] + CHECKPOINT_MS / 2000:
                workers = _workers(driver.pid)
                if len(workers) != 1:
                    notes.append(f"{len(workers)} workers at the kill: all killed")
                for pid in workers:
                    os.kill(pid, signal.SIGKILL)
                killed_at = time.time()
        driver.wait(timeout=RUN_TIMEOUT_S - (time.time() - start))
    finally:
        if driver.poll() is None:  # timed out or interrupted: its job server and workers go with it
            _kill_tree(driver.pid)
            driver.wait()
        for s in servers:
            s.stop()
    if driver.returncode != 0:
        raise RuntimeError(f"{variant} run failed ({driver.returncode}); see {work / 'driver.log'}")
    if kill and killed_at is None:
        raise RuntimeError(f"{variant} run ended before a checkpoint past {KILL_AFTER:.0%} of its rollouts")
    written = json.loads((work / "rollouts.json").read_text())
    rollouts = written["rollouts"]
    ids = [r[0] for r in rollouts]
    if len(ids) != len(set(ids)) or len(ids) != PROMPTS * GROUP_SIZE:
        notes.append(f"windows hold {len(ids)} rollouts ({len(set(ids))} distinct), expected {PROMPTS * GROUP_SIZE}")
    group_of = {rollout_seed(config["run"].get("seed", 0), g, a): g for _, g, a, _, _ in rollouts}
    generated = sum(s.backend.generation_tokens for s in servers)
    placed = sum(r[3] for r in rollouts)
    requests = [r for s in servers for r in s.requests_seen]
    answers: dict[int, list[SeenRequest]] = {}
    for r in requests:
        if r.tokens is not None:
            answers.setdefault(r.seed, []).append(r)
    regenerated = {seed: answered for seed, answered in answers.items() if len(answered) > 1}
    regenerated_tokens = sum(r.tokens for answered in regenerated.values() for r in answered[:-1])
    ungrouped = in_flight = redone_checkpointed = continued = 0
    restore_s = sampled_since = None
    if killed_at is not None:
        # The checkpoint Flink restored: the last one completed before the kill.
        restored_from = max(begun for begun, completed in checkpoints if completed < killed_at)
        cut_off = {r.seed for r in requests if r.t <= killed_at and r.tokens is None}
        continued = sum(1 for r in requests if r.t > killed_at and r.seed in cut_off and r.max_tokens < MAX_TOKENS)
        sampled_since = 0
        for server in servers:
            trace = server.backend.trace_since(restored_from)
            sampled_since += sum(n for t, n in zip(trace["t"], trace["running"]) if t < killed_at)
        redone_checkpointed = sum(1 for answered in regenerated.values() if answered[0].ended < restored_from)
        per_group: dict[str, int] = {}
        for r in requests:
            if r.tokens is not None and r.ended <= killed_at:
                per_group[group_of[r.seed]] = per_group.get(group_of[r.seed], 0) + 1
        ungrouped = sum(n for n in per_group.values() if n < GROUP_SIZE)
        in_flight = sum(1 for r in requests if r.t <= killed_at < (r.ended or float("inf")))
        after = [r.ended for r in requests if r.tokens is not None and r.t > killed_at]
        restore_s = round(min(after) - killed_at, 1) if after else None
    return RunResult(
        variant=variant, killed=killed_at is not None, wall_s=round(time.time() - start, 1),
        generated_tokens=generated, placed_tokens=placed, tokens_lost=generated - placed,
        regenerated_rollouts=len(regenerated), regenerated_tokens=regenerated_tokens,
        regenerated_though_finished_before_checkpoint=redone_checkpointed,
        cut_off_tokens=generated - placed - regenerated_tokens, finished_ungrouped_at_kill=ungrouped,
        in_flight_at_kill=in_flight, workers_at_kill=len(workers), restore_s=restore_s,
        sampled_since_restored_checkpoint=sampled_since, continued_after_kill=continued,
        within_bound=None if sampled_since is None else generated - placed <= sampled_since,
        rollouts_resumed=sum(r["rollouts_resumed"] for r in written["restores"]),
        tokens_resumed=sum(r["tokens_resumed"] for r in written["restores"]),
        resume_bytes=sum(r["resume_bytes"] for r in written["restores"]),
        checkpoint_bytes_median=int(statistics.median(watch.sizes.values())) if watch.sizes else None,
        checkpoint_s_median=(round(statistics.median(done - begun for begun, done in checkpoints), 3)
                             if checkpoints else None),
        steps=written["steps"], rollouts=len(rollouts), notes=notes)


def _summary(results: list[RunResult]) -> dict:
    def spread(name: str) -> dict:
        values = [getattr(r, name) for r in results if getattr(r, name) is not None]
        if not values:
            return {}
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    summary = {name: spread(name) for name in (
        "tokens_lost", "sampled_since_restored_checkpoint", "regenerated_tokens", "cut_off_tokens",
        "regenerated_rollouts", "regenerated_though_finished_before_checkpoint", "finished_ungrouped_at_kill",
        "in_flight_at_kill", "rollouts_resumed", "tokens_resumed", "resume_bytes", "checkpoint_bytes_median",
        "checkpoint_s_median", "restore_s")}
    summary["within_bound"] = f"{sum(bool(r.within_bound) for r in results)} of {len(results)}"
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="kills per variant")
    parser.add_argument("--no-control", action="store_true", help="skip the run without a kill per variant")
    parser.add_argument("--out", default=str(REPO / "bench" / "worker_kill.json"))
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="worker-kill-"))
    controls = {} if args.no_control else {v: asdict(run_once(v, False, work / f"{v}-control")) for v in VARIANTS}
    kills: dict[str, list[RunResult]] = {v: [] for v in VARIANTS}
    for i in range(args.runs):  # side by side: the variants alternate
        for v in VARIANTS:
            kills[v].append(run_once(v, True, work / f"{v}-{i}"))
            print(json.dumps(asdict(kills[v][-1])), flush=True)
    report = {
        "settings": {"servers": SERVERS, "slots": SLOTS, "permits": PERMITS, "prompts": PROMPTS,
                     "group_size": GROUP_SIZE, "max_tokens": MAX_TOKENS, "simulated": SIM,
                     "checkpointing_interval_ms": CHECKPOINT_MS, "kill_after_share": KILL_AFTER,
                     "variants": {v: {"dispatch.checkpoint_tokens": on} for v, on in VARIANTS.items()},
                     "work_dir": str(work)},
        "controls": controls,
        "summary": {v: _summary(kills[v]) for v in VARIANTS},
        "runs": {v: [asdict(r) for r in kills[v]] for v in VARIANTS},
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["summary"], indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["drive"]:
        sys.path.remove(str(Path(__file__).resolve().parent))  # the repository's packages, not bench/'s files
        _drive(config_path=sys.argv[2], out=sys.argv[3], urls=sys.argv[4:])
    else:
        main()
