"""Figures 1 and 2: engine utilization and prefix-cache hit rate on simulated vLLM servers.

The same servers run three dispatch policies one after the other, each on its own fresh stream of
groups: beam-rl's dispatcher (least-loaded + group affinity, continuous admission), round-robin
without group affinity (the same dispatcher with its affinity rule replaced), and a naive loop that
dispatches a whole batch and waits for all of it before dispatching the next.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from beam_rl.dispatch import Dispatcher, DispatcherThread
from beam_rl.envs.base import SamplingParams
from beam_rl.inference.client import InferenceClient
from beam_rl.model.tokenizer import load_tokenizer
from beam_rl.types import GroupRequest
from bench.common.engines import FULL, SyntheticEnv, full_share, make_groups, step_traces

class RoundRobinDispatcher(Dispatcher):
    """Baseline: every rollout goes to the next server in turn, whatever group it belongs to."""

    _turn = itertools.count()

    def _pin_server(self, group):  # noqa: ANN001 - Dispatcher's hook
        healthy = self.pool.healthy()
        return healthy[next(self._turn) % len(healthy)] if healthy else None


def _dispatcher_thread(urls: list[str], cls: type[Dispatcher], permits: int, max_tokens: int) -> DispatcherThread:
    tokenizer = load_tokenizer("tiny")
    env = SyntheticEnv(tokenizer)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0, stop_token_ids=(tokenizer.eos_token_id,))

    def build(emit, restore) -> Dispatcher:  # noqa: ANN001 - DispatcherThread's build
        clients = [InferenceClient(u, model="tiny", timeout_s=600.0) for u in urls]
        return cls(clients, {"synthetic": env}, {"synthetic": "rollout"},
                   {"synthetic": sampling}, permits, lambda: 0, emit, restore=restore)

    return DispatcherThread(build, refresh_s=1.0, tick_s=0.05)


def _drive(host: DispatcherThread, groups: list[GroupRequest], batch_groups: int | None) -> list[float]:
    """Feed groups (all at once, or batch by batch waiting for each); returns rollout end times."""
    ends: list[float] = []
    chunks = [groups] if batch_groups is None else [groups[i:i + batch_groups] for i in range(0, len(groups), batch_groups)]
    for chunk in chunks:
        want = len(ends) + sum(g.group_size for g in chunk)
        host.add_groups(chunk)
        while len(ends) < want:
            for rollout in host.poll(1.0):
                if not rollout.ok:
                    raise RuntimeError(f"rollout {rollout.rollout_id} failed: {rollout.errors}")
                ends.append(rollout.t_finished)
    return sorted(ends)


async def _scrape(urls: list[str]) -> list[dict[str, float]]:
    async with httpx.AsyncClient(timeout=30) as client:
        texts = await asyncio.gather(*(client.get(f"{u}/metrics") for u in urls))
    out = []
    for response in texts:
        values = {s.name: s.value for f in text_string_to_metric_families(response.text) for s in f.samples}
        out.append(values)
    return out


async def _reset_caches(urls: list[str]) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        await asyncio.gather(*(client.post(f"{u}/reset_prefix_cache") for u in urls))


def run_policy(urls: list[str], name: str, groups: list[GroupRequest], permits: int, max_tokens: int,
               batch_groups: int | None = None) -> dict[str, Any]:
    asyncio.run(_reset_caches(urls))
    before = asyncio.run(_scrape(urls))
    cls = RoundRobinDispatcher if name == "round_robin" else Dispatcher
    t0 = time.time()
    with _dispatcher_thread(urls, cls, permits, max_tokens) as host:
        ends = _drive(host, groups, batch_groups)
    wall = time.time() - t0
    after = asyncio.run(_scrape(urls))
    # Steady state: between the 10th and the 90th percentile of rollout completions.
    start, end = ends[len(ends) // 10], ends[(len(ends) * 9) // 10]
    traces = asyncio.run(step_traces(urls, t0))
    shares = [full_share(tr, start, end) for tr in traces]
    hits = sum(a["vllm:prefix_cache_hits_total"] - b["vllm:prefix_cache_hits_total"] for a, b in zip(after, before))
    queries = sum(a["vllm:prefix_cache_queries_total"] - b["vllm:prefix_cache_queries_total"] for a, b in zip(after, before))
    tokens = sum(a["vllm:generation_tokens_total"] - b["vllm:generation_tokens_total"] for a, b in zip(after, before))
    return {
        "policy": name,
        "rollouts": len(ends),
        "permits": permits,
        "wall_s": round(wall, 3),
        "rollouts_per_s": round(len(ends) / wall, 2),
        "generation_tokens_per_s": round(tokens / wall, 1),
        "steady_state_s": round(end - start, 3),
        "full_share_per_server": [round(s, 4) for s in shares],
        "full_share_mean": round(float(np.mean(shares)), 4),
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None,
    }


def measure(size: dict[str, Any]) -> dict[str, Any]:
    """Figures 1 and 2 on `size["servers"]` simulated servers of `size["max_num_seqs"]` sequences."""
    servers, c, rollouts, group_size = size["servers"], size["max_num_seqs"], size["rollouts"], size["group_size"]
    groups = rollouts // group_size
    sim = size["sim_args"]
    # Permits: a queue of 25% beyond the engines' slots, so a finishing sequence's slot is refilled
    # by the server's own waiting queue at once, whichever group the next rollout belongs to.
    permits = int(servers * c * 1.25)
    from bench.common.procs import servers as start_servers

    results = {}
    with start_servers(servers, "simulated", c, sim) as (urls, _pids):
        for i, (name, batch) in enumerate([("beam_rl", None), ("round_robin", None),
                                           ("naive_batch", max(1, servers * c // group_size))]):
            results[name] = run_policy(urls, name, make_groups(groups, group_size, seed=i, tag=name),
                                       permits if batch is None else servers * c, size["max_tokens"], batch)
    return {
        "servers": servers,
        "max_num_seqs": c,
        "group_size": group_size,
        "rollouts_per_policy": groups * group_size,
        "simulated_server_args": list(sim),
        "full_threshold": FULL,
        "policies": results,
        "target_full_share": 0.95,
    }
