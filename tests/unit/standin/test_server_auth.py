"""The embedded server's control routes under an API key (beam_rl/standin/security.py:needs_key): every route
that changes the server's state refuses a request without the key, leaving the server as it was, and serves
one with it; the fault-injection route exists only on a server started with faults; the project's own client
(InferenceClient: weight updates, pause and resume, LoRA adapters) sends the key, and a run's embedded servers
require the key of `inference.api_key_env`."""

from __future__ import annotations

import asyncio
import json
import pathlib
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from beam_rl.wiring import job_parts
from beam_rl.job import servers
from beam_rl.config import config_from_dict
from beam_rl.inference.client import InferenceClient
from beam_rl.inference.errors import InferenceAuthError
from beam_rl.standin.backend import PauseState
from beam_rl.standin.faults import FaultConfig
from beam_rl.standin.server import EmbeddedServer
from beam_rl.model.tiny import tiny_model_dir

pytestmark = pytest.mark.timeout(120)

KEY = "sk-ctl-7d21e0"
UNAUTHORIZED = {"error": "Unauthorized"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> pathlib.Path:
    """An adapter as the instant backend takes one: a directory with peft's adapter_config.json."""
    path = tmp_path_factory.mktemp("adapter")
    (path / "adapter_config.json").write_text("{}")
    return path


@pytest.fixture(scope="module")
def keyed():
    with EmbeddedServer(mode="instant", api_key=KEY, faults=FaultConfig(), enable_lora=True) as server:
        yield server


# One client for every request of a test: a new httpx client builds an SSL context, ~0.1 s each.
HTTP = httpx.Client(timeout=30)


def state(server: EmbeddedServer) -> dict[str, Any]:
    """What the control routes change, read through the open routes and the server object."""
    return {
        "paused": HTTP.get(server.url + "/is_paused").json()["is_paused"],
        "label": HTTP.get(server.url + "/weight_info").json()["weight_version"],
        "loads": server.backend.weights.loads,
        "faults": server.faults.config.model_dump(),
        "adapters": dict(server.lora.loaded) if server.lora is not None else {},
        "cached_prompts": len(server.backend.prefix_cache._prompts),
    }


def send(server: EmbeddedServer, path: str, body: Any = None, key: str | None = KEY) -> httpx.Response:
    return HTTP.post(server.url + path, json=body, headers=bearer(key) if key else {})


# Each control route: (path and query, JSON body (ADAPTER: the adapter's directory), what to set up first (with
# the key), what the route changes).
Prepare = Callable[[EmbeddedServer, pathlib.Path], object]
CONTROL_ROUTES: dict[str, tuple[str, Any, Prepare, Callable[[dict, dict], bool]]] = {
    "pause": ("/pause?mode=keep", None, lambda s, a: None, lambda before, after: after["paused"]),
    "resume": ("/resume", None, lambda s, a: send(s, "/pause?mode=keep"), lambda before, after: not after["paused"]),
    "update_weight_version": ("/update_weight_version", {"new_version": "41"}, lambda s, a: None,
                              lambda before, after: after["label"] == "41"),
    "collective_rpc": ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "TINY"}},
                       lambda s, a: None, lambda before, after: after["loads"] == before["loads"] + 1),
    "faults": ("/faults", {"error_rate": 0.25}, lambda s, a: None,
               lambda before, after: after["faults"]["error_rate"] == 0.25),
    "reset_prefix_cache": ("/reset_prefix_cache", None,
                           lambda s, a: send(s, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 1}),
                           lambda before, after: (before["cached_prompts"], after["cached_prompts"]) == (1, 0)),
    "load_lora_adapter": ("/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": "ADAPTER"}, lambda s, a: None,
                          lambda before, after: "a1" in after["adapters"]),
    "unload_lora_adapter": ("/v1/unload_lora_adapter", {"lora_name": "a1"},
                            lambda s, a: send(s, "/v1/load_lora_adapter", {"lora_name": "a1", "lora_path": str(a)}),
                            lambda before, after: "a1" not in after["adapters"]),
}


def _body(body: Any, adapter: pathlib.Path) -> Any:
    """`body` with TINY and ADAPTER replaced by a checkpoint's and an adapter's directories."""
    text = json.dumps(body).replace("TINY", str(tiny_model_dir())).replace("ADAPTER", str(adapter))
    return json.loads(text)


def restore(server: EmbeddedServer) -> None:
    """Back to the module's server as it started (each test leaves it so)."""
    send(server, "/resume")
    send(server, "/faults", {"error_rate": 0.0})
    for name in list(server.lora.loaded):
        send(server, "/v1/unload_lora_adapter", {"lora_name": name})


