"""One dispatch shard against a simulated fleet of 10, 100 and 1,000 servers (issue 30): what the shard's own
process spends per streamed event and per rollout, and how full it keeps the engines; then the event rate
past which it no longer keeps them full.

    python -m bench.scale.scale --out bench/scale/scale.json [--size small|full] [--servers 10,100,1000]
        [--parts sizes,ceiling,compare,profile,chunks] [--stream-interval N]

- The dispatcher is the real one (`wiring.dispatcher_thread`, what a shard runs), in this process; the
  fleet is `beam_rl.standin.fleet` in processes of its own, so none of its CPU is counted here.
- Every fleet runs the engine's default cost model, time-scaled so that the fleet sends about the same
  events per second whatever its size: the sizes differ in servers and streams open, not in load.
- Measured over a window that opens once every engine has run full (its own `/metrics`, as the shard polls it)
  and a warm-up after that, at least `window_steps` engine steps long: this process's CPU (getrusage) and the
  dispatcher thread's (/proc), the events its streams parsed, the tokens they brought, the rollouts it
  finished; each engine's slots occupied over the window, from the engine's own step trace; the fleet
  processes' CPU (to show the fleet kept up). Beside it, the fleet's occupancy in 10 s slices from the shard's
  start, and when its permits were all taken and its engines all full: the start is not the steady state.
- `--stream-interval N`: the streamed rows ask for tokens in chunks of N (`inference.stream_interval`, under
  `weights.update_mode = "continue"`: under keep updates on the completions route a run streams a token an
  event); `chunks`: the streamed row at each size in chunks of the default, beside `sizes`' row of a token an
  event.
- `profile`: the largest fleet streaming, the dispatcher thread under cProfile.
- `compare`: the dispatcher before issue 30's two changes (open groups first walked every open group; the
  collector at CPython's default thresholds) against each in turn, on one fleet, side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import cProfile
import gc
import json
import pathlib
import pstats
import resource
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from beam_rl import wiring
from beam_rl.config import InferenceSection, config_from_dict
from beam_rl.dispatch import Dispatcher, DispatcherThread
from beam_rl.dispatch.heap import settle_heap
from beam_rl.dispatch.ledger import OpenGroup
from beam_rl.inference import client as inference_client
from beam_rl.inference.sse import EventData
from beam_rl.model.tokenizer import load_tokenizer
from beam_rl.standin.fleet import start_fleet
from beam_rl.standin.simulated import SimulatedParams
from beam_rl.types import GroupRequest
from bench.common.engines import SyntheticEnv, occupied_share, step_traces
from bench.common.procs import cpu_s

GROUP_SIZE = 4
# Permits per slot: a finished sequence's slot is refilled from the server's own queue at once. One request per
# rollout (env mode "rollout"), so that a permit is a sequence from its request to its end (the measurements here
# were made so, before a group request gave each choice's permit back as it ended). 8 slots x 1.5 = 12 permits a
# server, three groups of 4, so that group affinity spreads the first fill evenly (10 left half the servers a
# group short, and a thousand servers' slow steps take minutes to even that out).
QUEUE = 1.5
# The engines' lengths: log-normal with a long tail (p99 ~ 10x the median, capped at max_tokens).
LENGTH_MEDIAN, LENGTH_SIGMA, MAX_TOKENS = 32, 1.0, 2048

SLICE_S = 10.0  # the occupancy-over-time figure's slices

SIZES: dict[str, dict[str, Any]] = {
    # window_steps: a window spans at least this many engine steps. At 1,000 servers a step is 2.7 s: a 20 s window
    # is 7 steps, where one slot refilled a step late is 1/56 of a server's figure.
    "full": {
        "servers": (10, 100, 1000),
        "slots": 8,
        "tokens_per_s": 3000,
        "warm_s": 10.0,
        "window_s": 20.0,
        "window_steps": 24,
        "ceiling_servers": 100,
        "ceiling_window_s": 10.0,
        "ceiling_tokens_per_s": {"streaming": (2000, 4000, 6000, 8000), "non_streaming": (4000, 8000, 16000, 32000)},
        "compare_window_s": 15.0,
        "fleet_processes": 2,
    },
    "small": {
        "servers": (4,),
        "slots": 8,
        "tokens_per_s": 500,
        "warm_s": 2.0,
        "window_s": 4.0,
        "window_steps": 0,
        "ceiling_servers": 4,
        "ceiling_tokens_per_s": {"streaming": (500,), "non_streaming": (500,)},
        "ceiling_window_s": 3.0,
        "compare_window_s": 3.0,
        "fleet_processes": 1,
    },
}
KEPT_FULL = 0.98  # the ceiling: the highest rate at which the engines' slots stay this occupied
ROUTES = {"streaming": ("completions", True), "non_streaming": ("generate", False)}


def step_s(slots: int) -> float:
    """An engine step with every slot running, unscaled (the engine's default cost model, no prefill)."""
    p = SimulatedParams()
    return p.decode_base_s + p.decode_s_per_seq * slots


def time_scale(servers: int, slots: int, tokens_per_s: float) -> float:
    """The time scale at which `servers` full engines of `slots` sample `tokens_per_s` (one per sequence a step,
    streamed as one event each)."""
    return servers * slots / (tokens_per_s * step_s(slots))


class _CountedEvents(EventData):
    """EventData counting the events every stream of this process parsed (one class attribute, read by the
    window; one Python call per socket read, on both sides of any comparison)."""

    parsed = 0

    def feed(self, block: bytes) -> list[bytes]:
        found = super().feed(block)
        _CountedEvents.parsed += len(found)
        return found


class _Feeder:
    """Keeps `depth` groups waiting in the dispatcher, from prompts made once (so this thread costs little)."""

    def __init__(self, host: DispatcherThread, depth: int) -> None:
        self.host, self.depth, self.sent, self.finished, self.failed = host, depth, 0, 0, 0
        tokenizer = load_tokenizer("tiny")
        allowed = np.setdiff1d(np.arange(len(tokenizer)), np.array(sorted(tokenizer.all_special_ids)))
        rng = np.random.default_rng(0)
        self.prompts = [rng.choice(allowed, size=int(rng.integers(64, 257))).tolist() for _ in range(512)]

    def pump(self, wait_s: float) -> None:
        for rollout in self.host.poll(wait_s):
            self.finished += rollout.ok
            self.failed += not rollout.ok
        missing = self.depth - self.host.pending_groups()
        if missing > 0:
            self.host.add_groups(
                [
                    GroupRequest(
                        group_id=f"g{i}",
                        epoch=0,
                        index=i,
                        env_name="synthetic",
                        group_size=GROUP_SIZE,
                        row={"prompt_ids": self.prompts[i % len(self.prompts)]},
                    )
                    for i in range(self.sent, self.sent + missing)
                ]
            )
            self.sent += missing


def _dispatcher_tid() -> int:
    return next(t.native_id for t in threading.enumerate() if t.name == "beam-rl-dispatcher" and t.native_id)


def _process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@contextlib.contextmanager
def _instruments() -> Iterator[None]:
    """Meanwhile every stream of this process parses with _CountedEvents and the collector is timed; after,
    the collector is as it was (each shard settles the heap as its worker would: a test calls this too)."""
    plain, thresholds = inference_client.EventData, gc.get_threshold()
    inference_client.EventData = _CountedEvents
    gc.callbacks.append(_GC.callback)
    try:
        yield
    finally:
        inference_client.EventData = plain
        gc.callbacks.remove(_GC.callback)
        gc.set_threshold(*thresholds)
        gc.unfreeze()


def _snapshot(host: DispatcherThread, feeder: _Feeder, tid: int, fleet_pids: list[int]) -> dict[str, float]:
    _, servers = host.counters_and_servers()
    return {
        "t": time.time(),
        "process_cpu_s": _process_cpu_s(),
        "thread_cpu_s": cpu_s([tid]),
        "fleet_cpu_s": cpu_s(fleet_pids),
        "events": _CountedEvents.parsed,
        "rollouts": feeder.finished,
        "tokens": sum(s["tokens_received"] for s in servers),
        "gc_s": _GC.seconds,
        "gc_collections": _GC.count,
        "gc_full_s": _GC.full_seconds,
        "gc_full_collections": _GC.full_count,
    }


class _GCTime:
    """Wall time this process spends in the garbage collector, in any thread (its `callback` in gc.callbacks)."""

    def __init__(self) -> None:
        self.seconds, self.count, self._began = 0.0, 0, 0.0
        self.full_seconds, self.full_count = 0.0, 0  # of them, the collections of the oldest generation

    def callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        took = time.perf_counter() - self._began
        self.seconds += took
        self.count += 1
        if info["generation"] == 2:
            self.full_seconds += took
            self.full_count += 1


_GC = _GCTime()


def _profile_rows(profiler: cProfile.Profile, top: int = 25) -> list[dict[str, Any]]:
    """The functions with the most own time in the dispatcher thread over the window."""
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, primitive calls, own s, cumulative s, callers)
    rows = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    return [
        {
            "function": f"{pathlib.Path(file).name}:{line}({name})",
            "calls": calls,
            "own_s": round(own, 3),
            "cumulative_s": round(cumulative, 3),
        }
        for (file, line, name), (_, calls, own, cumulative, _) in rows
    ]


