"""Tokens lost per killed dispatcher worker, before and after finished rollouts became checkpointed state.

Each run: simulated inference servers in this process (every request recorded), a rollout pipeline on
flink-local with checkpointing and its Python stages in a separate worker process, SIGKILL of that worker
once a checkpoint has passed, Flink's restore, the run to its end. Tokens lost = tokens the servers
sampled - tokens of the rollouts in the committed windows (a run without a kill loses 0: the control).

    git worktree add ../before 5c1917a
    .venv/bin/python -m bench.worker_kill --before-tree ../before --runs 3 --out bench/worker_kill.json
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

REPO = Path(__file__).resolve().parent.parent
BEFORE = "5c1917a"  # the release before: its Dispatch held finished rollouts until their group was done
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
    runner = {"name": "flink-local", "checkpointing_interval_ms": CHECKPOINT_MS, "state_backend": "filesystem",
              "state_backend_storage_path": (run_dir.parent / "checkpoints").as_uri()}
    if variant == "after":
        runner["environment"] = "process"
    else:  # the old release has no `environment` key (see _drive); its Impulse must outlive the kill
        runner["shutdown_sources_after_idle_ms"] = 45_000
    return {
        "run": {"dir": str(run_dir), "max_steps": 1000},
        "envs": [{"name": "reverse_text", "group_size": GROUP_SIZE, "limit": PROMPTS, "mode": "rollout"}],
        "batch": {"rollouts_per_step": 64},
        "inference": {"max_tokens": MAX_TOKENS, "max_inflight": PERMITS},
        "eval": {"every_steps": 0},
        "runner": runner,
    }


# -- the driver: runs in a subprocess with the tree under test first on PYTHONPATH -------------------


def _drive(config_path: str, urls: list[str], out: str, worker_command: str | None) -> None:
    """Runs one rollout pipeline to its end, then writes every rollout of the committed windows to `out`."""
    from beam_rl.config import config_from_dict
    from beam_rl.rundir import RunDir
    try:
        from runners import rollout_job as pipeline
    except ImportError:  # a release before the job was apart from the graph
        from runners import pipeline

    config = config_from_dict(json.loads(Path(config_path).read_text()))
    print(f"tree under test: {Path(pipeline.__file__).parent.parent}", flush=True)
    if worker_command:  # the old release ran its workers in this process only (LOOPBACK): start them apart
        import dataclasses

        settings_of, options_of = pipeline.runner_settings, pipeline.pipeline_options
        pipeline.runner_settings = lambda c: dataclasses.replace(settings_of(c), environment_type="PROCESS")
        environment = f"--environment_config={json.dumps({'command': worker_command})}"
        pipeline.pipeline_options = lambda s, *a: options_of(s, environment, *a)
    pipeline.run_rollouts(config, urls, config.run.dir, with_trainer=False)
    run_dir = RunDir(config.run.dir)
    rollouts = []
    for step in run_dir.committed_steps():
        window = run_dir.read_window(step).select(["rollout_id", "group_id", "attempt", "completion_tokens", "status"])
        rollouts += [list(row.values()) for row in window.to_pylist()]
    Path(out).write_text(json.dumps({"steps": len(run_dir.committed_steps()), "rollouts": rollouts}))


# -- the servers: simulated engines that record every request --------------------------------------


@dataclass
class _Request:
    seed: int | None
    started: float
    ended: float = 0.0
    tokens: int | None = None  # completion tokens of an answered request; None: cut off (client gone)


def _recording_server(requests: list[_Request], seed: int):
    from aiohttp import web

    from beam_rl.standin.server import EmbeddedServer
    from beam_rl.standin.simulated import SimulatedParams

    class RecordingServer(EmbeddedServer):
        def app(self) -> web.Application:
            app = super().app()
            app.middlewares.append(self._record)
            return app

        @web.middleware
        async def _record(self, request: web.Request, handler):
            if request.path != "/v1/completions":
                return await handler(request)
            record = _Request(seed=(await request.json()).get("seed"), started=time.time())
            requests.append(record)
            try:
                response = await handler(request)
                if response.status == 200:
                    record.tokens = json.loads(response.body)["usage"]["completion_tokens"]
                return response
            finally:
                record.ended = time.time()

    return RecordingServer(mode="simulated", max_num_seqs=SLOTS, served_model_name="tiny",
                           simulated=SimulatedParams(**SIM, seed=seed))


# -- one run ---------------------------------------------------------------------------------------


def _workers(driver_pid: int) -> list[int]:
    """The Python SDK workers the embedded Flink started (`runners.workers boot` processes)."""
    from bench.procs import cmdline, tree_pids

    return [pid for pid in tree_pids(driver_pid) if "boot" in (argv := cmdline(pid))
            and any(part.endswith(("runners.workers", "workers.py")) for part in argv)]


def _kill_tree(root: int) -> None:
    from bench.procs import tree_pids

    for pid in tree_pids(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _watch_checkpoints(root: Path, started: dict[Path, float]) -> list[tuple[float, float]]:
    """(started, completed) unix times of the completed checkpoints; `started` notes when each chk-N
    folder (made as Flink triggers the checkpoint) was first seen, so call this often."""
    now = time.time()
    for folder in root.glob("*/chk-*"):
        started.setdefault(folder, now)
    return sorted((started[p.parent], p.stat().st_mtime) for p in root.glob("*/chk-*/_metadata"))


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
    workers_at_kill: int = 0
    restore_s: float | None = None  # kill to the first answer to a request sent after it
    steps: int = 0
    rollouts: int = 0
    notes: list[str] = field(default_factory=list)


def run_once(variant: str, kill: bool, work: Path, before_tree: Path) -> RunResult:
    from beam_rl.dispatch.ledger import rollout_seed

    work.mkdir(parents=True)
    run_dir, requests = work / "run", []
    servers = [_recording_server(requests, seed=i) for i in range(SERVERS)]
    urls = [s.start() for s in servers]
    config = _config(run_dir, variant)
    (work / "config.json").write_text(json.dumps(config))
    tree = before_tree if variant == "before" else REPO
    env = {**os.environ, "PYTHONPATH": str(tree), "BEAM_RL_WORKER_LOG_DIR": str(work / "workers")}
    argv = [sys.executable, str(Path(__file__).resolve()), "drive", str(work / "config.json"),
            str(work / "rollouts.json"), *urls]
    if variant == "before":  # this tree's worker boot program, run as a file so the old tree's packages win
        boot = work / "boot.sh"
        boot.write_text(f'#!/bin/sh\nexec {sys.executable} {REPO / "runners" / "workers.py"} boot "$@"\n')
        boot.chmod(0o755)
        argv += ["--worker-command", str(boot)]
    start = time.time()
    with open(work / "driver.log", "wb") as log:
        driver = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    killed_at, armed_at, workers, notes = None, None, [], []
    checkpoint_folders: dict[Path, float] = {}
    checkpoints: list[tuple[float, float]] = []
    try:
        while kill and killed_at is None and driver.poll() is None:
            time.sleep(0.1)
            checkpoints = _watch_checkpoints(work / "checkpoints", checkpoint_folders)
            answered = [r for r in requests if r.tokens is not None]
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
    answers: dict[int, list[_Request]] = {}
    for r in requests:
        if r.tokens is not None:
            answers.setdefault(r.seed, []).append(r)
    regenerated = {seed: answered for seed, answered in answers.items() if len(answered) > 1}
    regenerated_tokens = sum(r.tokens for answered in regenerated.values() for r in answered[:-1])
    ungrouped = in_flight = redone_checkpointed = 0
    restore_s = None
    if killed_at is not None:
        # The checkpoint Flink restored: the last one completed before the kill.
        restored_from = max(begun for begun, completed in checkpoints if completed < killed_at)
        redone_checkpointed = sum(1 for answered in regenerated.values() if answered[0].ended < restored_from)
        per_group: dict[str, int] = {}
        for r in requests:
            if r.tokens is not None and r.ended <= killed_at:
                per_group[group_of[r.seed]] = per_group.get(group_of[r.seed], 0) + 1
        ungrouped = sum(n for n in per_group.values() if n < GROUP_SIZE)
        in_flight = sum(1 for r in requests if r.started <= killed_at < (r.ended or float("inf")))
        after = [r.ended for r in requests if r.tokens is not None and r.started > killed_at]
        restore_s = round(min(after) - killed_at, 1) if after else None
    return RunResult(
        variant=variant, killed=killed_at is not None, wall_s=round(time.time() - start, 1),
        generated_tokens=generated, placed_tokens=placed, tokens_lost=generated - placed,
        regenerated_rollouts=len(regenerated), regenerated_tokens=regenerated_tokens,
        regenerated_though_finished_before_checkpoint=redone_checkpointed,
        cut_off_tokens=generated - placed - regenerated_tokens, finished_ungrouped_at_kill=ungrouped,
        in_flight_at_kill=in_flight, workers_at_kill=len(workers), restore_s=restore_s,
        steps=written["steps"], rollouts=len(rollouts), notes=notes)


def _summary(results: list[RunResult]) -> dict:
    def spread(name: str) -> dict:
        values = [getattr(r, name) for r in results]
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    return {name: spread(name) for name in ("tokens_lost", "regenerated_tokens", "cut_off_tokens",
                                            "regenerated_rollouts", "regenerated_though_finished_before_checkpoint",
                                            "finished_ungrouped_at_kill", "in_flight_at_kill", "restore_s")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="kills per variant")
    parser.add_argument("--no-control", action="store_true", help="skip the run without a kill per variant")
    parser.add_argument("--out", default=str(REPO / "bench" / "worker_kill.json"))
    parser.add_argument("--before-tree", type=Path, required=True,
                        help=f"a checkout of the release before: git worktree add <path> {BEFORE}")
    args = parser.parse_args(argv)
    args.before_tree = args.before_tree.resolve()  # workers resolve PYTHONPATH from their own directory
    if not (args.before_tree / "runners" / "pipeline.py").is_file():
        sys.exit(f"no checkout of the release before at {args.before_tree} (git worktree add <path> {BEFORE})")
    work = Path(tempfile.mkdtemp(prefix="worker-kill-"))
    variants = ("before", "after")
    controls = {} if args.no_control else {
        v: asdict(run_once(v, False, work / f"{v}-control", args.before_tree)) for v in variants}
    kills: dict[str, list[RunResult]] = {v: [] for v in variants}
    for i in range(args.runs):  # side by side: before and after alternate
        for v in variants:
            kills[v].append(run_once(v, True, work / f"{v}-{i}", args.before_tree))
            print(json.dumps(asdict(kills[v][-1])), flush=True)
    report = {
        "settings": {"servers": SERVERS, "slots": SLOTS, "permits": PERMITS, "prompts": PROMPTS,
                     "group_size": GROUP_SIZE, "max_tokens": MAX_TOKENS, "simulated": SIM,
                     "checkpointing_interval_ms": CHECKPOINT_MS, "kill_after_share": KILL_AFTER,
                     "before": f"commit {BEFORE}", "work_dir": str(work)},
        "controls": controls,
        "summary": {v: _summary(kills[v]) for v in variants},
        "runs": {v: [asdict(r) for r in kills[v]] for v in variants},
    }
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["summary"], indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["drive"]:
        sys.path.remove(str(Path(__file__).resolve().parent))  # the tree under test, not bench/, comes first
        parser = argparse.ArgumentParser()
        parser.add_argument("command")
        parser.add_argument("config")
        parser.add_argument("out")
        parser.add_argument("urls", nargs="+")
        parser.add_argument("--worker-command")
        a = parser.parse_args()
        _drive(a.config, a.urls, a.out, a.worker_command)
    else:
        main()
