"""Goodput under weights published every step and a server killed every 30 simulated seconds, for the old
cancel-whole-group behaviour and each weight-update mode, side by side: `python -m bench.recovery.goodput
[--size small|full] --out bench/recovery/goodput.json` (bench/README.md)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from beam_rl.config import config_from_dict
from beam_rl.inference.inflight import UNKNOWN_VERSION
from beam_rl.packing import goodput as fates
from beam_rl.processes import stop_processes
from beam_rl.rundir import CommitRecord, RunDir
from beam_rl.source import admission
from beam_rl.standin.launch import start_subprocess_server
from beam_rl.trainer.reader import StepReader
from bench.common.trainer import PublishEveryStep

# "cancel" is the behaviour before issue 13: reload under running requests, no streaming, a failed server's
# rollouts errored (no re-dispatch), a group past the bound cancelled whole (off_policy.stale_rule
# "cancel_group": the dispatcher's `cancel_stale`), and admission blind to the off-policy bound
# (`_admission_blind_to_the_bound`). "keep-blind" is keep with that admission alone.
CONFIGS: dict[str, dict[str, Any]] = {
    "cancel": {"update_mode": "reload", "stream": False, "max_redispatches": 0, "max_regenerations": 0,
               "blind_admission": True, "stale_rule": "cancel_group"},
    "keep-blind": {"update_mode": "keep", "blind_admission": True},
    "reload": {"update_mode": "reload"},
    "keep": {"update_mode": "keep"},
    "continue": {"update_mode": "continue"},
    # keep on vLLM's generate route, whose spans name each token's weights: no drain in the pause.
    "keep-generate": {"update_mode": "keep", "route": "generate"},
}

SIZES: dict[str, dict[str, Any]] = {
    # 4 servers x 256 slots; one simulated second is `time_scale` wall seconds.
    "full": {"servers": 4, "max_num_seqs": 256, "group_size": 8, "rollouts_per_step": 1024, "steps": 8,
             "max_tokens": 256, "permits": 1280, "time_scale": 0.25, "kill_every_sim_s": 30.0, "down_sim_s": 8.0,
             "length_median": 64, "length_sigma": 1.0, "bounds": (1, 2)},
    # A smoke test's size (tests/pipeline/test_bench.py): a death every 1.5 s of wall time.
    "small": {"servers": 2, "max_num_seqs": 16, "group_size": 4, "rollouts_per_step": 32, "steps": 5,
              "max_tokens": 64, "permits": 48, "time_scale": 0.05, "kill_every_sim_s": 30.0, "down_sim_s": 10.0,
              "length_median": 16, "length_sigma": 1.0, "bounds": (2,)},
}


def _server_counter(url: str, name: str) -> float:
    """One of the server's own counters since it started: vllm:generation_tokens_total (tokens it sampled),
    beam_rl:paused_seconds_total (from each pause call to its resume call, as the server saw them) or
    beam_rl:stalled_seconds_total (the part of those pauses its engine had sequences to step)."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


@dataclass
class _PauseSeconds:
    """The servers' pause counters, summed over servers and over each server's lives."""

    paused_s: float = 0.0
    stalled_s: float = 0.0

    def add(self, url: str) -> None:
        self.paused_s += _server_counter(url, "beam_rl:paused_seconds_total")
        self.stalled_s += _server_counter(url, "beam_rl:stalled_seconds_total")


def _tokens_received(run_dir: RunDir) -> dict[str, int]:
    """Per server url, the completion tokens the dispatcher got back from it (the status file)."""
    return {s["url"]: s["tokens_received"] or 0 for s in run_dir.read_status().get("servers", [])}


class Fleet:
    """Simulated servers as subprocesses, each on a port of its own that it keeps across a kill and restart."""

    def __init__(self, size: dict[str, Any]) -> None:
        self.args = ("--served-model-name", "tiny", "--sim-length-median", str(size["length_median"]),
                     "--sim-length-sigma", str(size["length_sigma"]), "--sim-time-scale", str(size["time_scale"]))
        self.max_num_seqs = size["max_num_seqs"]
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []

    def start(self, count: int) -> None:
        for _ in range(count):
            proc, url = start_subprocess_server(mode="simulated", max_num_seqs=self.max_num_seqs, extra_args=self.args)
            self.procs.append(proc)
            self.urls.append(url)

    def kill(self, index: int) -> None:
        self.procs[index].send_signal(signal.SIGKILL)
        self.procs[index].wait()

    def restart(self, index: int) -> None:
        port = urlsplit(self.urls[index]).port
        self.procs[index], _ = start_subprocess_server(
            mode="simulated", max_num_seqs=self.max_num_seqs, extra_args=(*self.args, "--port", str(port)))

    def stop(self) -> None:
        stop_processes(self.procs)


