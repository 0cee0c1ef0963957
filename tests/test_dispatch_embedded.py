"""The dispatcher against real embedded inference servers over loopback HTTP: group affinity, the
permit cap as the server itself counts it, and exactly-once emission under injected faults.

Expectations are exact where the servers make them so: `/metrics` counts the requests each server
received, and its fault sequence is a seeded RNG that the tests replay to know what was injected.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from beam_rl.dispatch import Dispatcher, DispatcherThread, ServerPool
from beam_rl.envs import make_env
from beam_rl.envs.base import Environment, SamplingParams
from beam_rl.inference.client import InferenceClient
from beam_rl.inference.faults import FaultConfig, FaultInjector
from beam_rl.inference.server import EmbeddedServer
from beam_rl.tinymodel import tiny_model_dir
from beam_rl.tokenizer import load_tokenizer
from beam_rl.types import GroupRequest, Rollout, RolloutStatus, make_group_id

pytestmark = pytest.mark.timeout(120)

ENV = "reverse_text"
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return tiny_model_dir(0, cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def env() -> Environment:
    return make_env(ENV, load_tokenizer("tiny"))


@pytest.fixture
def start_server(model_dir) -> Iterator[Callable[..., EmbeddedServer]]:
    """Starts embedded servers (tiny model unless mode="instant"); all are stopped afterwards."""
    started: list[EmbeddedServer] = []

    def start(**kwargs) -> EmbeddedServer:
        server = EmbeddedServer(model_dir if kwargs.get("mode", "model") == "model" else None, **kwargs)
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def group_requests(env: Environment, count: int, group_size: int) -> list[GroupRequest]:
    rows = env.load_rows("train")[:count]
    return [GroupRequest(make_group_id(0, i), 0, i, ENV, group_size, row) for i, row in enumerate(rows)]


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
) -> DispatcherThread:
    """Built like `beam_rl.components.dispatcher_thread`: clients are made on the dispatcher's loop.
    By default a failed server's rollouts are not re-dispatched, so each fault surfaces on its rollout."""
    stop = tuple(env.stop_token_ids())
    sampling = {ENV: SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, stop_token_ids=stop)}

    def build(next_group: Callable[[], GroupRequest | None]) -> Dispatcher:
        clients = [
            InferenceClient(url, model="tiny", timeout_s=timeout_s, max_retries=max_retries, backoff_s=0.01,
                            stream=stream, extra_body=extra_body)
            for url in urls
        ]
        # A short re-probe: a server taken out of service by injected faults comes back within the test.
        pool = ServerPool(clients, reprobe_s=0.5)
        return Dispatcher(
            pool, {ENV: env}, {ENV: mode}, sampling, max_inflight, version, next_group, seed=3,
            max_redispatches=max_redispatches,
        )

    return DispatcherThread(build, refresh_s=0.5, tick_s=0.05)


def run_groups(
    thread: DispatcherThread, requests: list[GroupRequest], deadline_s: float = 60.0
) -> list[Rollout]:
    """Every rollout of `requests`, checked to leave the dispatcher exactly once."""
    expected = sum(r.group_size for r in requests)
    thread.add_groups(requests)
    out: list[Rollout] = []
    deadline = time.monotonic() + deadline_s
    while len(out) < expected:
        assert time.monotonic() < deadline, f"only {len(out)} of {expected} rollouts came out"
        out += thread.poll(0.2)
    out += thread.poll(0.2)  # nothing may follow the last expected rollout
    ids = Counter(r.rollout_id for r in out)
    assert [i for i, k in ids.items() if k > 1] == []
    assert set(ids) == {f"{r.group_id}/{a}" for r in requests for a in range(r.group_size)}
    counters = thread.counters()
    assert counters["started"] == expected and counters["inflight"] == 0 and counters["cancelled"] == 0
    assert counters["ok"] + counters["errored"] == expected
    assert thread.inflight_groups() == [] and thread.pending_groups() == 0
    return out


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def requests_received(server: EmbeddedServer) -> int:
    return int(metrics(server.url)["beam_rl:requests_total"])


def injected(kind: str, rate: float, seed: int, requests: int) -> int:
    """How many of a server's first `requests` were given fault `kind`: its seeded sequence, replayed."""
    injector = FaultInjector(FaultConfig(**{f"{kind}_rate": rate}, seed=seed))
    return sum(injector.draw() == kind for _ in range(requests))


# -- group affinity ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["rollout", "group"])
def test_all_attempts_of_a_group_hit_one_server_and_share_its_prefix_cache(start_server, env, mode):
    servers = [start_server(), start_server()]
    requests = group_requests(env, 12, 4)
    with dispatcher_thread([s.url for s in servers], env, mode, max_inflight=16) as thread:
        rollouts = run_groups(thread, requests)

    assert all(r.ok for r in rollouts), [r.errors for r in rollouts if not r.ok][:3]
    assert all(1 <= r.completion_tokens <= MAX_TOKENS for r in rollouts)
    by_group: dict[str, set[str | None]] = defaultdict(set)
    for r in rollouts:
        by_group[r.group_id].add(r.server)
    assert all(len(urls) == 1 for urls in by_group.values()), by_group
    assert {r.server for r in rollouts} == {s.url for s in servers}  # least-loaded spreads the groups

    # The servers' own counters agree: one request per attempt (rollout mode) or per group, and a
    # group's prompt is prefilled once per server, so every later attempt is a prefix-cache hit.
    for server in servers:
        mine = [r for r in rollouts if r.server == server.url]
        sent = mine if mode == "rollout" else [r for r in mine if r.attempt == 0]
        queried = sum(len(r.prompt_ids) for r in sent)
        first_seen = sum(len(p) for p in {tuple(r.prompt_ids) for r in sent})
        seen = metrics(server.url)
        assert seen["beam_rl:requests_total"] == len(sent)
        assert seen["vllm:prefix_cache_queries_total"] == queried
        assert seen["vllm:prefix_cache_hits_total"] == queried - first_seen
        if mode == "rollout":
            assert seen["vllm:prefix_cache_hits_total"] == queried * 3 / 4