def _config(permits: int, route: str, stream: bool, stream_interval: int | None) -> Any:
    weights = {} if stream_interval is None else {"weights": {"update_mode": "continue"}}
    chunks = {} if stream_interval is None else {"stream_interval": stream_interval}
    return config_from_dict(
        {
            # The simulated engine's max_model_len: prompts of up to 256 tokens and the tail to MAX_TOKENS.
            "model": {"max_context": 4096},
            "batch": {"seq_len": 4096},
            # SyntheticEnv's rows (the kind only names a registered environment for the config's checks).
            "envs": [{"name": "synthetic", "kind": "reverse_text", "group_size": GROUP_SIZE, "mode": "rollout"}],
            "inference": {
                "max_inflight": permits,
                "max_tokens": MAX_TOKENS,
                "request_timeout_s": 3600.0,
                "stream": stream,
                "route": route,
                **chunks,
            },
            **weights,
        }
    )


def _pump_until(feeder: _Feeder, done: Callable[[], bool], limit_s: float = 600.0) -> float:
    """Keeps the backlog full until `done()`; returns when. `done` asks the dispatcher's loop, which may be busy
    for tens of seconds while thousands of requests leave at the start: a call that times out is a no."""
    deadline = time.time() + limit_s
    while time.time() < deadline:
        feeder.pump(0.05)
        with contextlib.suppress(TimeoutError):
            if done():
                return time.time()
    raise RuntimeError(f"the fleet was not running after {limit_s:.0f}s")


