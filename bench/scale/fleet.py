"""A living fleet (docs/fleet.md), measured on subprocess servers driven by the real dispatcher:

1. Join to first request: a server is listed while the dispatcher is busy on the others; the time until
   it holds the current weights and until its first rollout starts, against the same weight load alone
   on the same server while idle (target: at most the load plus 1 s). Engines: the simulated one, and
   the tiny model on CPU (`--mode model`, a real safetensors load).
2. Utilization while the fleet changes: 8 simulated servers, the dispatcher's fleet 4 -> 8 -> 2 of them
   with a backlog of groups throughout; per phase, the share of time each member engine ran full (its
   own step trace), and how long the 4 that join take to run full.

    python -m bench.scale.fleet --out bench/scale/fleet.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import numpy as np

from beam_rl import wiring
from beam_rl.config import config_from_dict
from beam_rl.dispatch import DispatcherThread
from beam_rl.inference.client import InferenceClient
from beam_rl.model.tiny import tiny_model_dir
from beam_rl.model.tokenizer import load_tokenizer
from bench.common.engines import SyntheticEnv, full_share, make_groups, occupied_share, step_traces
from bench.common.pipeline import SIM_SMALL
from bench.common.procs import servers as start_servers

SLOTS = 16  # max_num_seqs of every server
# Engine steps 4x the small figure's: eight servers streaming every token to one dispatcher on two cores
# would otherwise measure the machine's CPU, not the fleet (engine steps that ran late count as not full).
FLEET_SIM = (*SIM_SMALL, "--sim-time-scale", "4")


def _config(max_inflight: int, max_tokens: int):
    return config_from_dict({
        "envs": [{"name": "synthetic", "kind": "reverse_text", "group_size": 4}],  # bench.common.engines.SyntheticEnv
        "inference": {"max_inflight": max_inflight, "max_tokens": max_tokens, "request_timeout_s": 600.0,
                      "drain_timeout_s": 2.0},
    })


def _dispatcher(urls: list[str], max_inflight: int, max_tokens: int) -> DispatcherThread:
    config = _config(max_inflight, max_tokens)
    env = SyntheticEnv(load_tokenizer("tiny"))
    return wiring.dispatcher_thread(config, urls, {"synthetic": env}, lambda: 1, max_inflight)


class Backlog:
    """Keeps `depth` groups waiting in the dispatcher; counts what comes back."""

    def __init__(self, host: DispatcherThread, depth: int, tag: str) -> None:
        self.host, self.depth, self.tag = host, depth, tag
        self.sent = self.ok = self.failed = 0
        self.discarded_tokens = 0

    def pump(self, wait_s: float) -> None:
        for rollout in self.host.poll(wait_s):
            self.ok += rollout.ok
            self.failed += not rollout.ok
            self.discarded_tokens += sum(rollout.discarded_tokens.values())
        missing = self.depth - self.host.pending_groups()
        if missing > 0:
            self.host.add_groups(make_groups(missing, 4, seed=self.sent, tag=f"{self.tag}/{self.sent}"))
            self.sent += missing


def _server_entry(host: DispatcherThread, url: str) -> dict[str, Any]:
    _, servers = host.counters_and_servers()
    return next((s for s in servers if s["url"] == url), {})


def _load_alone_s(url: str) -> float:
    async def load() -> float:
        async with InferenceClient(url, model="tiny", timeout_s=600.0) as client:
            started = time.monotonic()
            await client.update_weights(tiny_model_dir(), 1, "reload")
            return time.monotonic() - started

    return asyncio.run(load())


def join_to_first_request(mode: str, trials: int) -> dict[str, Any]:
    extra = SIM_SMALL if mode == "simulated" else ()
    with start_servers(1 + trials, mode, SLOTS, extra) as (urls, _pids):
        base, joiners = urls[:1], urls[1:]
        rows = []
        with _dispatcher(base, max_inflight=2 * SLOTS, max_tokens=32) as host:
            host.update_weights(tiny_model_dir(), 1, "reload")
            backlog = Backlog(host, depth=2 * SLOTS // 4, tag=f"join-{mode}")
            members = list(base)
            for url in joiners:
                load_s = _load_alone_s(url)
                members.append(url)
                host.set_servers(members)
                deadline = time.monotonic() + 120
                while (entry := _server_entry(host, url)).get("join_to_first_request_s") is None:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{url} never took a request")
                    backlog.pump(0.01)
                rows.append({"load_alone_s": round(load_s, 3), "join_s": entry["join_s"],
                             "join_to_first_request_s": entry["join_to_first_request_s"],
                             "over_load_s": round(entry["join_to_first_request_s"] - load_s, 3)})
    over = [r["over_load_s"] for r in rows]
    return {"engine": mode, "trials": rows, "over_load_s_max": max(over), "over_load_s_median": float(np.median(over)),
            "target_over_load_s": 1.0, "met": max(over) <= 1.0}


def _phase(host: DispatcherThread, backlog: Backlog, name: str, members: list[str], phase_s: float) -> dict[str, Any]:
    """The fleet becomes `members` for `phase_s`; each member's engine, measured once the change settled."""
    started = time.time()
    host.set_servers(members)
    end = started + phase_s
    while time.time() < end:
        backlog.pump(0.05)
    traces = asyncio.run(step_traces(members, started))
    steady = started + phase_s / 4
    shares = [full_share(tr, steady, end) for tr in traces]
    occupied = [occupied_share(tr, steady, end) for tr in traces]
    return {"phase": name, "servers": len(members), "seconds": phase_s,
            "full_share_mean": round(float(np.mean(shares)), 4),
            "full_share_per_server": [round(s, 4) for s in shares],
            "slots_occupied_mean": round(float(np.mean(occupied)), 4)}


def fleet_utilization(phase_s: float) -> dict[str, Any]:
    """The fleet 4 -> 8 -> 2 servers, then (side by side, the baseline) each size held from the start on
    the same servers."""
    permits = int(8 * SLOTS * 1.25)
    with start_servers(8, "simulated", SLOTS, FLEET_SIM) as (urls, _pids):
        with _dispatcher(urls[:4], max_inflight=permits, max_tokens=64) as host:
            backlog = Backlog(host, depth=permits // 4, tag="fleet")
            changing = [_phase(host, backlog, name, urls[:size], phase_s)
                        for name, size in (("4 servers", 4), ("grown to 8", 8), ("shrunk to 2", 2))]
            counters = host.counters()
        fixed = []
        for size in (4, 8, 2):
            with _dispatcher(urls[:size], max_inflight=permits, max_tokens=64) as host:
                fixed.append(_phase(host, Backlog(host, depth=permits // 4, tag=f"fixed-{size}"),
                                    f"{size} from the start", urls[:size], phase_s))
    for phase, baseline in zip(changing, fixed, strict=True):
        phase["slots_occupied_vs_fixed"] = round(phase["slots_occupied_mean"] / baseline["slots_occupied_mean"], 4)
    return {"changing": changing, "fixed": fixed, "permits": permits, "max_num_seqs": SLOTS,
            "rollouts_ok": backlog.ok, "rollouts_failed": backlog.failed,
            "tokens_discarded": backlog.discarded_tokens, "moved_off_leaving_servers": counters["redispatched"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/scale/fleet.json")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--phase-s", type=float, default=10.0)
    args = parser.parse_args()
    result = {
        "join": [join_to_first_request(mode, args.trials) for mode in ("simulated", "model")],
        "utilization": fleet_utilization(args.phase_s),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
