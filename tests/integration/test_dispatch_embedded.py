"""The dispatcher against real embedded inference servers over loopback HTTP: group affinity, the
permit cap as the server itself counts it, and exactly-once emission under injected faults.

Expectations are exact where the servers make them so: `/metrics` counts the requests each server
received, and its fault sequence is a seeded RNG that the tests replay to know what was injected.
"""

from __future__ import annotations

import dataclasses
import shutil
import socket
import time
from collections import defaultdict
from collections.abc import Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from beam_rl.envs import make_env
from beam_rl.envs.base import Environment
from beam_rl.inference.client import InferenceClient
from beam_rl.standin.faults import FaultConfig, FaultInjector
from beam_rl.standin.server import EmbeddedServer
from beam_rl.standin.simulated import SimulatedParams
from beam_rl.model.tokenizer import load_tokenizer
from beam_rl.types import GroupRequest, Rollout, RolloutStatus
from tests.support.dispatching import MAX_TOKENS, dispatcher_thread, group_requests, run_groups
from tests.support.server_helpers import served_versions

pytestmark = pytest.mark.timeout(120)

ENV = "reverse_text"


@pytest.fixture(scope="module")
def env() -> Environment:
    return make_env(ENV, load_tokenizer("tiny"))


@pytest.fixture
def start_server(model_dir, start_embedded) -> Callable[..., EmbeddedServer]:
    """Starts embedded servers (tiny model unless mode="instant"); all are stopped afterwards."""

    def start(**kwargs) -> EmbeddedServer:
        return start_embedded(model_dir if kwargs.get("mode", "model") == "model" else None, **kwargs)

    return start


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def requests_received(server: EmbeddedServer) -> int:
    return int(metrics(server.url)["beam_rl:requests_total"])


