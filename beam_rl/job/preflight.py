"""Start-up checks of a run: is every inference server ready to serve it, before a pipeline starts."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from beam_rl.components import api_key, inference_client
from beam_rl.config import ConfigError, RunConfig, shards_problem
from beam_rl.inference.client import (
    LORA_SERVER_HINT,
    InferenceAuthError,
    InferenceClient,
    InferenceError,
    InferenceHTTPError,
)
from beam_rl.rundir.failures import ServersNotReadyError

_LOG = logging.getLogger(__name__)


def check_servers(config: RunConfig, server_urls: list[str]) -> None:
    """Before a pipeline starts, every server is asked what it serves (`/v1/models`, which vLLM guards
    with its API key; on the generate route also for one token there), all in parallel.
    - A refused key, an untrusted certificate or a missing route: ServersNotReadyError naming the server.
    - No server answering within `inference.startup_timeout_s`: ServersNotReadyError naming each and what
      it last said; a run never waits the longer `inference.all_servers_down_timeout_s` for servers that
      were never up (the dispatcher keeps the short patience too until one answers a request).
    - Some answering: the others are named in a warning and left to the dispatcher's re-probes.
    - With dispatch.concurrency.mode = "kv": a server whose /metrics has no KV-cache usage is refused.
    - With trainer.lora: a server without vLLM's runtime LoRA routes is refused.
    - A server whose context (max_model_len in /v1/models) is below model.max_context is refused.
    No completion is requested on the completions route: a server's own counters see only the run.
    Each dispatch shard drives servers of its own: at least `dispatch.shards` servers, or a ConfigError."""
    problem = shards_problem(config.dispatch.shards, len(server_urls))  # the config counted inference.urls
    if problem:
        raise ConfigError("of this run", [("dispatch.shards", problem)])
    key = api_key(config)
    patience_s = config.inference.startup_timeout_s

    async def attempt(client: InferenceClient, url: str) -> tuple[str | None, bool]:
        """(what is wrong, whether it may pass by itself), or (None, False) when the server is ready."""
        try:
            await client.check_access()
        except InferenceAuthError as err:
            return ((f"{url} refuses the API key in ${config.inference.api_key_env} (HTTP {err.status})" if key
                     else f"{url} wants an API key (HTTP {err.status}): set inference.api_key_env"), False)
        except InferenceHTTPError as err:
            return f"{url} answers with HTTP {err.status}", True
        except InferenceError as err:
            if "certificate" in str(err).lower():
                return f"{url}: TLS failed ({err}); set inference.ca_bundle to the CA that signed it", False
            return f"{url} cannot be reached ({err})", True
        try:
            context = await client.served_context()
        except InferenceError:
            context = None  # it answered the same route a moment ago: left to the dispatcher's probes
        if context is not None and config.model.max_context > context:
            return (f"{url} serves a context of {context} tokens (max_model_len in /v1/models): "
                    f"model.max_context = {config.model.max_context} is above it", False)
        if config.inference.route == "generate":
            try:
                await client.check_generate_route()
            except InferenceHTTPError as err:  # the key passed above: a 403 is vLLM's disabled route
                if err.status in (403, 404, 405):
                    return (f"{url} does not serve /inference/v1/generate (HTTP {err.status}): start vLLM 0.32"
                            " or later with --enable-scale-out, or set inference.route = \"completions\"", False)
                return f"{url} answers the generate route with HTTP {err.status}", True
            except InferenceError as err:
                return f"{url} cannot be reached ({err})", True
        if config.trainer.lora is not None:
            try:
                if not await client.serves_lora():
                    return f"{url} serves no LoRA adapters (trainer.lora): {LORA_SERVER_HINT}", False
            except InferenceError as err:
                return f"{url} cannot say whether it serves LoRA adapters ({err})", True
        if config.dispatch.concurrency.mode == "kv":
            try:
                load = await client.load()
            except InferenceHTTPError as err:
                return (f"{url} does not serve /metrics (HTTP {err.status}), which dispatch.concurrency.mode = "
                        "\"kv\" reads", err.status >= 500)
            except InferenceError as err:
                return f"{url}/metrics cannot be read ({err})", True
            if load.kv_cache_usage is None:
                return (f"{url}/metrics has no vllm:kv_cache_usage_perc, which dispatch.concurrency.mode = \"kv\" "
                        "reads: use \"goodput\" or \"fixed\" with this server", False)
        return None, False

    async def check_all() -> list[tuple[str | None, bool]]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + patience_s
        one_ready = asyncio.Event()

        async def check(url: str) -> tuple[str | None, bool]:
            async with inference_client(config, url, key) as client:
                while True:
                    problem, transient = await attempt(client, url)
                    if problem is None:
                        one_ready.set()
                    if problem is None or not transient or one_ready.is_set() or loop.time() >= deadline:
                        return problem, transient
                    with contextlib.suppress(TimeoutError):  # retry soon, or stop once another is ready
                        await asyncio.wait_for(one_ready.wait(), min(0.5, max(0.0, deadline - loop.time())))

        return list(await asyncio.gather(*(check(url) for url in server_urls)))

    results = asyncio.run(check_all())
    refusals = [problem for problem, transient in results if problem and not transient]
    down = [problem for problem, transient in results if problem and transient]
    if refusals or len(down) == len(server_urls):
        detail = refusals + down
        if len(down) == len(server_urls):
            detail.append(f"none answered within inference.startup_timeout_s = {patience_s:g} s")
        raise ServersNotReadyError("inference servers cannot serve this run: " + "; ".join(detail))
    if down:
        _LOG.warning("not ready at start-up, left to the dispatcher's re-probes: %s", "; ".join(down))