class Chaos(threading.Thread):
    """Kills one server (SIGKILL, round robin) every `kill_every_sim_s` simulated seconds from the first
    dispatch and starts it again on the same port `down_sim_s` later. At each death: what the server had
    sampled (its /metrics, read while a keep pause freezes it just before the kill) and what the dispatcher had
    received from it (the status file, read just before the restart, once the dead server's requests have all
    failed)."""

    def __init__(self, fleet: Fleet, run_dir: RunDir, size: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.fleet, self.run_dir = fleet, run_dir
        self.period_s = size["kill_every_sim_s"] * size["time_scale"]
        self.down_s = size["down_sim_s"] * size["time_scale"]
        self.stop = threading.Event()
        self.running = threading.Event()  # set while the pipeline runs: deaths outside it are no one's
        self.deaths: list[dict[str, Any]] = []
        self.pauses_before_deaths = _PauseSeconds()  # the killed servers' lives before their deaths
        self.error: BaseException | None = None

    def halt(self) -> None:
        """No more kills; returns once the thread is done (a server it had killed is back)."""
        self.running.clear()
        self.stop.set()
        self.join(60)

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001  (reported by the benchmark, never swallowed)
            self.error = e

    def _run(self) -> None:
        received_before = {url: 0 for url in self.fleet.urls}  # by each server's earlier lives
        victim = 0
        while not self.run_dir.read_status():  # the schedule starts with dispatch (the runner's start-up is not in it)
            if self.stop.wait(0.05):
                return
        while not self.stop.wait(self.period_s):
            if not self.running.is_set():
                continue
            url = self.fleet.urls[victim]
            self.pauses_before_deaths.add(url)
            # Frozen first, the engine samples nothing more: its count read now is what it generated in this
            # life. (The freeze is no update's: the dispatcher does not see it, and the counters it adds die
            # with the process.)
            httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=5).raise_for_status()
            generated = int(_server_counter(url, "vllm:generation_tokens_total"))
            scraped_at = time.time()
            self.fleet.kill(victim)
            killed_at = time.time()
            self.stop.wait(self.down_s)
            received = _tokens_received(self.run_dir).get(url, 0)
            self.deaths.append({"server": victim, "t": killed_at, "scrape_to_kill_s": round(killed_at - scraped_at, 5),
                                "generated": generated,
                                "returned": received - received_before[url],
                                "unreturned": generated - (received - received_before[url])})
            received_before[url] = received
            self.fleet.restart(victim)
            victim = (victim + 1) % len(self.fleet.urls)


@contextmanager
def _admission_blind_to_the_bound() -> Iterator[None]:
    """Admission as it was: no Hold.OFF_POLICY, however much work is queued ahead of a new group."""
    rule = admission.staleness_at_training
    admission.staleness_at_training = lambda *_: 0  # never past any bound
    try:
        yield
    finally:
        admission.staleness_at_training = rule