@pytest.mark.parametrize("route", list(CONTROL_ROUTES))
def test_a_control_route_refuses_a_request_without_the_key_and_serves_one_with_it(keyed, adapter, route):
    path, body, prepare, changed = CONTROL_ROUTES[route]
    prepare(keyed, adapter)
    before = state(keyed)
    try:
        for headers in ({}, bearer("wrong"), {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
            response = HTTP.post(keyed.url + path, json=_body(body, adapter), headers=headers)
            assert response.status_code == 401 and response.json() == UNAUTHORIZED, (route, headers)
            assert "\n" not in response.text
            assert state(keyed) == before  # refused: nothing changed
        response = send(keyed, path, _body(body, adapter))
        assert response.status_code == 200, response.text
        assert changed(before, state(keyed)), route
    finally:
        restore(keyed)


def test_routes_that_only_read_stay_open_and_tokenize_wants_the_key(keyed):
    for path in ("/health", "/metrics", "/is_paused", "/weight_info", "/faults"):
        assert HTTP.get(keyed.url + path).status_code == 200, path
    refused = HTTP.post(keyed.url + "/tokenize", json={"prompt": "hi"})
    assert refused.status_code == 401 and refused.json() == UNAUTHORIZED
    assert HTTP.post(keyed.url + "/tokenize", json={"prompt": "hi"}, headers=bearer(KEY)).json()["count"]


# -- the fault-injection route: only on a server started with faults -------------------------------------------


def test_faults_route_is_absent_unless_the_server_was_started_with_faults(start_embedded):
    plain = start_embedded(mode="instant")  # the default: no faults
    for method in ("GET", "POST"):
        response = HTTP.request(method, plain.url + "/faults", json={"error_rate": 1.0})
        assert response.status_code == 404 and "\n" not in response.text.strip(), method
    assert plain.faults.config.error_rate == 0.0
    assert HTTP.post(plain.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 1}).status_code == 200
    faulty = start_embedded(mode="instant", faults=FaultConfig())
    assert HTTP.post(faulty.url + "/faults", json={"error_rate": 1.0}).status_code == 200
    assert HTTP.post(faulty.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 1}).status_code == 500


# -- the project's own client ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["keep", "reload"])
def test_the_project_client_updates_a_keyed_server_and_fails_without_the_key(start_embedded, mode):
    server = start_embedded(mode="instant", api_key=KEY)

    async def update(key: str | None) -> None:
        async with InferenceClient(server.url, api_key=key) as client:
            await client.update_weights(tiny_model_dir(), 1, mode)

    with pytest.raises(InferenceAuthError) as refused:
        asyncio.run(update(None))
    assert "HTTP 401" in str(refused.value) and "\n" not in str(refused.value)
    assert (server.backend.weights.loads, server.backend.weights.label) == (0, "default")
    assert server.gate.state == PauseState.UNPAUSED  # a refused pause left nothing paused
    asyncio.run(update(KEY))
    assert (server.backend.weights.loads, server.backend.weights.label) == (1, "1")
    assert server.gate.state == PauseState.UNPAUSED


def test_the_project_client_pauses_resumes_and_loads_adapters_with_the_key(start_embedded, adapter):
    server = start_embedded(mode="instant", api_key=KEY, enable_lora=True)

    async def control(key: str | None) -> list[bool]:
        async with InferenceClient(server.url, api_key=key) as client:
            await client.pause("keep")
            paused = server.gate.state == PauseState.PAUSED_ALL
            await client.resume()
            await client.load_lora_adapter("v1", str(adapter))
            loaded = "v1" in server.lora.loaded
            await client.unload_lora_adapter("v1")
            return [paused, loaded, "v1" not in server.lora.loaded]

    with pytest.raises(InferenceAuthError):
        asyncio.run(control(None))
    assert server.gate.state == PauseState.UNPAUSED
    assert asyncio.run(control(KEY)) == [True, True, True]


# -- a run's embedded servers ------------------------------------------------------------------------------------


def test_a_runs_embedded_servers_require_the_key_of_api_key_env_and_serve_no_faults(monkeypatch):
    monkeypatch.setenv("BEAM_RL_TEST_CTL_KEY", KEY)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    config = config_from_dict({"envs": [{"name": "reverse_text"}],
                               "inference": {"embedded_servers": 1, "embedded_mode": "instant",
                                             "api_key_env": "BEAM_RL_TEST_CTL_KEY"}})
    with servers.inference_servers(job_parts(config)) as (url,):
        assert HTTP.post(url + "/pause").status_code == 401
        assert HTTP.post(url + "/update_weight_version", json={"new_version": "9"}).status_code == 401
        assert HTTP.get(url + "/weight_info").json()["weight_version"] == "default"
        assert HTTP.post(url + "/pause", headers=bearer(KEY)).json() == {"status": "paused"}
        assert HTTP.post(url + "/resume", headers=bearer(KEY)).json() == {"status": "resumed"}
        assert HTTP.post(url + "/faults", json={}, headers=bearer(KEY)).status_code == 404