def wait_until_running(server: EmbeddedServer, deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    while metrics(server.url)["vllm:num_requests_running"] == 0:
        assert time.monotonic() < deadline, f"nothing ever ran on {server.url}"
        time.sleep(0.01)


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
    server = start_server(mode="instant", faults=FaultConfig())  # faults enabled, none injected yet
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


# -- per-token policy versions under each weight-update mode -------------------------------------------


@pytest.fixture(scope="module")
def weights_dir(model_dir, tmp_path_factory):
    """A checkpoint every backend accepts: the tiny model's own tensors."""
    directory = tmp_path_factory.mktemp("weights")
    for file in model_dir.glob("*.safetensors"):
        shutil.copy(file, directory)
    return directory


@pytest.mark.parametrize("backend", ["model", "simulated"])
@pytest.mark.parametrize("update_mode, stream, route, interval", [
    ("keep", True, "completions", 1), ("continue", True, "completions", 1), ("continue", False, "completions", 1),
    ("reload", True, "completions", 1),
    # vLLM's generate route labels each token's weights: keep needs no drain, and is exact unstreamed too.
    ("keep", True, "generate", 1), ("keep", False, "generate", 1), ("continue", True, "generate", 1),
    ("reload", True, "generate", 1),
    # Tokens in chunks of 5: continue's abort ends every chunk at the pause, the generate route's spans name
    # every token. A keep pause holds a partial chunk that the resume sends with new tokens, where the cut
    # cannot be seen: those requests' later tokens are unknown, never a wrong version.
    ("continue", True, "completions", 5), ("keep", True, "generate", 5), ("keep", True, "completions", 5)])
def test_each_tokens_policy_version_is_the_one_the_server_sampled_it_with(start_server, env, weights_dir, backend,
                                                                           update_mode, stream, route, interval,
                                                                           monkeypatch):
    payloads = []
    payload = InferenceClient._payload
    monkeypatch.setattr(InferenceClient, "_payload", lambda *a: payloads.append(payload(*a)) or payloads[-1])
    # Slow steps, long completions and an update every ~0.15 s: updates land in the middle of requests.
    server = start_server(mode=backend, faults=FaultConfig(step_delay_s=0.02),
                          **({"simulated": SimulatedParams(length_median=40)} if backend == "simulated" else {}))
    requests = group_requests(env, 6, 4)
    version = [0]
    with served_versions() as served, dispatcher_thread(
            [server.url], env, "group", max_inflight=16, stream=stream, version=lambda: version[0],
            extra_body={"return_weight_versions": True}, max_tokens=24, route=route,
            stream_interval=interval) as thread:
        thread.add_groups(requests)
        rollouts: list[Rollout] = []
        deadline = time.monotonic() + 90
        while len(rollouts) < 24:
            assert time.monotonic() < deadline, f"only {len(rollouts)} of 24 rollouts came out"
            rollouts += thread.poll(0.15)
            if version[0] < 8:
                (timing,) = thread.update_weights(weights_dir, version[0] + 1, update_mode)
                version[0] = timing.version
                assert timing.mode == update_mode and timing.reload_s > 0
                assert (timing.paused_s == 0) == (update_mode == "reload")

    assert all(r.ok for r in rollouts), [r.errors for r in rollouts if not r.ok][:3]
    recorded = [t.policy_versions for r in rollouts for t in r.turns]
    truth = [served[id(versions)] for versions in recorded]
    assert all(len(v) == len(t) > 0 for v, t in zip(recorded, truth))
    assert sum(len(set(t)) > 1 for t in truth) >= 4  # updates did land mid-request
    sampling = [p.get("sampling_params", p) for p in payloads]
    assert [s.get("stream_interval", 1) for s in sampling] == [interval] * len(payloads)  # asked in chunks
    if update_mode == "reload" or (update_mode, route, interval) == ("keep", "completions", 5):
        # No pause: the switch cannot be seen from outside; what is recorded is exact or unknown (-1).
        assert all(v in (-1, t_) for r, t in zip(recorded, truth) for v, t_ in zip(r, t))
        assert any(-1 in r for r in recorded)
    else:
        assert recorded == truth


# -- a failed server's rollouts continue elsewhere -------------------------------------------------------

SERVER_FAULTS = {
    "error": FaultConfig(error_rate=0.5, seed=FAULT_SEED),  # HTTP 500
    "drop": FaultConfig(drop_rate=0.5, seed=FAULT_SEED),  # connection reset, no answer
    "hang": FaultConfig(hang_rate=0.5, seed=FAULT_SEED),  # no answer within the timeout
    "die": FaultConfig(die_after_tokens=60),  # dies mid-request: every connection drops, the port closes
    "stopped": FaultConfig(),  # stopped once it has generated some tokens, never to return
    "refused": None,  # nothing listens on its port from the start
}


@pytest.mark.parametrize("fault, mode", [("error", "rollout"), ("drop", "rollout"), ("hang", "rollout"),
                                         ("die", "group"), ("die", "rollout"), ("stopped", "group"),
                                         ("refused", "rollout")])
def test_every_group_completes_on_the_remaining_servers_when_one_fails(start_server, env, fault, mode):
    healthy = [start_server(mode="instant", faults=FaultConfig(step_delay_s=0.005)) for _ in range(2)]
    faulty = None
    if SERVER_FAULTS[fault] is not None:
        faulty = start_server(mode="instant", faults=SERVER_FAULTS[fault].model_copy(update={"step_delay_s": 0.005}))
        faulty_url = faulty.url
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            faulty_url = f"http://127.0.0.1:{s.getsockname()[1]}"
    requests = group_requests(env, 16, 4)
    # The faulty server first in the pool: it gets the first groups. No retries on one server: every fault
    # goes to re-dispatch.
    with dispatcher_thread([faulty_url] + [s.url for s in healthy], env, mode, max_inflight=16, timeout_s=1.0,
                           max_redispatches=3, stream=True, max_tokens=24) as thread:
        if fault == "stopped":
            thread.add_groups(requests[:4])
            deadline = time.monotonic() + 30
            while faulty.backend.generation_tokens < 30:
                assert time.monotonic() < deadline
                time.sleep(0.005)
            faulty.stop()
            rollouts = run_groups(thread, requests[4:], expected_before=16)
        else:
            rollouts = run_groups(thread, requests)
        counters = thread.counters()

    assert all(r.ok for r in rollouts), [r.errors for r in rollouts if not r.ok][:3]
    assert counters["redispatched"] > 0 and counters["errored"] == 0
    assert all(r.discarded_tokens["server_failure"] == 0 for r in rollouts)  # streamed tokens were all continued
    # Every token a server generated reached a rollout, but what a dying server had not sent yet: at most
    # the last step of each sequence it ran (16 permits).
    generated = sum(s.backend.generation_tokens for s in healthy + ([faulty] if faulty else []))
    received = sum(r.completion_tokens + sum(r.discarded_tokens.values()) for r in rollouts)
    lost = generated - received
    assert 0 <= lost <= (16 if fault in ("die", "stopped") else 0), (generated, received)
    if fault in ("die", "stopped", "refused"):
        assert not thread.dispatcher.pool.servers[0].healthy


def test_a_server_dying_mid_chunk_leaves_every_token_it_streamed_in_the_rollouts_continued_elsewhere(start_server,
                                                                                                    env):
    """Streamed in chunks of 4, a dying server takes with it only the tokens of the chunks it had not sent: every
    token a client received (from it and from the others) is in a rollout, none sampled twice."""
    healthy = [start_server(mode="instant", faults=FaultConfig(step_delay_s=0.005)) for _ in range(2)]
    faulty = start_server(mode="instant", faults=FaultConfig(step_delay_s=0.005, die_after_tokens=62))
    with dispatcher_thread([faulty.url] + [s.url for s in healthy], env, "rollout", max_inflight=16, timeout_s=1.0,
                           max_redispatches=3, stream=True, stream_interval=4, max_tokens=24) as thread:
        rollouts = run_groups(thread, group_requests(env, 16, 4))
        counters, servers = thread.counters_and_servers()

    assert all(r.ok for r in rollouts), [r.errors for r in rollouts if not r.ok][:3]
    assert counters["redispatched"] > 0 and not thread.dispatcher.pool.servers[0].healthy
    assert all(r.discarded_tokens["server_failure"] == 0 for r in rollouts)
    received = sum(s["tokens_received"] for s in servers)
    assert servers[0]["tokens_received"] > 0  # the dying server's chunks reached rollouts
    assert received == sum(r.completion_tokens + sum(r.discarded_tokens.values()) for r in rollouts)
    # What it sampled but never sent: at most a partial chunk (3) and the last step of each sequence it ran.
    generated = sum(s.backend.generation_tokens for s in [faulty, *healthy])
    assert 0 <= generated - received <= 16 * 4


def test_a_server_down_during_an_update_is_left_out_and_takes_the_newest_weights_when_back(start_server, env,
                                                                                           weights_dir):
    up = start_server(mode="simulated", faults=FaultConfig(step_delay_s=0.005))
    down = start_server(mode="simulated", faults=FaultConfig(step_delay_s=0.005))
    port = down.port
    version = [0]
    with served_versions() as served, dispatcher_thread(
            [down.url, up.url], env, "group", max_inflight=16, stream=True, version=lambda: version[0],
            extra_body={"return_weight_versions": True}, max_tokens=12) as thread:
        down.stop()
        # The update goes on without it (no error for the run) and takes it out of service.
        (timing,) = thread.update_weights(weights_dir, 1, "keep")
        version[0] = 1
        assert timing.url == up.url
        assert not thread.dispatcher.pool.servers[0].healthy
        # Back on its port with its initial weights (version 0): it loads version 1 before its first request.
        back = start_server(mode="simulated", port=port, faults=FaultConfig(step_delay_s=0.005))
        deadline = time.monotonic() + 30
        while not thread.dispatcher.pool.servers[0].healthy:
            assert time.monotonic() < deadline, "the restarted server was never used again"
            time.sleep(0.05)
        assert back.backend.weights.loads == 1
        rollouts = run_groups(thread, group_requests(env, 8, 4))

    assert all(r.ok for r in rollouts) and {r.server for r in rollouts} == {back.url, up.url}
    truth = [served[id(t.policy_versions)] for r in rollouts for t in r.turns]
    assert all(t and set(t) == {1} for t in truth), truth  # every token sampled by version 1, on both servers


def test_a_server_restarted_between_updates_is_found_and_loads_the_newest_weights_before_more_work(
        start_server, env, weights_dir):
    first = start_server(mode="simulated", faults=FaultConfig(step_delay_s=0.005))
    other = start_server(mode="simulated", faults=FaultConfig(step_delay_s=0.005))
    version = [0]
    with served_versions() as served, dispatcher_thread(
            [first.url, other.url], env, "group", max_inflight=16, stream=True, version=lambda: version[0],
            extra_body={"return_weight_versions": True}, max_tokens=12) as thread:
        assert len(thread.update_weights(weights_dir, 1, "keep")) == 2
        version[0] = 1
        assert httpx.get(first.url + "/weight_info", timeout=10).json() == {"weight_version": "1"}
        # Restarted while idle: no request failed, nothing refused, so only its weights can give it away.
        port = first.port
        first.stop()
        back = start_server(mode="simulated", port=port, faults=FaultConfig(step_delay_s=0.005))
        assert back.backend.weights.loads == 0
        deadline = time.monotonic() + 30
        while back.backend.weights.loads != 1:
            assert time.monotonic() < deadline, "the restarted server never loaded the newest weights"
            time.sleep(0.05)
        rollouts = run_groups(thread, group_requests(env, 8, 4))

    assert all(r.ok for r in rollouts) and back.url in {r.server for r in rollouts}
    truth = [served[id(t.policy_versions)] for r in rollouts for t in r.turns]
    assert all(t and set(t) == {1} for t in truth), truth  # every token sampled by version 1, on both servers


def test_a_server_restarted_under_load_runs_nothing_on_its_initial_weights(start_server, env, weights_dir):
    """Killed and back on its port at once while it runs rollouts: whichever way the dispatcher learns of it
    (a dropped stream, a refused connection, its weights at a refresh), the rollouts it runs on its initial
    weights start again, it loads the newest before it takes more, and every group still completes once."""
    slow = FaultConfig(step_delay_s=0.02)
    first, other = start_server(mode="simulated", faults=slow), start_server(mode="simulated", faults=slow)
    version = [0]
    with served_versions() as served, dispatcher_thread(
            [first.url, other.url], env, "group", max_inflight=16, stream=True, version=lambda: version[0],
            extra_body={"return_weight_versions": True}, max_tokens=40, max_redispatches=3) as thread:
        assert len(thread.update_weights(weights_dir, 1, "keep")) == 2
        version[0] = 1
        requests = group_requests(env, 12, 4)
        thread.add_groups(requests[:4])
        wait_until_running(first)
        port = first.port
        first.stop()
        back = start_server(mode="simulated", port=port, faults=slow)
        rollouts = run_groups(thread, requests[4:], expected_before=16,
                              started_again=lambda c: c["redone_on_restart"])
        assert back.backend.weights.loads == 1

    assert all(r.ok for r in rollouts) and back.url in {r.server for r in rollouts}
    truth = [served[id(t.policy_versions)] for r in rollouts for t in r.turns]
    stamped = [list(t.policy_versions) for r in rollouts for t in r.turns]
    assert truth == stamped and all(set(t) == {1} for t in truth), truth


def test_rollouts_a_restarted_server_ran_on_its_initial_weights_start_again(start_server, env, weights_dir):
    """Found restarted while it runs rollouts (sent to it before anything noticed): they start again from
    their prompts, their tokens counted as lost to a server failure, and the server reloads the weights."""
    slow = FaultConfig(step_delay_s=0.02)
    first, other = start_server(mode="simulated", faults=slow), start_server(mode="simulated", faults=slow)
    version = [0]
    with dispatcher_thread(
            [first.url, other.url], env, "group", max_inflight=16, stream=True, version=lambda: version[0],
            max_tokens=40) as thread:
        assert len(thread.update_weights(weights_dir, 1, "keep")) == 2
        version[0] = 1
        requests = group_requests(env, 8, 4)
        thread.add_groups(requests[:4])
        wait_until_running(first)
        # What a restart nothing saw shows at a refresh: the label of its initial weights (only the label here,
        # so the launches it finds in flight are known to be there when it is found).
        httpx.post(first.url + "/update_weight_version", json={"new_version": "default"}, timeout=10)
        rollouts = run_groups(thread, requests[4:], expected_before=16,
                              started_again=lambda c: c["redone_on_restart"])
        counters = thread.counters()

    assert all(r.ok for r in rollouts)
    assert all(set(t.policy_versions) == {1} for r in rollouts for t in r.turns)
    redone = sum(r.discarded_tokens["server_failure"] for r in rollouts)
    assert counters["redone_on_restart"] > 0 and redone > 0, (counters, redone)
    assert first.backend.weights.loads == 2  # loaded again when found


# -- a living fleet (ServerPool.set_members) ---------------------------------------------------------


def test_a_server_that_joins_holds_the_newest_weights_before_its_first_request(start_server, env, weights_dir):
    slow = FaultConfig(step_delay_s=0.005)
    first = start_server(mode="simulated", faults=slow)
    version = [0]
    with served_versions() as served, dispatcher_thread(
            [first.url], env, "group", max_inflight=16, stream=True, version=lambda: version[0],
            extra_body={"return_weight_versions": True}, max_tokens=12) as thread:
        assert len(thread.update_weights(weights_dir, 1, "keep")) == 1
        version[0] = 1
        joiner = start_server(mode="simulated", faults=slow)
        thread.set_servers([first.url, joiner.url])
        rollouts = run_groups(thread, group_requests(env, 16, 4))
        _, servers = thread.counters_and_servers()

    assert joiner.backend.weights.loads == 1
    assert all(r.ok for r in rollouts) and joiner.url in {r.server for r in rollouts}
    truth = [served[id(t.policy_versions)] for r in rollouts if r.server == joiner.url for t in r.turns]
    assert truth and all(t and set(t) == {1} for t in truth), truth  # nothing ran on its initial weights
    joined = next(s for s in servers if s["url"] == joiner.url)
    assert joined["joined_at"] is not None and 0 < joined["join_s"] <= joined["join_to_first_request_s"]
    assert next(s for s in servers if s["url"] == first.url)["join_s"] is None  # there from the start


def test_a_server_that_leaves_drains_and_what_it_still_runs_moves_with_its_tokens(start_server, env):
    slow = FaultConfig(step_delay_s=0.02)
    long = SimulatedParams(length_median=400, length_sigma=0.1)  # every completion runs to max_tokens
    leaving = start_server(mode="simulated", faults=slow, simulated=long)
    staying = start_server(mode="simulated", faults=slow, simulated=long)
    with dispatcher_thread([leaving.url, staying.url], env, "group", max_inflight=16, stream=True,
                           max_tokens=40, drain_timeout_s=0.3) as thread:
        requests = group_requests(env, 4, 4)
        thread.add_groups(requests[:2])  # one group on each server (least loaded first)
        wait_until_running(leaving)
        thread.set_servers([staying.url])
        rollouts = run_groups(thread, requests[2:], expected_before=8)
        pool = [s.url for s in thread.dispatcher.pool.servers]
        counters = thread.counters()

    assert pool == [staying.url]  # gone from the pool once drained
    assert all(r.ok and r.completion_tokens == 40 for r in rollouts) and counters["errored"] == 0
    assert {r.server for r in rollouts} == {staying.url}  # what ran there finished on the other server
    assert sum(sum(r.discarded_tokens.values()) for r in rollouts) == 0
    # Continued from its tokens, not started again: the two servers sampled about the tokens the rollouts
    # hold (a leaving server may sample a token or two after its streams are cut).
    sampled = {s.url: metrics(s.url)["vllm:generation_tokens_total"] for s in (leaving, staying)}
    held = sum(r.completion_tokens for r in rollouts)
    assert 0 < sampled[leaving.url] < 4 * 40, sampled  # the drain timeout came while its group ran there
    assert held <= sum(sampled.values()) <= held + 4 * 2, (sampled, held)


def test_a_server_listed_again_while_it_drains_takes_new_groups(start_server, env):
    slow = FaultConfig(step_delay_s=0.02)
    first, second = start_server(mode="simulated", faults=slow), start_server(mode="simulated", faults=slow)
    with dispatcher_thread([first.url, second.url], env, "group", max_inflight=16, stream=True,
                           max_tokens=12, drain_timeout_s=30.0) as thread:
        requests = group_requests(env, 13, 4)
        thread.add_groups(requests[:1])
        wait_until_running(first)  # a server running nothing would leave at once
        thread.set_servers([second.url])
        drained = next(s for s in thread.dispatcher.pool.servers if s.url == first.url)
        assert drained.draining
        thread.set_servers([first.url, second.url])
        assert not drained.draining
        rollouts = run_groups(thread, requests[1:], expected_before=4)
        counters = thread.counters()

    assert all(r.ok for r in rollouts) and {r.server for r in rollouts} == {first.url, second.url}
    assert counters["redispatched"] == 0  # nothing was moved off it


# -- a rollout a checkpoint took in flight continues from its tokens ---------------------------------------


def test_a_checkpoint_keeps_a_launchs_finished_calls_and_the_one_in_flight_once_each():
    """A finished call is compacted only when a checkpoint takes its launch (most launches end first), and
    once: checkpoints taken again, and after another call, keep each call once, in call order."""
    from array import array
    from collections import deque
    from types import SimpleNamespace

    from beam_rl.dispatch.failover import LaunchClient
    from beam_rl.dispatch.ledger import Launch, OpenGroup
    from beam_rl.dispatch.resume import prompt_digest
    from beam_rl.inference.types import Completion

    group = OpenGroup(SimpleNamespace(group_id="g"), None, "rollout", None, [1, 2], deque())
    launch = Launch(group, (0,), None, version_start=3, t_start=0.0)
    assert launch.resume_point() is None  # no token yet
    first = Completion([5, 6], [-0.1, -0.7], "stop", [3, 3])
    LaunchClient._done(launch, prompt_digest([1, 2], 1), [first])
    launch.live_prompt = prompt_digest([1, 2, 5, 6, 9], 1)
    launch.progress.live = [Completion([8], [-0.3], None, [4])]
    point = launch.resume_point()
    assert launch.resume_point() == point
    assert [(c.prompt, c.finished, c.tokens) for c in point.calls] == [
        (prompt_digest([1, 2], 1), True, 2), (prompt_digest([1, 2, 5, 6, 9], 1), False, 1)]
    kept = point.calls[0].choices[0].completion()
    assert (kept.token_ids, kept.finish_reason, kept.policy_versions) == ([5, 6], "stop", [3, 3])
    assert kept.logprobs == array("f", first.logprobs).tolist()  # float32, as the windows store them
    assert point.oldest_version == 3
    second = Completion([8, 10], [-0.3, -0.4], "stop", [4, 4])
    LaunchClient._done(launch, launch.live_prompt, [second])
    assert [(c.finished, c.tokens) for c in launch.resume_point().calls] == [(True, 2), (True, 2)]


@pytest.mark.parametrize("versions, runs", [
    ([], ()), ([7] * 5, ((7, 5),)), ([3, 3, 4, 4, 4, 3, 5], ((3, 2), (4, 3), (3, 1), (5, 1))), ([2, 1], ((2, 1), (1, 1)))])
def test_a_kept_choice_gives_back_each_tokens_policy_version(versions, runs):
    """Versions are kept as runs: one run when one version sampled every token, and any order of updates
    and resumes (a version after a later one: a server restored to older weights) comes back as it was."""
    from beam_rl.dispatch.resume import Tokens
    from beam_rl.inference.types import Completion

    ids = list(range(len(versions)))
    kept = Tokens.of(Completion(ids, [-0.5] * len(ids), None, versions))
    assert kept.versions == runs
    assert kept.completion().policy_versions == versions and kept.completion().token_ids == ids


@pytest.mark.parametrize("mode", ["rollout", "group"])
def test_a_rollout_resumed_from_a_checkpoint_continues_from_its_tokens_and_their_versions(
        start_server, env, weights_dir, mode):
    long = SimulatedParams(length_median=400, length_sigma=0.1)  # every completion runs to max_tokens
    server = start_server(mode="simulated", faults=FaultConfig(step_delay_s=0.02), simulated=long)
    (request,) = group_requests(env, 1, 4)
    with dispatcher_thread([server.url], env, mode, max_inflight=4, stream=True, max_tokens=40) as first:
        first.add_groups([request])
        deadline = time.monotonic() + 30
        while not (points := first.resume_points()) or min(p.tokens_per_choice()[0] for p in points) < 5:
            assert time.monotonic() < deadline, "no tokens streamed"
            time.sleep(0.02)
        assert first.poll(0) == []  # taken mid-generation, like a checkpoint, and then the worker is gone
    kept = {a: c for p in points for a, c in zip(p.attempts, p.calls[-1].choices)}
    assert sorted(kept) == [0, 1, 2, 3] and all(0 < len(c) < 40 and not p.calls[-1].finished for p in points
                                                for c in p.calls[-1].choices)
    asked_before = len(server.requests_seen)

    version = [0]
    with dispatcher_thread([server.url], env, mode, max_inflight=4, stream=True, max_tokens=40,
                           version=lambda: version[0]) as restored:
        assert len(restored.update_weights(weights_dir, 1, "keep")) == 1  # the restored run is on newer weights
        version[0] = 1
        rollouts = run_groups(restored, [dataclasses.replace(request, resume=tuple(points))])
        counters = restored.counters()

    assert counters["resumed"] == 4 and counters["resumed_tokens"] == sum(len(c) for c in kept.values())
    asked = list(server.requests_seen)[asked_before:]
    prompt = len(request_prompt(env, request))
    # Each asked for the rest only: prompt + the tokens kept, 40 - those to go, under the attempt's seed.
    assert sorted((a.prompt_tokens - prompt, a.max_tokens) for a in asked) == sorted(
        (len(c), 40 - len(c)) for c in kept.values())
    for rollout in rollouts:
        (turn,) = rollout.turns
        before = kept[rollout.attempt].completion()
        assert rollout.ok and len(turn.completion_ids) == 40
        assert turn.completion_ids[:len(before.token_ids)] == before.token_ids
        assert turn.logprobs[:len(before.token_ids)] == before.logprobs
        # The kept tokens keep the version that sampled them; the rest are the restored run's.
        assert turn.policy_versions == [0] * len(before.token_ids) + [1] * (40 - len(before.token_ids))
        assert rollout.policy_version_start == 0 and sum(rollout.discarded_tokens.values()) == 0


def test_a_resumed_rollout_whose_oldest_token_is_past_the_off_policy_bound_starts_again(start_server, env):
    server = start_server(mode="simulated", faults=FaultConfig(step_delay_s=0.01))
    (request,) = group_requests(env, 1, 2)
    with dispatcher_thread([server.url], env, "rollout", max_inflight=2, stream=True, max_tokens=20) as first:
        first.add_groups([request])
        deadline = time.monotonic() + 30
        while len(points := first.resume_points()) < 2:
            assert time.monotonic() < deadline, "no tokens streamed"
            time.sleep(0.01)
    with dispatcher_thread([server.url], env, "rollout", max_inflight=2, stream=True, max_tokens=20,
                           version=lambda: 5) as restored:
        restored.dispatcher.max_off_policy_steps = 2  # version 5 - the kept tokens' 0 is past it
        rollouts = run_groups(restored, [dataclasses.replace(request, resume=tuple(points))])
        counters = restored.counters()
    assert counters["resumed"] == 0 and all(r.ok for r in rollouts)
    assert [r.discarded_tokens["stale"] for r in sorted(rollouts, key=lambda r: r.attempt)] == [
        p.tokens for p in sorted(points, key=lambda p: p.attempts)]


def request_prompt(env: Environment, request: GroupRequest) -> list[int]:
    return list(env.render_prompt(request.row))
