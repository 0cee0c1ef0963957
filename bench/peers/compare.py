"""beam-rl side by side with the rollout loops users would pick instead (issue 51): every system, one after the
other, against the same simulated fleet and the same prompts, every column measured from outside the system.

    python -m bench.peers.compare --peers beam-rl-prism,trl --workloads short,long_tail,multi_turn \\
        --servers 2,16 --seconds 20 --out bench/peers/results.json

Per system, workload and fleet size, two runs, each on a fresh fleet (beam_rl/standin/fleet.py: one server in a
process of its own, the others in another, so that one can be killed):
- the updates run: every `update_every_s` from the first delivered rollout the harness pauses every server
  (`POST /pause?mode=keep`, as a weight update does), and resumes them `pause_s` later. Rollouts/s and
  tokens/s, the tree's CPU per rollout and the engines' slot occupancy are taken from the rollout at 10% of the
  run to the one at 90%; tokens thrown away = tokens the servers generated (their own counter) minus tokens
  delivered, read as the system delivers its job's last group (every server paused there: what a system that
  runs past its job generates after is not counted); seconds back to 90% = after each resume inside the
  steady window, until the engines' occupancy (their own step trace, over 0.5 s) is back to 90% of the run's
  steady occupancy (the slowest update); resident memory growth = the tree's RSS, mean of the last quarter of
  the run over the first.
- the kill run: once 40% of the rollouts are delivered the lone server is frozen (pause keep), its counter read,
  and its process killed; tokens lost = tokens the servers generated minus tokens delivered, read the same
  way as the system delivers its job's last group (else stopped at its time limit, and said so).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from beam_rl.processes import stop_processes, tree_pids
from beam_rl.standin.fleet import start_fleet
from beam_rl.standin.launch import spawn_subprocess_server, wait_until_ready
from bench.common import procs
from bench.common.engines import occupied_share, step_traces
from bench.common.results import write_results
from bench.peers.job import PeerJob, read_rollouts, registry, write_prompts
from bench.peers.table import COLUMNS, cannot
from bench.peers.workloads import GROUP_SIZE, WORKLOADS, Workload, prompts

SEED = 0
SAMPLE_S = 0.2  # how often the harness reads the tree's CPU and RSS and the delivered rollouts
BIN_S = 0.25  # how finely the time back after a resume is resolved
SMOOTH_S = 0.5  # occupancy after a resume, over this long: a group finishing is not a recovery
RECOVERED = 0.9  # occupancy back to this share of the run's steady occupancy
KILL_AT = 0.4  # share of the rollouts delivered when a server is killed
START_S = 400.0  # a system's start-up allowance (Prism, a JVM, a venv's imports) on top of its time limit
def peer_key(peer: Any) -> str:
    """The name `--peers` uses: the peer's NAME as a slug ("beam-rl (prism)" -> "beam-rl-prism")."""
    return re.sub(r"[^a-z0-9]+", "-", peer.NAME.lower()).strip("-")


def all_peers() -> dict[str, Any]:
    """Every peer adapter that has landed, by key (bench/peers/job.py registry)."""
    return {peer_key(p): p for classes in registry().values() for p in (cls() for cls in classes)}


# -- the fleet ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def fleet(workload: Workload, servers: int) -> Iterator[tuple[list[str], int]]:
    """`servers` simulated servers; yields their urls and the pid of the first one's process, which serves it
    alone (the one the kill run kills)."""
    args = workload.server_args()
    # The lone server starts beside the others (each process's imports take seconds on a busy machine).
    lone = spawn_subprocess_server(mode="simulated", extra_args=args, die_with_parent=True)
    try:
        with contextlib.ExitStack() as rest:
            others: list[str] = rest.enter_context(start_fleet(servers - 1, args))[0] if servers > 1 else []
            yield [wait_until_ready(lone), *others], lone.pid
    finally:
        stop_processes([lone])


def generated_tokens(url: str) -> float:
    """The server's own count of tokens it generated (vLLM's `vllm:generation_tokens_total`)."""
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "vllm:generation_tokens_total":
                return sample.value
    raise RuntimeError(f"{url}/metrics has no vllm:generation_tokens_total")