# -- the permit cap ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode, group_size", [("rollout", 4), ("group", 3)])
def test_a_server_never_runs_more_sequences_than_the_permit_cap(start_server, env, mode, group_size):
    cap = 6
    # Latency held while a request occupies its running slots makes the permitted requests overlap.
    server = start_server(mode="instant", faults=FaultConfig(latency_s=0.25))
    requests = group_requests(env, 8, group_size)
    with dispatcher_thread([server.url], env, mode, max_inflight=cap) as thread:
        rollouts = run_groups(thread, requests)

    assert all(r.ok for r in rollouts)
    seen = metrics(server.url)
    assert seen["beam_rl:max_concurrent_requests"] == cap  # reached, never exceeded
    assert seen["vllm:num_requests_running"] == 0 and seen["vllm:num_requests_waiting"] == 0
    assert seen["beam_rl:requests_total"] == (len(rollouts) if mode == "rollout" else len(requests))


# -- exactly-once emission under faults ----------------------------------------------------------

FAULTS = {
    # kind: what the errored rollout's error text says
    "error": "InferenceHTTPError: POST {url}/v1/completions: HTTP 500",
    "hang": "InferenceTimeout: POST {url}/v1/completions: no answer within 1s",
    "drop": "InferenceConnectionError: POST {url}/v1/completions: connection failed",
    "empty": "EmptyTrajectory: 1 turns, 0 completion tokens",
}
FAULT_RATE, FAULT_SEED = 0.4, 7


@pytest.mark.parametrize(
    "kind, mode",
    [("error", "rollout"), ("error", "group"), ("hang", "rollout"), ("drop", "rollout"), ("empty", "rollout")],
)
def test_injected_faults_surface_once_per_rollout_with_their_error(start_server, env, kind, mode):
    faulty = start_server(mode="instant", faults=FaultConfig(seed=FAULT_SEED, **{f"{kind}_rate": FAULT_RATE}))
    clean = start_server(mode="instant")
    group_size = 4
    requests = group_requests(env, 16, group_size)
    # max_retries=0: every injected fault must surface on a rollout rather than be retried away.
    with dispatcher_thread([faulty.url, clean.url], env, mode, max_inflight=16, timeout_s=1.0) as thread:
        rollouts = run_groups(thread, requests)

    sent_to_faulty = requests_received(faulty)
    faults = injected(kind, FAULT_RATE, FAULT_SEED, sent_to_faulty)
    per_request = 1 if mode == "rollout" else group_size
    assert 0 < faults < sent_to_faulty  # the faulty server answered some requests well, some not
    assert (sent_to_faulty + requests_received(clean)) * per_request == len(rollouts)  # one request per call

    errored = [r for r in rollouts if r.status is RolloutStatus.ERROR]
    assert len(errored) == faults * per_request
    assert all(r.server == faulty.url for r in errored)
    expected_error = FAULTS[kind].format(url=faulty.url)
    assert all(len(r.errors) == 1 and r.errors[0].startswith(expected_error) for r in errored), [
        r.errors for r in errored
    ][:3]
    assert all(r.completion_tokens == MAX_TOKENS for r in rollouts if r.ok)


def test_retries_turn_most_injected_errors_into_ok_rollouts(start_server, env):
    server = start_server(mode="instant")
    # Switched on at runtime, as an operator (or a chaos test) would; a new seed restarts the sequence.
    switched = httpx.post(server.url + "/faults", json={"error_rate": 0.5, "seed": FAULT_SEED}, timeout=10)
    assert switched.status_code == 200, switched.text
    requests = group_requests(env, 12, 4)
    with dispatcher_thread([server.url], env, "rollout", max_inflight=16, max_retries=2) as thread:
        rollouts = run_groups(thread, requests)

    sent = requests_received(server)
    faults = injected("error", 0.5, FAULT_SEED, sent)
    ok = [r for r in rollouts if r.ok]
    errored = [r for r in rollouts if not r.ok]
    # Each ok rollout is exactly one answered request; each errored one spent all 3 attempts on 500s.
    assert sent - faults == len(ok)
    assert faults >= 3 * len(errored) and sent <= 3 * len(rollouts)
    assert faults > len(rollouts) / 4  # errors were injected at scale, and retried
    assert all(r.errors[0].endswith("(after 3 attempts)") and "HTTP 500" in r.errors[0] for r in errored)
    assert len(ok) >= 0.7 * len(rollouts)  # P(3 errors in a row) = 1/8: most rollouts recover
