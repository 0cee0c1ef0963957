"""The client an environment's turn loop gets for one launch: it sends to the group's pinned server and,
when that server fails, moves the launch and its group to another healthy one, continuing from the
tokens already streamed (or from the start, with the same seed, when none came back).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from beam_rl.dispatch.ledger import Launch
from beam_rl.dispatch.resume import prompt_digest
from beam_rl.dispatch.server_pool import Server, ServerPool
from beam_rl.inference.client import InferenceConnectionError, InferenceError, InferenceRetired
from beam_rl.inference.types import Completion, SamplingParams

log = logging.getLogger(__name__)


class LaunchClient:
    """A `CompletionClient` bound to one launch (one `env.run`, or one `env.run_group` of n rollouts).

    Rule: re-dispatch. A failure that says the server is sick (refused, reset, 5xx after the client's
    retries, a timeout, death mid-request) moves the launch, at most `max_redispatches` times, to the
    least-loaded other healthy server; the group's affinity moves with it. A failure that says the request
    is bad (a 4xx) is raised to the environment as before. A server that left the fleet (InferenceRetired)
    hands its launches on the same way, without counting a failure or a re-dispatch.
    """

    def __init__(
        self, launch: Launch, pool: ServerPool, max_redispatches: int, on_move: Callable[[Launch, Server, Server], None]
    ) -> None:
        self._launch = launch
        self._pool = pool
        self._max_redispatches = max_redispatches
        self._on_move = on_move

    async def complete(self, prompt_ids: list[int], sampling: SamplingParams, n: int = 1) -> list[Completion]:
        launch = self._launch
        partial: list[Completion] | None = None
        prompt = prompt_digest(prompt_ids, n)
        recorded = launch.replay.next(prompt_ids, n) if launch.replay is not None else None
        if recorded is not None:  # a resumed launch: this call as the checkpoint kept it
            partial, finished = recorded
            if finished:
                return self._done(launch, prompt, partial)
        launch.live_prompt = prompt
        while True:
            server = launch.server
            try:
                completions = await server.client.complete(
                    prompt_ids, sampling, n, partial=partial, progress=launch.progress
                )
            except InferenceRetired as exc:
                partial = exc.partial if exc.partial is not None else partial
                target = await self._next_server(server)
                log.info(
                    "rollout %s: %s; continuing on %s with %d tokens it had",
                    launch.name,
                    exc,
                    target.url,
                    sum(len(c.token_ids) for c in partial or ()),
                )
                self._on_move(launch, server, target)
                continue
            except InferenceError as exc:
                partial = exc.partial if exc.partial is not None else partial
                if not exc.server_fault:
                    raise
                self._pool.record_failure(server, exc)
                if isinstance(exc, InferenceConnectionError):
                    await self._pool.confirm_weights(server)  # a dropped connection may be a restart
                if launch.redispatches >= self._max_redispatches:
                    raise
                launch.redispatches += 1
                target = await self._next_server(server)
                log.warning(
                    "rollout %s: %s; continuing on %s with %d tokens it had (re-dispatch %d of %d)",
                    launch.name,
                    exc,
                    target.url,
                    sum(len(c.token_ids) for c in partial or ()),
                    launch.redispatches,
                    self._max_redispatches,
                )
                self._on_move(launch, server, target)
                continue
            self._pool.record_success(server)
            return self._done(launch, prompt, completions)

    @staticmethod
    def _done(launch: Launch, prompt: bytes, completions: list[Completion]) -> list[Completion]:
        launch.live_prompt = None
        launch.completions.extend(completions)
        launch.calls_to_compact.append((prompt, completions))
        return completions

    async def _next_server(self, failed: Server) -> Server:
        """The least-loaded serving server other than `failed`; `failed` itself if it is the only healthy
        one left; else waits (re-probed by the pool's refresh) until one is back."""
        while True:
            others = [s for s in self._pool.serving() if s is not failed]
            if others:
                return min(others, key=Server.load_key)
            if failed.serving:
                return failed
            await asyncio.sleep(min(1.0, max(0.05, self._pool.reprobe_s / 4)))
