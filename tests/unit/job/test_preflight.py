"""The start-up checks of the servers (beam_rl/job/preflight.py), with what the wiring builds for them: the
servers' API key (from the environment variable the config names) and the check that every server accepts
it, over TLS this machine trusts, before a pipeline starts."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from beam_rl.wiring import job_parts
from beam_rl import wiring
from beam_rl.job.preflight import Problem, check_servers, refuse, server_problems
from beam_rl.config import config_from_dict
from beam_rl.inference.types import SamplingParams
from beam_rl.rundir.failures import ServersNotReadyError
from beam_rl.standin.server import EmbeddedServer
from tests.integration.test_security import self_signed  # noqa: F401  (a fixture: a self-signed certificate and its key)

pytestmark = pytest.mark.timeout(60)

KEY = "k-0f3a9"


def _config(urls, **inference):
    return config_from_dict({"envs": [{"name": "reverse_text"}], "inference": {"urls": urls, **inference}})


def test_the_right_key_passes_a_wrong_or_missing_one_stops_the_run_before_it_starts(monkeypatch):
    with EmbeddedServer(mode="instant", api_key=KEY) as server:
        monkeypatch.setenv("BEAM_RL_TEST_KEY", KEY)
        config = _config([server.url], api_key_env="BEAM_RL_TEST_KEY")
        check_servers(job_parts(config), [server.url])
        monkeypatch.setenv("BEAM_RL_TEST_KEY", "not-the-key")
        with pytest.raises(ValueError, match=rf"{server.url} refuses the API key in \$BEAM_RL_TEST_KEY") as info:
            check_servers(job_parts(config), [server.url])
        assert "not-the-key" not in str(info.value)
        with pytest.raises(ValueError, match="wants an API key .* set inference.api_key_env"):
            check_servers(job_parts(_config([server.url])), [server.url])
        monkeypatch.delenv("BEAM_RL_TEST_KEY")
        with pytest.raises(ValueError, match="names the environment variable BEAM_RL_TEST_KEY, which is not set"):
            check_servers(job_parts(config), [server.url])


def test_no_server_answering_at_start_is_an_error_within_the_start_up_patience(caplog):
    """Where nothing listens, the run does not start: named within inference.startup_timeout_s, not after
    the minutes a run waits for servers that were up. One server that answers is enough to start; the
    others are named in a warning and left to the dispatcher's re-probes."""
    with EmbeddedServer(mode="instant") as server:
        dead = server.url
    started = time.monotonic()
    with pytest.raises(ServersNotReadyError) as info:
        check_servers(job_parts(_config([dead], startup_timeout_s=1.0)), [dead])
    assert 1.0 <= time.monotonic() - started < 10
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"inference servers cannot serve this run: {dead} cannot "
                                                       "be reached (")
    assert message.endswith("; none answered within inference.startup_timeout_s = 1 s")
    with EmbeddedServer(mode="instant") as live:
        started = time.monotonic()
        check_servers(job_parts(_config([dead, live.url], startup_timeout_s=20.0)), [dead, live.url])
        assert time.monotonic() - started < 10  # not the patience: one server answered
    assert f"left to the dispatcher's re-probes: {dead} cannot be reached" in caplog.text


def test_https_servers_with_a_self_signed_certificate_need_its_ca_bundle(self_signed, monkeypatch):  # noqa: F811
    certfile, keyfile = self_signed
    monkeypatch.setenv("BEAM_RL_TEST_KEY", KEY)
    with EmbeddedServer(mode="instant", ssl_certfile=certfile, ssl_keyfile=keyfile, api_key=KEY) as server:
        with pytest.raises(ValueError, match="TLS failed .* set inference.ca_bundle"):
            check_servers(job_parts(_config([server.url], api_key_env="BEAM_RL_TEST_KEY")), [server.url])
        config = _config([server.url], api_key_env="BEAM_RL_TEST_KEY", ca_bundle=str(certfile))
        check_servers(job_parts(config), [server.url])

        async def complete():
            async with wiring.inference_client(config, server.url, wiring.api_key(config)) as client:
                return await client.complete([1, 2, 3], SamplingParams(max_tokens=4))

        (completion,) = asyncio.run(complete())
        assert len(completion.token_ids) == 4 and completion.policy_versions == [0] * 4


class _WithoutScaleOut(EmbeddedServer):
    """Answers the generate route as vLLM 0.32 does when started without --enable-scale-out."""

    async def _generate(self, request: web.Request) -> web.Response:
        message = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."
        return web.json_response({"error": {"message": message, "type": "PermissionDeniedError", "code": 403}},
                                 status=403)