def run_config(name: str, bound: int, size: dict[str, Any], max_async_level: int = 1) -> dict[str, Any]:
    from beam_rl.job.rollouts import run_rollouts  # Beam: only where a pipeline runs

    overrides = CONFIGS[name]
    fleet = Fleet(size)
    with tempfile.TemporaryDirectory(prefix=f"bench-goodput-{name}-") as tmp:
        run_dir = RunDir(tmp)
        config = config_from_dict({
            "run": {"dir": tmp, "max_steps": size["steps"]},
            "model": {"max_context": 1024},
            "envs": [{"name": "reverse_text", "group_size": size["group_size"], "epochs": 100}],
            "batch": {"rollouts_per_step": size["rollouts_per_step"]},
            "inference": {"max_tokens": size["max_tokens"], "max_inflight": size["permits"],
                          "request_timeout_s": 30.0, "all_servers_down_timeout_s": 120.0,
                          **{k: overrides[k] for k in ("stream", "max_redispatches", "route") if k in overrides}},
            "off_policy": {"max_async_level": max_async_level, "max_off_policy_steps": bound,
                           **{k: overrides[k] for k in ("max_regenerations", "stale_rule") if k in overrides}},
            "weights": {"update_mode": overrides["update_mode"]},
        })
        trainer, chaos = PublishEveryStep(run_dir), None
        try:
            fleet.start(size["servers"])
            chaos = Chaos(fleet, run_dir, size)
            trainer.start()
            chaos.start()
            t0 = time.time()
            chaos.running.set()
            with ExitStack() as old_rules:
                if overrides.get("blind_admission"):
                    old_rules.enter_context(_admission_blind_to_the_bound())
                run_rollouts(config, fleet.urls, with_trainer=True)
            wall = time.time() - t0
            chaos.halt()
            pauses = chaos.pauses_before_deaths
            for url in fleet.urls:
                pauses.add(url)
        finally:
            if chaos is not None:
                chaos.halt()
            trainer.stop.set()
            trainer.join(10)
            fleet.stop()
        if chaos.error is not None:
            raise RuntimeError(f"chaos schedule failed in {name}") from chaos.error
        return _summary(run_dir, size, wall, chaos.deaths, pauses)


def _summary(run_dir: RunDir, size: dict[str, Any], wall: float, deaths: list[dict[str, Any]],
             pauses: _PauseSeconds) -> dict[str, Any]:
    steps = run_dir.committed_steps()
    commits = [run_dir.read_commit(s) for s in steps]
    by_fate: dict[str, int] = {}
    for c in commits:
        for fate, n in c.window.tokens_by_fate.items():
            by_fate[fate] = by_fate.get(fate, 0) + n
    # The same tokens from the windows' rows: every rollout's completion and what it threw away. Clean
    # rollouts not yet cut into a step when the run ended are counted by no window (their step never came).
    rows = [r for s in steps for r in run_dir.read_window(s).to_pylist()]
    generated = sum(r["completion_tokens"] + sum(v or 0 for v in r["discarded_tokens"].values()) for r in rows)
    uncut = sum(r["completion_tokens"] for r in rows if r["status"] == "ok" and not r["filtered"]) - sum(
        c.counts.trained_tokens for c in commits)
    updates = [m["weight_update"] for m in run_dir.read_metrics() if "weight_update" in m]
    # A step's time: from one commit to the next (the trainer publishes at once, so one update per step).
    step_s = (commits[-1].committed_at - commits[0].committed_at) / (len(commits) - 1) if len(commits) > 1 else None
    idle = [s["reload_s"] if s["mode"] == "reload" else s["paused_s"] for u in updates for s in u["servers"]]
    idle_mean = sum(idle) / len(idle) if idle else 0.0
    # The servers' own pause time over every paused update of every server (none in reload mode), and
    # the part of it their engines had sequences to step: the engine time the updates cost.
    paused_updates = sum(1 for u in updates for s in u["servers"] if s["mode"] != "reload")
    server_paused_mean = pauses.paused_s / paused_updates if paused_updates else None
    server_stalled_mean = pauses.stalled_s / paused_updates if paused_updates else None
    counted = sum(by_fate.values())
    unknown = sum(_trained_tokens_of_unknown_version(run_dir, s, c) for s, c in zip(steps, commits))
    no_shutdown = {f: n for f, n in by_fate.items() if f != fates.CANCELLED}
    lost_returned = by_fate.get(fates.SERVER_FAILURE, 0) + by_fate.get(fates.ERRORED, 0)
    stale_in_dispatch = sum(r["discarded_tokens"].get(fates.STALE) or 0 for r in rows)
    return {
        "steps": len(steps),
        "wall_s": round(wall, 1),
        "tokens_by_fate": dict(sorted(by_fate.items())),
        "tokens_counted": counted,
        "tokens_generated": generated,
        "tokens_clean_not_cut": uncut,
        "accounting_adds_up": counted == generated - uncut,
        # Side by side in one invocation only: wall time includes the runner's start-up.
        "trained_tokens_per_s": round(by_fate.get(fates.TRAINED, 0) / wall),
        "goodput": _round(fates.goodput(by_fate)),
        # Trained tokens the client could not tell the sampling weights of (-1 in the rank files).
        "trained_tokens_of_unknown_version": unknown,
        "goodput_excluding_filters": _round(fates.goodput(by_fate, exclude_filtered=True)),
        "goodput_excluding_filters_and_shutdown": _round(fates.goodput(no_shutdown, exclude_filtered=True)),
        # Stale tokens thrown away in dispatch (a rollout regenerated, or cancelled with its group); the
        # rest of tokens_by_fate["stale"] is what the stale filter dropped at packing.
        "stale_tokens_discarded_in_dispatch": stale_in_dispatch,
        "weight_updates": len(updates),
        "regenerated_rollouts": sum(u["regenerated_rollouts"] for u in updates),
        "cancelled_stale_rollouts": sum(u["cancelled_stale_rollouts"] for u in updates),
        "step_s": _round(step_s),
        "engine_idle_s_per_update": _round(idle_mean, 5),
        "engine_idle_per_update_share_of_step": _round(idle_mean / step_s, 5) if step_s else None,
        "server_paused_s_per_update": _round(server_paused_mean, 5),
        "server_paused_per_update_share_of_step": _round(server_paused_mean / step_s, 5)
        if step_s and server_paused_mean is not None else None,
        "engine_stalled_s_per_update": _round(server_stalled_mean, 5),
        "engine_stalled_per_update_share_of_step": _round(server_stalled_mean / step_s, 5)
        if step_s and server_stalled_mean is not None else None,
        # Seconds the source held admission back, by reason (admission.Hold), over the whole run.
        "held_back_s": run_dir.read_status().get("held_back_s"),
        "deaths": deaths,
        "server_deaths": len(deaths),
        "unreturned_tokens_per_death": _round(sum(d["unreturned"] for d in deaths) / len(deaths)) if deaths else None,
        # Tokens the dispatcher had received and then could not use because a server died (fates
        # server_failure and, where re-dispatch is off, errored).
        "returned_tokens_lost_per_death": _round(lost_returned / len(deaths)) if deaths else None,
    }