class _SeenFull:
    """Has every engine's own /metrics, as the shard polls it, shown all its slots running at least once? (Not
    all at one poll: in the steady state one engine of a thousand may be a sequence short at any instant.)"""

    def __init__(self, host: DispatcherThread, slots: int) -> None:
        self.host, self.slots, self.seen = host, slots, set[str]()

    def __call__(self) -> bool:
        _, servers = self.host.counters_and_servers()
        self.seen.update(s["url"] for s in servers if s["running"] is not None and s["running"] >= self.slots)
        return len(self.seen) == len(servers)


def _steps(trace: dict[str, Any], start: float, end: float) -> dict[str, Any]:
    """One engine's steps over [start, end): when each began (from `start`), how long it was planned to take, and
    how many sequences it ran."""
    kept = [i for i, t in enumerate(trace["t"]) if start <= t < end]
    return {
        "step_from_s": [round(trace["t"][i] - start, 2) for i in kept],
        "planned_s": [round(trace["duration"][i], 2) for i in kept],
        "running": [trace["running"][i] for i in kept],
    }


def _slices(traces: list[dict[str, Any]], began: float, end: float) -> list[dict[str, float]]:
    """The fleet's slots occupied in SLICE_S slices from `began` (the shard's start) to `end`."""
    rows = []
    for start in np.arange(began, end - SLICE_S / 2, SLICE_S).tolist():
        stop = min(start + SLICE_S, end)
        occupied = np.array([occupied_share(trace, start, stop) for trace in traces])
        rows.append(
            {
                "from_s": round(float(start - began), 1),
                "mean": round(float(occupied.mean()), 4),
                "min": round(float(occupied.min()), 4),
            }
        )
    return rows