def test_the_generate_route_is_checked_before_the_run_starts(monkeypatch):
    monkeypatch.setenv("BEAM_RL_TEST_KEY", KEY)
    with EmbeddedServer(mode="instant", api_key=KEY) as server:
        check_servers(job_parts(_config([server.url], api_key_env="BEAM_RL_TEST_KEY", route="generate")), [server.url])
    # Its 403 is told apart from a refused key: the key passed on /v1/models first.
    with _WithoutScaleOut(mode="instant", api_key=KEY) as server:
        config = _config([server.url], api_key_env="BEAM_RL_TEST_KEY", route="generate")
        with pytest.raises(ValueError, match=rf"{server.url} does not serve /inference/v1/generate \(HTTP 403\): "
                                             "start vLLM 0.32 or later with --enable-scale-out"):
            check_servers(job_parts(config), [server.url])
        check_servers(job_parts(_config([server.url], api_key_env="BEAM_RL_TEST_KEY")), [server.url])


class _WithoutKvMetrics(EmbeddedServer):
    """An OpenAI-compatible server whose /metrics says nothing of its KV cache (not vLLM's)."""

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="# TYPE requests_total counter\nrequests_total 3\n", content_type="text/plain")


def test_kv_concurrency_is_refused_before_the_run_starts_on_a_server_without_kv_metrics():
    kv = {"concurrency": {"mode": "kv"}}
    with EmbeddedServer(mode="instant") as server:
        check_servers(job_parts(config_from_dict({**_config([server.url]).model_dump(mode="json"), "dispatch": kv})),
                                 [server.url])
    with _WithoutKvMetrics(mode="instant") as server:
        config = config_from_dict({**_config([server.url]).model_dump(mode="json"), "dispatch": kv})
        with pytest.raises(ValueError, match=rf"{server.url}/metrics has no vllm:kv_cache_usage_perc, which "
                                             r"dispatch.concurrency.mode = \"kv\" reads"):
            check_servers(job_parts(config), [server.url])
        check_servers(job_parts(_config([server.url])), [server.url])  # fixed: /metrics is not needed


@pytest.mark.parametrize("rule", [None, "cancel_group"])
def test_the_dispatcher_gets_the_configs_stale_rule_and_its_pool_the_hooks_of_its_owners(rule):
    off_policy = {"stale_rule": rule} if rule else {}
    config = config_from_dict({"envs": [{"name": "reverse_text"}], "off_policy": off_policy})
    with wiring.dispatcher_thread(config, ["http://127.0.0.1:9"], {}, lambda: 0) as thread:
        dispatcher = thread.dispatcher
        assert dispatcher.stale_rule == (rule or "regenerate")
        # Handed down at construction: the host restores a server that was back, the dispatcher redoes
        # what ran on one that restarted.
        assert dispatcher.pool._restore == thread._restore
        assert dispatcher.pool._on_restart == dispatcher.redo_on_restarted


def test_fewer_servers_than_dispatch_shards_stops_the_run_before_it_starts():
    """Servers handed to start_rollouts (not the config's inference.urls) are counted too: a shard without
    a server of its own would fail inside a Beam worker."""
    config = config_from_dict({"envs": [{"name": "reverse_text"}], "dispatch": {"shards": 2}})
    with EmbeddedServer(mode="instant") as server:
        with pytest.raises(ValueError, match=r"^invalid config of this run: dispatch.shards: 2 shards need at least "
                                             r"as many inference servers; there are 1$"):
            check_servers(job_parts(config), [server.url])


def test_the_checks_return_their_problems_and_refuse_raises_them_as_one_error_of_their_kind():
    """A check says what is wrong without stopping anything; `refuse` is the one place a run is stopped."""
    with EmbeddedServer(mode="instant", api_key=KEY) as server:
        problems = server_problems(job_parts(_config([server.url])), [server.url])
        assert problems == [Problem(f"{server.url} wants an API key (HTTP 401): set inference.api_key_env",
                                    kind=ServersNotReadyError)]
    assert server_problems(job_parts(config_from_dict({"envs": [{"name": "reverse_text"}], "dispatch": {"shards": 2}})), []) == [
        Problem("2 shards need at least as many inference servers; there are 0", "dispatch.shards")]
    refuse([])  # nothing to refuse
    with pytest.raises(ServersNotReadyError, match=r"^inference servers cannot serve this run: a; b$"):
        refuse([Problem("a", kind=ServersNotReadyError), Problem("b", kind=ServersNotReadyError)])
    with pytest.raises(ValueError) as caught:  # ConfigError: every config problem, each at its key
        refuse([Problem("too big", "model.max_context"), Problem("too long", "inference.max_tokens")], "run.toml")
    assert caught.value.problems == [("model.max_context", "too big"), ("inference.max_tokens", "too long")]