def _trained_tokens_of_unknown_version(run_dir: RunDir, step: int, record: CommitRecord) -> int:
    return sum(int(np.count_nonzero((mb["policy_versions"] == UNKNOWN_VERSION) & mb["loss_mask"]))
               for rank in range(record.counts.ranks)
               for mb in StepReader(run_dir, rank).read_step(step, record=record))


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def measure(size_name: str, configs: list[str], done: Callable[[dict[str, Any]], None] = lambda _: None,
            bounds: tuple[int, ...] | None = None, max_async_level: int = 1) -> dict[str, Any]:
    """Every configuration at every bound, one after the other; `done` gets the results so far after each."""
    size = SIZES[size_name]
    result: dict[str, Any] = {"size": size_name, "setup": dict(size) | {"max_async_level": max_async_level},
                              "configs": {c: CONFIGS[c] for c in configs}, "results": {}}
    for bound in bounds or size["bounds"]:
        for name in configs:
            print(f"max_off_policy_steps={bound} {name} ...", file=sys.stderr, flush=True)
            result["results"].setdefault(f"max_off_policy_steps={bound}", {})[name] = run_config(name, bound, size, max_async_level)
            done(result)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated of {', '.join(CONFIGS)}")
    parser.add_argument("--bounds", default=None, help="comma-separated max_off_policy_steps (default: the size's)")
    parser.add_argument("--max-async-level", type=int, default=1, help="off_policy.max_async_level")
    parser.add_argument("--out", default="bench/recovery/goodput.json")
    args = parser.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        parser.error(f"--configs: unknown {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    t0 = time.time()
    head = {"command": " ".join(["python -m bench.recovery.goodput", *(argv if argv is not None else sys.argv[1:])]),
            "machine": {"cpus": os.cpu_count()}}

    def write(so_far: dict[str, Any]) -> None:  # after each configuration: a long run's results survive it
        with open(args.out, "w") as f:
            json.dump(head | so_far | {"elapsed_s": round(time.time() - t0, 1)}, f, indent=1)

    bounds = tuple(int(b) for b in args.bounds.split(",")) if args.bounds else None
    result = measure(args.size, configs, write, bounds, args.max_async_level)
    print(json.dumps({k: {c: {m: r[m] for m in ("goodput_excluding_filters", "trained_tokens_per_s",
                                               "engine_idle_per_update_share_of_step",
                                               "engine_stalled_per_update_share_of_step",
                                               "unreturned_tokens_per_death", "returned_tokens_lost_per_death")}
                          for c, r in v.items()} for k, v in result["results"].items()}, indent=1))


if __name__ == "__main__":
    main()