def _read_traces(feeder: _Feeder, urls: list[str], since: float) -> list[dict[str, Any]]:
    """The engines' step traces, read while the shard still runs and its backlog stays full: once it closes the
    fleet unwinds thousands of streams at once, and a shard nobody polls closes itself. On a busy machine a
    thousand servers took minutes to answer."""

    async def read() -> list[dict[str, Any]]:
        # A hundred at a time, one for each of the client's connections: a thousand waiting on a hundred cost the
        # reader tens of CPU seconds in its connection pool.
        return [t for i in range(0, len(urls), 100) for t in await step_traces(urls[i : i + 100], since, 300.0)]

    with concurrent.futures.ThreadPoolExecutor(1) as reader:
        reading = reader.submit(asyncio.run, read())
        while not reading.done():
            feeder.pump(0.05)
        return reading.result()


def drive(
    urls: list[str],
    fleet_pids: list[int],
    route: str,
    stream: bool,
    slots: int,
    warm_s: float,
    window_s: float,
    profile: bool = False,
    heap: Callable[[], None] = settle_heap,
    stream_interval: int | None = None,
) -> dict[str, Any]:
    """One shard on `urls`: from its start until every engine ran full, warm_s more, then window_s; the window's
    figures (with `profile`, and the dispatcher thread's cProfile over the window: its CPU figures then include
    the profiler's own cost)."""
    permits = int(len(urls) * slots * QUEUE)
    config = _config(permits, route, stream, stream_interval)
    env = SyntheticEnv(load_tokenizer("tiny"))
    with wiring.dispatcher_thread(config, urls, {"synthetic": env}, lambda: 1, permits) as host:
        began = time.time()
        feeder = _Feeder(host, depth=permits // GROUP_SIZE + 1)
        heap()  # as a dispatch worker does once its source is built (transforms/dispatch.py)
        tid = _dispatcher_tid()
        # Every permit taken: thousands of requests, each leaving once the loop gets to it ...
        taken = _pump_until(feeder, lambda: host.counters()["inflight"] >= permits)
        # ... and every engine running them: until then the fleet is still starting, not kept (less) full.
        full = _pump_until(feeder, _SeenFull(host, slots))
        while time.time() < full + warm_s:
            feeder.pump(0.05)
        profiler = cProfile.Profile(time.thread_time)  # CPU, not wall: the loop waiting in epoll is not work
        if profile:
            host._call(profiler.enable)  # on the dispatcher's own thread, where its loop runs
        first = _snapshot(host, feeder, tid, fleet_pids)
        while time.time() < first["t"] + window_s:
            feeder.pump(0.05)
        last = _snapshot(host, feeder, tid, fleet_pids)
        if profile:
            host._call(profiler.disable)
        failed = feeder.failed
        traces = _read_traces(feeder, urls, began)
    occupied = np.array([occupied_share(trace, first["t"], last["t"]) for trace in traces])
    d = {k: last[k] - first[k] for k in first}
    events, rollouts, tokens = d["events"], d["rollouts"], d["tokens"]
    return {
        "route": route,
        "stream": stream,
        "stream_interval": config.stream_interval if stream else None,
        "servers": len(urls),
        "slots": slots,
        "permits": permits,
        "all_permits_taken_s": round(taken - began, 1),
        "all_engines_full_s": round(full - began, 1),
        "window_from_s": round(first["t"] - began, 1),
        "window_s": round(d["t"], 2),
        "slots_occupied_mean": round(float(occupied.mean()), 4),
        "slots_occupied_min": round(float(occupied.min()), 4),
        "slots_occupied_by_slice": _slices(traces, began, last["t"]),
        "lowest_server": _steps(traces[int(occupied.argmin())], first["t"], last["t"]),
        "events": int(events),
        "events_per_s": round(events / d["t"], 1),
        "tokens_returned": int(tokens),  # those of the requests that ended in the window
        "tokens_returned_per_s": round(tokens / d["t"], 1),
        "tokens_per_event": round(tokens / events, 2) if events else None,
        "gc_s": round(d["gc_s"], 3),
        "gc_collections": int(d["gc_collections"]),
        "gc_full_s": round(d["gc_full_s"], 3),
        "gc_full_collections": int(d["gc_full_collections"]),
        "rollouts": int(rollouts),
        "rollouts_per_s": round(rollouts / d["t"], 1),
        "rollouts_failed": failed,
        "process_cpu_s": round(d["process_cpu_s"], 2),
        "dispatcher_thread_cpu_s": round(d["thread_cpu_s"], 2),
        "process_cpu_share": round(d["process_cpu_s"] / d["t"], 3),
        "process_cpu_us_per_event": round(1e6 * d["process_cpu_s"] / events, 2) if events else None,
        "thread_cpu_us_per_event": round(1e6 * d["thread_cpu_s"] / events, 2) if events else None,
        "process_cpu_us_per_token": round(1e6 * d["process_cpu_s"] / tokens, 2) if tokens else None,
        "process_cpu_ms_per_rollout": round(1e3 * d["process_cpu_s"] / rollouts, 3) if rollouts else None,
        "fleet_cpu_share": round(d["fleet_cpu_s"] / d["t"], 3),
        **({"profile": _profile_rows(profiler)} if profile else {}),
    }


def _fleet_args(servers: int, slots: int, tokens_per_s: float) -> list[str]:
    scale = time_scale(servers, slots, tokens_per_s)
    return [
        "--max-num-seqs",
        str(slots),
        "--served-model-name",
        "tiny",
        "--sim-time-scale",
        f"{scale:.6g}",
        "--sim-length-median",
        str(LENGTH_MEDIAN),
        "--sim-length-sigma",
        str(LENGTH_SIGMA),
    ]


def one_fleet(
    servers: int,
    slots: int,
    tokens_per_s: float,
    kind: str,
    size: dict[str, Any],
    window_s: float,
    stream_interval: int | None = None,
) -> dict[str, Any]:
    """A fresh fleet of `servers`, time-scaled to `tokens_per_s`, driven by one fresh shard over a window of at
    least the size's `window_steps` engine steps."""
    scale = time_scale(servers, slots, tokens_per_s)
    route, stream = ROUTES[kind]
    window_s = max(window_s, size["window_steps"] * scale * step_s(slots))
    with start_fleet(servers, _fleet_args(servers, slots, tokens_per_s), size["fleet_processes"]) as (urls, pids):
        result = drive(
            urls,
            pids,
            route,
            stream,
            slots,
            size["warm_s"],
            window_s,
            stream_interval=stream_interval if stream else None,
        )
    result.update(
        kind=kind,
        time_scale=round(scale, 4),
        step_s_scaled=round(scale * step_s(slots), 4),
        target_tokens_per_s=tokens_per_s,
    )
    print(json.dumps({k: v for k, v in result.items() if k != "slots_occupied_by_slice"}), flush=True)
    return result


def sizes(size: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        one_fleet(n, size["slots"], size["tokens_per_s"], kind, size, size["window_s"], size["stream_interval"])
        for kind in ROUTES
        for n in size["servers"]
    ]


def chunks(size: dict[str, Any]) -> list[dict[str, Any]]:
    """The streamed row at each size in chunks of the default `inference.stream_interval` (or --stream-interval):
    its CPU per token returned beside `sizes`' streamed row, a token an event (under keep updates)."""
    interval = size["stream_interval"] or InferenceSection().stream_interval
    return [
        one_fleet(n, size["slots"], size["tokens_per_s"], "streaming", size, size["window_s"], interval)
        for n in size["servers"]
    ]


def ceiling(size: dict[str, Any]) -> dict[str, Any]:
    """One fleet size, its engines stepped ever faster: per route, the highest rate still >= 0.98 occupied."""
    out: dict[str, Any] = {}
    for kind in size["ceiling_tokens_per_s"]:
        rows = [
            one_fleet(size["ceiling_servers"], size["slots"], rate, kind, size, size["ceiling_window_s"])
            for rate in size["ceiling_tokens_per_s"][kind]
        ]
        kept = [r for r in rows if r["slots_occupied_mean"] >= KEPT_FULL]
        out[kind] = {"rows": rows, "highest_kept": max(kept, key=lambda r: r["target_tokens_per_s"]) if kept else None}
    return out


class _ScanningDispatcher(Dispatcher):
    """The rule open groups first as it was before issue 30, for the side-by-side measurement only: a walk over
    every open group, in admission order, to the first with an attempt still to start."""

    def _oldest_startable(self) -> OpenGroup | None:
        return next((g for g in self._groups.values() if g.rollouts_to_schedule > 0), None)


@contextlib.contextmanager
def _dispatcher_class(cls: type[Dispatcher]) -> Iterator[None]:
    plain = wiring.Dispatcher
    wiring.Dispatcher = cls
    try:
        yield
    finally:
        wiring.Dispatcher = plain


def profile(size: dict[str, Any]) -> dict[str, Any]:
    """The largest fleet, streaming, with the dispatcher thread under cProfile (CPU time) over the window: where a
    shard's CPU goes (the profiler's own cost inflates every figure)."""
    servers, slots = max(size["servers"]), size["slots"]
    args = _fleet_args(servers, slots, size["tokens_per_s"])
    with start_fleet(servers, args, size["fleet_processes"]) as (urls, pids):
        return drive(urls, pids, "completions", True, slots, size["warm_s"] / 2, size["compare_window_s"], profile=True)


def _freeze_only() -> None:
    """The dispatch worker's heap before issue 30: frozen once built, CPython's default thresholds."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(700, 10, 10)


# Side by side: before issue 30, the open-groups heap alone, and both changes (the tree as committed).
VARIANTS: dict[str, tuple[type[Dispatcher], Callable[[], None]]] = {
    "before": (_ScanningDispatcher, _freeze_only),
    "groups_heap": (Dispatcher, _freeze_only),
    "groups_heap_and_gc": (Dispatcher, settle_heap),
}


def compare(size: dict[str, Any]) -> dict[str, Any]:
    """VARIANTS on the largest fleet, each route, one after the other, each on a fresh fleet (a fleet that served
    a dispatcher before is still unwinding its thousands of closed streams)."""
    servers, slots = max(size["servers"]), size["slots"]
    args = _fleet_args(servers, slots, size["tokens_per_s"])
    out: dict[str, Any] = {
        "servers": servers,
        "slots": slots,
        "time_scale": round(time_scale(servers, slots, size["tokens_per_s"]), 4),
    }
    for kind, (route, stream) in ROUTES.items():
        out[kind] = {}
        for name, (cls, heap) in VARIANTS.items():
            with start_fleet(servers, args, size["fleet_processes"]) as (urls, pids), _dispatcher_class(cls):
                row = drive(urls, pids, route, stream, slots, size["warm_s"] / 2, size["compare_window_s"], heap=heap)
            print(json.dumps({"compare": name, "kind": kind, **row}), flush=True)
            out[kind][name] = row
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument(
        "--parts", default="sizes,ceiling", help="comma-separated: sizes, ceiling, compare, profile, chunks"
    )
    parser.add_argument(
        "--ceiling-tokens-per-s",
        default=None,
        help="comma-separated rates for the ceiling, in place of the size's (streaming only)",
    )
    parser.add_argument("--servers", default=None, help="comma-separated fleet sizes, in place of the size's")
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=None,
        help="the streamed rows ask for chunks of this many tokens (under continue updates)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    size = {**SIZES[args.size], "stream_interval": args.stream_interval}
    if args.servers:
        size["servers"] = tuple(int(n) for n in args.servers.split(","))
    if args.ceiling_tokens_per_s:
        size = {
            **size,
            "ceiling_tokens_per_s": {"streaming": tuple(int(r) for r in args.ceiling_tokens_per_s.split(","))},
        }
    parts = [p for p in args.parts.split(",") if p]
    result: dict[str, Any] = {
        "command": " ".join(["python -m bench.scale.scale", *(argv if argv is not None else sys.argv[1:])]),
        "size": args.size,
        "params": size,
        "length_median": LENGTH_MEDIAN,
        "length_sigma": LENGTH_SIGMA,
        "max_tokens": MAX_TOKENS,
        "group_size": GROUP_SIZE,
        "unscaled_step_s": step_s(size["slots"]),
    }
    with _instruments():
        for part in parts:
            result[part] = {
                "sizes": sizes,
                "ceiling": ceiling,
                "compare": compare,
                "profile": profile,
                "chunks": chunks,
            }[part](size)
            if args.out:  # after every part: a part takes minutes
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