def pause_all(urls: list[str], resume: bool) -> None:
    """Every server paused with mode=keep (running requests frozen between two engine steps), or resumed."""

    async def send() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            route = "/resume" if resume else "/pause"
            params = {} if resume else {"mode": "keep"}
            responses = await asyncio.gather(*(client.post(f"{u}{route}", params=params) for u in urls))
        for url, r in zip(urls, responses):
            if r.status_code != 200:
                raise RuntimeError(f"{url}{route}: HTTP {r.status_code} {r.text[:200]}")

    asyncio.run(send())


# -- one run of one system ---------------------------------------------------------------------------------------


class Run:
    """One system's run: launched as its own process group, followed through `out_path` with the tree's CPU and
    RSS sampled every SAMPLE_S; `events` calls back with the rollouts delivered so far (the schedule)."""

    def __init__(self, peer: Any, job: PeerJob, limit_s: float) -> None:
        self.peer, self.job, self.limit_s = peer, job, limit_s
        self.samples: list[tuple[float, int, int, float, int]] = []  # (t, rollouts, tokens, cpu s, rss bytes)
        self.finished = False
        self.returncode: int | None = None
        self.launched = self.ended = 0.0

    @property
    def wanted(self) -> int:
        """The job's rollouts: delivered all, the run is finished."""
        return self.job.groups * self.job.group_size

    def go(self, events: Any) -> None:
        self.job.work_dir.mkdir(parents=True, exist_ok=True)
        with open(self.job.work_dir / "peer.log", "w") as log:
            self.launched = time.time()
            proc = subprocess.Popen(self.peer.command(self.job), stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            self._follow(proc, events)

    def _follow(self, proc: subprocess.Popen, events: Any) -> None:
        wanted = self.wanted
        deadline = time.time() + self.limit_s
        try:
            while time.time() < deadline:
                rows = read_rollouts(self.job.out_path)
                pids = tree_pids(proc.pid)
                self.samples.append((time.time(), len(rows), sum(r["completion_tokens"] for r in rows),
                                     procs.cpu_s(pids), procs.rss_bytes(pids)))
                events(self, rows)
                if len(rows) >= wanted or proc.poll() is not None:
                    break
                time.sleep(SAMPLE_S)
        finally:
            self.ended = time.time()
            self.finished = len(read_rollouts(self.job.out_path)) >= wanted
            self.returncode = proc.poll()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def error(self) -> str:
        """The last line of the system's log: what a failed run died of."""
        lines = (self.job.work_dir / "peer.log").read_text(errors="replace").strip().splitlines()
        return lines[-1][:200] if lines else "no output"

    def errors(self) -> list[str]:
        """The log's error and warning lines, first ones first (each once): what a failed run met on its way."""
        lines = (self.job.work_dir / "peer.log").read_text(errors="replace").splitlines()
        marked = [line[:300] for line in lines if re.search(r"Error|ERROR|WARNING:beam_rl", line)]
        return list(dict.fromkeys(marked))[:40]

    def rollouts(self) -> list[dict[str, Any]]:
        return read_rollouts(self.job.out_path)

    def window(self) -> tuple[float, float] | None:
        """The delivery times of the rollouts at 10% and 90% of those delivered (the steady window)."""
        times = sorted(r["t"] for r in self.rollouts())
        if len(times) < 10:
            return None
        start, end = times[len(times) // 10], times[9 * len(times) // 10]
        return (start, end) if end > start else None


def steady(run: Run, urls: list[str]) -> dict[str, Any]:
    """Rollouts/s, tokens/s, CPU per rollout and slot occupancy in the steady window; RSS growth."""
    window = run.window()
    if window is None:
        return {"steady_window": None}
    start, end = window
    # What was delivered after the first moment up to the last: a system that delivers in batches (a step) is
    # counted batch for batch, the one at `start` excluded.
    inside = [r for r in run.rollouts() if start < r["t"] <= end]
    samples = np.array([s for s in run.samples if start <= s[0] <= end], dtype=float).reshape(-1, 5)
    cpu_ms = None
    if len(samples) >= 2 and samples[-1, 1] > samples[0, 1]:
        cpu_ms = 1000 * (samples[-1, 3] - samples[0, 3]) / (samples[-1, 1] - samples[0, 1])
    live = [u for u in urls if _answers(u)]
    traces = asyncio.run(step_traces(live, start))
    rss = np.array([s[4] for s in run.samples if s[1] > 0], dtype=float)
    quarter = len(rss) // 4
    return {
        "steady_window": [round(start, 3), round(end, 3)],
        "rollouts_per_s": round(len(inside) / (end - start), 2),
        "tokens_per_s": round(sum(r["completion_tokens"] for r in inside) / (end - start), 1),
        "output_length": length_stats([r["completion_tokens"] for r in inside]),
        "cpu_ms_per_rollout": round(cpu_ms, 3) if cpu_ms is not None else None,
        "slots_occupied": round(float(np.mean([occupied_share(t, start, end) for t in traces])), 4),
        "rss_mb_first_quarter": round(rss[:quarter].mean() / 2**20, 1) if quarter else None,
        "rss_growth": round(float(rss[-quarter:].mean() / rss[:quarter].mean() - 1), 4) if quarter else None,
    }


PERCENTILES = (1, 10, 50, 90, 99)


def length_stats(tokens: list[int]) -> dict[str, float] | None:
    """Token counts: mean, min, percentiles, max."""
    if not tokens:
        return None
    values = np.array(tokens, dtype=float)
    return {"mean": round(float(values.mean()), 2), "min": float(values.min()),
            **{f"p{p}": round(float(np.percentile(values, p)), 2) for p in PERCENTILES}, "max": float(values.max())}


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def recovery_s(traces: list[dict[str, Any]], resumes: list[float], pause_s: float, level: float) -> list[float | None]:
    """Per update: seconds from the resume until the fleet's occupancy, over SMOOTH_S, is back to RECOVERED x
    `level` (the run's steady occupancy); None: not before the next pause (or 10 s)."""

    def occupancy(start: float) -> float:
        return float(np.mean([occupied_share(t, start, start + SMOOTH_S) for t in traces]))

    out: list[float | None] = []
    for i, resumed in enumerate(resumes):
        limit = resumes[i + 1] - pause_s if i + 1 < len(resumes) else resumed + 10.0
        starts = np.arange(resumed, limit - SMOOTH_S + 1e-9, BIN_S).tolist()
        out.append(next((round(b - resumed, 2) for b in starts if occupancy(b) >= RECOVERED * level), None))
    return out


def updates_run(peer: Any, workload: Workload, servers: int, seconds: float, update_every_s: float, pause_s: float,
                work: Path) -> dict[str, Any]:
    """The updates run (module docstring)."""
    with fleet(workload, servers) as (urls, _lone):
        job = _job(workload, servers, seconds, urls, work / "updates")
        resumes: list[float] = []
        schedule: dict[str, float] = {}
        at_end: dict[str, float] = {}

        def events(run: Run, rows: list[dict[str, Any]]) -> None:
            now = time.time()
            if rows and "first" not in schedule:
                schedule["first"] = now
                schedule["next"] = now + update_every_s
            if _read_at_last_delivery(run, rows, urls, at_end):
                return
            if "next" in schedule and now >= schedule["next"]:
                pause_all(urls, resume=False)
                time.sleep(pause_s)
                pause_all(urls, resume=True)
                resumes.append(time.time())
                schedule["next"] += update_every_s

        run = Run(peer, job, seconds * 4 + START_S)
        run.go(events)
        result = steady(run, urls) | _delivered(run, urls, "tokens_thrown_away_at_updates", at_end)
        window = run.window()
        if window is not None:
            # The updates inside the steady window: before it the pool is still filling, after it draining.
            resumes = [r for r in resumes if window[0] + pause_s <= r <= window[1]]
            traces = asyncio.run(step_traces(urls, window[0] - 3.0))
            backs = recovery_s(traces, resumes, pause_s, result["slots_occupied"])
            result["updates"] = len(resumes)
            result["s_back_per_update"] = backs
            known = [b for b in backs if b is not None]
            result["s_back_to_90pct_after_update"] = max(known) if known and len(known) == len(backs) else None
            if backs and len(known) < len(backs):
                result["s_back_to_90pct_after_update_why"] = (
                    f"{len(backs) - len(known)} of {len(backs)} updates not back to {RECOVERED:.0%} of the steady "
                    "occupancy before the next pause")
    return result


def kill_run(peer: Any, workload: Workload, servers: int, seconds: float, work: Path) -> dict[str, Any]:
    """The kill run (module docstring): needs a second server for the rollouts to go on."""
    with fleet(workload, servers) as (urls, lone_pid):
        job = _job(workload, servers, seconds, urls, work / "kill")
        killed: dict[str, float] = {}
        at_end: dict[str, float] = {}

        def events(run: Run, rows: list[dict[str, Any]]) -> None:
            if killed:
                _read_at_last_delivery(run, rows, urls[1:], at_end)
            elif len(rows) >= KILL_AT * run.wanted:
                # Frozen between two engine steps first, so that its counter is all it ever generated.
                pause_all(urls[:1], resume=False)
                killed["generated"] = generated_tokens(urls[0])
                killed["delivered"] = len(rows)
                os.kill(lone_pid, signal.SIGKILL)
                killed["at"] = time.time()

        run = Run(peer, job, seconds * 4 + START_S)
        run.go(events)
        result = _delivered(run, urls[1:], "tokens_lost_on_server_kill", at_end, killed.get("generated", 0.0))
        result["killed_at_s"] = round(killed["at"] - run.samples[0][0], 2) if killed else None
        result["tokens_generated_by_killed_server"] = int(killed["generated"]) if killed else None
        result["rollouts_delivered_at_kill"] = killed.get("delivered")
    return result


def _read_at_last_delivery(run: Run, rows: list[dict[str, Any]], urls: list[str], into: dict[str, Any]) -> bool:
    """Once the job's last group is delivered: every server paused (keep), then what they generated and what was
    delivered read into `into`, so that a system that runs past its job (cycling its dataset, running ahead) is
    not charged for what it generates after. True from then on."""
    if "generated_at_end" in into:
        return True
    if len(rows) < run.wanted:
        return False
    pause_all(urls, resume=False)
    into["generated_at_end"] = sum(generated_tokens(u) for u in urls)
    into["delivered_at_end"] = sum(r["completion_tokens"] for r in rows)
    return True


def _delivered(
    run: Run, urls: list[str], column: str, at_end: dict[str, Any], extra_generated: float = 0.0
) -> dict[str, Any]:
    """Tokens the servers generated minus tokens delivered (as read at the last delivery); a number only once
    every group was delivered."""
    rows = run.rollouts()
    if "generated_at_end" in at_end:
        delivered, generated = at_end["delivered_at_end"], extra_generated + at_end["generated_at_end"]
    else:
        delivered = sum(r["completion_tokens"] for r in rows)
        generated = extra_generated + sum(generated_tokens(u) for u in urls)
    first = min((r["t"] for r in rows), default=None)
    out = {"rollouts_delivered": len(rows), "tokens_delivered": delivered, "tokens_generated": int(generated),
           "finished": run.finished, "returncode": run.returncode, "run_s": round(run.ended - run.launched, 2),
           "start_s": round(first - run.launched, 2) if first else None}
    wanted = run.wanted
    if run.finished:
        out[column] = int(generated - delivered)
    elif run.returncode:
        out[column] = None
        out[f"{column}_why"] = f"it failed (exit {run.returncode}, {len(rows)} of {wanted} rollouts): {run.error()}"
        out["log_errors"] = run.errors()  # the run's directory goes with the harness's temporary one
    else:
        out[column] = None
        out[f"{column}_why"] = f"stopped at its time limit with {len(rows)} of {wanted} rollouts delivered"
    return out


def _job(workload: Workload, servers: int, seconds: float, urls: list[str], work: Path) -> PeerJob:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    groups = workload.groups_for(servers, seconds)
    path = work / "prompts.jsonl"
    write_prompts(path, prompts(workload.name, groups, SEED))
    return PeerJob(name=workload.name, urls=urls, model="tiny", prompts_path=path, group_size=GROUP_SIZE,
                   max_tokens=workload.max_tokens, groups=groups, out_path=work / "rollouts.jsonl",
                   work_dir=work / "peer", seed=SEED)


# -- every system ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Schedule:
    """What every system gets alike: each run's work at full occupancy, and the weight updates."""

    seconds: float = 20.0
    update_every_s: float = 5.0  # from the first delivered rollout
    pause_s: float = 0.5  # each pause (the weights loading)


def cell(peer: Any, workload: Workload, servers: int, schedule: Schedule, work: Path) -> dict[str, Any]:
    """One system on one workload and fleet size: every column, a number or the reason there is none."""
    why = cannot(peer.CANNOT, workload.name)
    if why:
        return {"cannot": why}
    print(f"  {peer.NAME}: {workload.name}, {servers} servers", flush=True)
    result = updates_run(peer, workload, servers, schedule.seconds, schedule.update_every_s, schedule.pause_s, work)
    if servers > 1 and not cannot(peer.CANNOT, "tokens_lost_on_server_kill"):
        result["kill"] = kill_run(peer, workload, servers, schedule.seconds, work)
        result["tokens_lost_on_server_kill"] = result["kill"]["tokens_lost_on_server_kill"]
    print(f"    {json.dumps({k: result.get(k) for k in COLUMNS})}", flush=True)
    return result


def system(peer: Any, workloads: list[Workload], sizes: list[int], schedule: Schedule, work: Path,
           prepare: bool = False) -> dict[str, Any]:
    """One system's entry of the results: its cells, or why it cannot run here (its install failing included)."""
    entry: dict[str, Any] = {"name": peer.NAME, "cannot": dict(peer.CANNOT)}
    if prepare:
        try:
            peer.prepare()
        except Exception as err:  # one peer that does not install here is a row of the table, not the end of it
            return entry | {"unavailable": f"its install failed: {type(err).__name__}: {err}"[:300]}
    why = peer.unavailable()
    if why:
        return entry | {"unavailable": why}
    entry["version"] = peer.version()
    entry["cells"] = {f"{w.name}/{n}": cell(peer, w, n, schedule, work / w.name / str(n)) for w in workloads
                      for n in sizes}
    return entry


def compare(peers: dict[str, Any], workloads: list[Workload], sizes: list[int], schedule: Schedule,
            command: str, prepare: bool = False) -> dict[str, Any]:
    """Every system one after the other, each on fresh fleets: the results (table.py renders them)."""
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        systems = {key: system(peer, workloads, sizes, schedule, Path(tmp) / key, prepare)
                   for key, peer in peers.items()}
    return {
        "command": command, "columns": COLUMNS, "workloads": {w.name: asdict(w) for w in workloads},
        "servers": sizes, "schedule": asdict(schedule), "group_size": GROUP_SIZE, "seed": SEED,
        "systems": systems, "wall_s": round(time.time() - started),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    # A stopped harness stops what it launched: SIGTERM unwinds like Ctrl-C (each run's process group, the fleets).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", default="beam-rl-prism", help="comma-separated keys (--list names them)")
    parser.add_argument("--workloads", default="short,long_tail,multi_turn")
    parser.add_argument("--servers", default="2,16", help="comma-separated fleet sizes")
    parser.add_argument("--seconds", type=float, default=Schedule.seconds, help="each run's work at full occupancy")
    parser.add_argument("--update-every", type=float, default=Schedule.update_every_s,
                        help="seconds between two weight updates")
    parser.add_argument("--pause", type=float, default=Schedule.pause_s, help="seconds each pause lasts")
    parser.add_argument("--prepare", action="store_true", help="install each peer's own venv first")
    parser.add_argument("--list", action="store_true", help="the peers that have landed, and exit")
    parser.add_argument("--out", type=Path, default=Path("bench/peers/results.json"))
    args = parser.parse_args(argv)
    available = all_peers()
    if args.list:
        for key, peer in available.items():
            print(f"{key}: {peer.NAME} ({peer.unavailable() or 'runnable'})")
        return {}
    keys = args.peers.split(",")
    unknown = [k for k in keys if k not in available]
    if unknown:
        raise SystemExit(f"--peers: unknown {', '.join(unknown)}; landed: {', '.join(available)}")
    report = compare({k: available[k] for k in keys}, [WORKLOADS[w] for w in args.workloads.split(",")],
                     [int(s) for s in args.servers.split(",")], Schedule(args.seconds, args.update_every, args.pause),
                     "python -m bench.peers.compare " + " ".join(sys.argv[1:] if argv is None else argv), args.prepare)
    write_results(str(args.out), report)
    return report


if __name__ == "__main__":
    main()
