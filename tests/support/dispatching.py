"""A real dispatcher driven from a test: group requests from an environment's rows, a DispatcherThread built as a
shard builds it, and every rollout of some groups run through it and checked to leave exactly once."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from beam_rl.dispatch import Dispatcher, DispatcherThread, Restore
from beam_rl.envs.base import Environment, SamplingParams
from beam_rl.inference.client import InferenceClient
from beam_rl.types import GroupRequest, Rollout, make_group_id

MAX_TOKENS = 6


def group_requests(env: Environment, count: int, group_size: int) -> list[GroupRequest]:
    rows = env.load_rows("train")[:count]
    return [GroupRequest(make_group_id(0, i), 0, i, env.name, group_size, row) for i, row in enumerate(rows)]


def dispatcher_thread(
    urls: list[str],
    env: Environment,
    mode: str,
    max_inflight: int,
    *,
    timeout_s: float = 30.0,
    max_retries: int = 0,
    max_redispatches: int = 0,
    stream: bool = False,
    version: Callable[[], int] = lambda: 0,
    extra_body: dict | None = None,
    max_tokens: int = MAX_TOKENS,
    route: str = "completions",
    drain_timeout_s: float = 60.0,
    stream_interval: int = 1,
) -> DispatcherThread:
    """Built like `beam_rl.wiring.dispatcher_thread`: clients are made on the dispatcher's loop.
    By default a failed server's rollouts are not re-dispatched, so each fault surfaces on its rollout."""
    stop = tuple(env.stop_token_ids())
    sampling = {env.name: SamplingParams(max_tokens=max_tokens, temperature=1.0, stop_token_ids=stop)}

    def client(url: str) -> InferenceClient:
        return InferenceClient(url, model="tiny", timeout_s=timeout_s, max_retries=max_retries, backoff_s=0.01,
                               stream=stream, stream_interval=stream_interval, extra_body=extra_body, route=route)

    def build(emit: Callable[[Rollout], None], restore: Restore) -> Dispatcher:
        clients = [client(url) for url in urls]
        # A short re-probe: a server taken out of service by injected faults comes back within the test.
        return Dispatcher(
            clients, {env.name: env}, {env.name: mode}, sampling, max_inflight, version, emit, seed=3,
            max_redispatches=max_redispatches, restore=restore, reprobe_s=0.5,
        )

    return DispatcherThread(build, refresh_s=0.5, tick_s=0.05, connect=client, drain_timeout_s=drain_timeout_s)


def run_groups(
    thread: DispatcherThread, requests: list[GroupRequest], deadline_s: float = 60.0, expected_before: int = 0,
    started_again: Callable[[dict[str, int]], int] = lambda counters: 0,
) -> list[Rollout]:
    """Every rollout of `requests` (and of the `expected_before` rollouts added earlier), checked to leave
    the dispatcher exactly once; `started_again` says how many launches the counters show were relaunched."""
    expected = sum(r.group_size for r in requests) + expected_before
    thread.add_groups(requests)
    out: list[Rollout] = []
    deadline = time.monotonic() + deadline_s
    while len(out) < expected:
        assert time.monotonic() < deadline, f"only {len(out)} of {expected} rollouts came out"
        out += thread.poll(0.2)
    out += thread.poll(0.2)  # nothing may follow the last expected rollout
    ids = Counter(r.rollout_id for r in out)
    assert [i for i, k in ids.items() if k > 1] == []
    assert {f"{r.group_id}/{a}" for r in requests for a in range(r.group_size)} <= set(ids)
    counters = thread.counters()
    relaunched = started_again(counters)
    assert counters["started"] == expected + relaunched and counters["inflight"] == 0 and counters["cancelled"] == 0
    assert counters["ok"] + counters["errored"] == expected
    assert thread.inflight_groups() == [] and thread.pending_groups() == 0
    return out
