"""A black-box agent program through the dispatcher against real embedded servers: it trains what it sampled, with
per-token versions, and its rollout continues on another server with its tokens when its server dies (the inference
proxy's rules on their own: tests/unit/envs/test_proxy.py)."""

from __future__ import annotations

import pytest

from beam_rl.envs.base import Trajectory
from beam_rl.standin.faults import FaultConfig
from tests.support.dispatching import dispatcher_thread, group_requests, run_groups
from tests.unit.envs.test_proxy import agent_env, dataset  # noqa: F401 (a fixture)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def start_server(start_embedded):
    return lambda **kwargs: start_embedded(None, mode="instant", **kwargs)


def test_a_black_box_agent_through_the_dispatcher_trains_what_it_sampled_with_per_token_versions(
        tok, dataset, start_server):
    env = agent_env(tok, dataset)
    server = start_server(faults=FaultConfig(replies=["Forty two.", "It has ten characters."]))
    requests = group_requests(env, 4, 2)
    with dispatcher_thread([server.url], env, "rollout", max_inflight=8, max_tokens=24) as thread:
        rollouts = run_groups(thread, requests)

    assert all(r.ok for r in rollouts), [r.errors for r in rollouts if not r.ok][:3]
    for rollout in rollouts:
        info = rollout.info["agent"]
        assert info["replies"] == [env.decode(t.completion_ids) for t in rollout.turns]
        assert rollout.prompt_ids == env.render_prompt(rollout.row)
        closed = rollout.turns[0].completion_ids[-1] == tok.eos_token_id  # else the proxy closes the turn
        assert rollout.turns[1].env_ids == env.follow_ups.ids(
            [{"role": "tool", "name": "count_chars", "content": info["tool"]}], closed=closed)
        assert all(t.policy_versions == [0] * len(t.completion_ids) for t in rollout.turns)
        assert env.reward(rollout.row, Trajectory(rollout.turns, rollout.info)) == info["reward"]


def test_an_agents_rollout_continues_on_another_server_with_its_tokens_when_its_server_dies(
        tok, dataset, start_server):
    env = agent_env(tok, dataset)
    healthy = start_server(faults=FaultConfig(step_delay_s=0.005))
    dying = start_server(faults=FaultConfig(step_delay_s=0.005, die_after_tokens=30))
    requests = group_requests(env, 4, 2)
    with dispatcher_thread([dying.url, healthy.url], env, "rollout", max_inflight=8, timeout_s=2.0,
                           max_redispatches=3, stream=True, max_tokens=24) as thread:
        rollouts = run_groups(thread, requests)
        counters = thread.counters()

    assert all(r.ok for r in rollouts), [r.errors for r in rollouts if not r.ok][:3]
    assert counters["redispatched"] > 0
    assert all(r.discarded_tokens["server_failure"] == 0 for r in rollouts)  # streamed tokens were continued
    assert all(len(t.policy_versions) == len(t.completion_ids) for r in rollouts for t in r.turns)
    assert not thread.dispatcher.pool.servers[0].healthy  # it died
    # What the dying server streamed before it died is in the rollouts: every generated token arrived, but
    # the last step of each sequence it ran when it died (8 permits).
    generated = healthy.backend.generation_tokens + dying.backend.generation_tokens
    received = sum(r.completion_tokens for r in rollouts)
    assert dying.backend.generation_tokens > 0 and 0 <= generated - received <= 8, (generated, received)
