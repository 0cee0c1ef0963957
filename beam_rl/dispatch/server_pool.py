"""The inference servers a dispatcher may use: their in-flight counts, polled load and health."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from beam_rl.inference.client import DRAIN_QUIET_S, ServerLoad, UpdateMode
from beam_rl.inference.inflight import Progress, UpdateTiming
from beam_rl.inference.types import Completion, SamplingParams

log = logging.getLogger(__name__)


@runtime_checkable
class PoolClient(Protocol):
    """What the dispatcher calls on the client of one inference server: the pool polls and probes it, a
    launch sends to it (failover.LaunchClient), the thread host updates its weights
    (beam_rl.inference.client:InferenceClient is one)."""

    base_url: str
    tokens_received: int  # completion tokens that came back from this server, all requests

    async def complete(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        n: int = 1,
        *,
        partial: list[Completion] | None = None,
        progress: Progress | None = None,
    ) -> list[Completion]: ...

    async def load(self) -> ServerLoad: ...

    async def health(self) -> bool: ...

    async def restarted(self) -> bool: ...

    async def update_weights(
        self,
        path: str | Path,
        version: int,
        mode: UpdateMode = "keep",
        *,
        drain_quiet_s: float = DRAIN_QUIET_S,
        timeout_s: float | None = None,
    ) -> UpdateTiming: ...

    async def aclose(self) -> None: ...

    def retire(self) -> None: ...


# A pool member's client, made from its base URL (for servers that join while the pool runs).
Connect = Callable[[str], PoolClient]


@dataclass(eq=False)
class Server:
    """One inference server as the dispatcher sees it."""

    client: PoolClient
    order: int  # position in the pool: the tie-breaker of least-loaded selection
    url: str
    inflight: int = 0  # rollouts this dispatcher has running on it (a group call of n counts n)
    consecutive_failures: int = 0
    healthy: bool = True
    unhealthy_since: float = 0.0
    load: ServerLoad | None = None  # last polled /metrics; None until polled
    checking: asyncio.Future[None] | None = None  # the weight check under way (ServerPool.confirm_weights)
    # What it runs at once, as its /metrics last showed while requests waited beside them: its
    # max_num_seqs, or fewer when its KV cache is what holds them back. None: never seen full.
    slots: int | None = None
    # Membership (ServerPool.set_members): joining until it holds the current weights; draining once it
    # left the fleet (no new group); retired once what it still ran was moved off it.
    joining: bool = False
    draining: bool = False
    retired: bool = False
    asked_to_join_at: float | None = None  # Unix time; None for the pool's first servers
    joined_at: float | None = None  # Unix time it took requests in this pool
    first_request_at: float | None = None  # Unix time of its first rollout from this pool

    @property
    def serving(self) -> bool:
        """Takes new groups."""
        return self.healthy and not self.draining

    @property
    def full(self) -> bool:
        return self.slots is not None and self.inflight >= self.slots

    def observe(self, load: ServerLoad) -> None:
        """A polled load: while requests wait, what runs is what the server can take now; a server that
        runs more than that without a queue has room again."""
        self.load = load
        if (load.waiting > 0 and load.running > 0) or (self.slots is not None and load.running > self.slots):
            self.slots = int(load.running)

    def load_key(self) -> LoadKey:
        # A server with free slots first: what a full one is sent only waits in its queue while another
        # server could run it. Then our own in-flight count, exact and current; the polled queue also sees
        # other dispatchers sharing the server but lags, so it only breaks ties.
        return (self.full, self.inflight, self.load.queued if self.load else 0.0, self.order)


LoadKey = tuple[bool, float, float, int]
# Brings a server that was down to the current policy before it takes requests again.
Restore = Callable[[Server], Awaitable[None]]
# Told of a server found restarted since its last weight update, before it is restored.
OnRestart = Callable[[Server], object]


class ServerPool:
    """Least-loaded selection over healthy servers; servers failing repeatedly are skipped until re-probed.

    `restore` is the dispatcher's host's (a restarted server is back on its initial weights; None: nothing
    to restore), `on_restart` the dispatcher's (what runs on a restarted server was sampled with the wrong
    weights; None: nobody to tell), `on_serving` told when a server starts taking requests (one that joined
    or came back), so work waiting for a server starts at once.

    Selection takes the top of a heap of (load key, server) rather than scanning the fleet: a fresh group is
    placed for every few rollouts that finish, and at 1,000 servers two scans a group were most of what the
    dispatcher spent starting one. An entry goes stale when its server's key changes; a key only rises by
    itself (a rollout started, a poll saw it full), and the top is checked against its server's key now, so
    only the changes that lower a key push an entry (a rollout finished, a poll)."""

    def __init__(
        self,
        clients: Sequence[PoolClient],
        *,
        restore: Restore | None = None,
        on_restart: OnRestart | None = None,
        on_serving: Callable[[], object] | None = None,
        unhealthy_after: int = 3,
        reprobe_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if unhealthy_after < 1:
            raise ValueError(f"unhealthy_after must be at least 1, got {unhealthy_after}")
        now = time.time()
        self.servers = [Server(client, i, str(client.base_url), joined_at=now) for i, client in enumerate(clients)]
        self._next_order = len(self.servers)
        self.unhealthy_after = unhealthy_after
        self.reprobe_s = reprobe_s
        self._clock = clock
        self._restore = restore
        self._on_restart = on_restart
        self._on_serving = on_serving
        self._tasks: set[asyncio.Future[None]] = set()  # joins and drains under way
        # (load key when pushed, push count, server): at least one entry per server with its key now.
        self._by_load: list[tuple[LoadKey, int, Server]] = []
        self._pushes = itertools.count()
        self._reindex()

    def healthy(self) -> list[Server]:
        """The servers that hold the current weights and answer (draining ones too: they still run groups)."""
        return [s for s in self.servers if s.healthy]

    def serving(self) -> list[Server]:
        """The healthy servers that take new groups."""
        return [s for s in self.servers if s.serving]

    def select(self) -> Server | None:
        """The least-loaded serving server with free slots, if any has (in-flight count, then polled
        queue, then pool order); when every one is full, the least loaded of them."""
        heap, aside = self._by_load, []
        try:
            while heap:
                key, _, server = heap[0]
                if server.retired:  # left the pool: its entries go
                    heapq.heappop(heap)
                elif key != (now := server.load_key()):  # its key rose since: back in at the key it has
                    heapq.heapreplace(heap, (now, next(self._pushes), server))
                elif not server.serving:  # down, joining or draining: kept for when it serves again
                    aside.append(heapq.heappop(heap))
                else:
                    return server
            return None
        finally:
            for entry in aside:
                heapq.heappush(heap, entry)

    def _index(self, server: Server) -> None:
        """Its key may have dropped: an entry at its key now (stale ones leave as they reach the top)."""
        heapq.heappush(self._by_load, (server.load_key(), next(self._pushes), server))
        if len(self._by_load) > 4 * len(self.servers) + 64:
            self._reindex()

    def _reindex(self) -> None:
        self._by_load = [(s.load_key(), next(self._pushes), s) for s in self.servers]
        heapq.heapify(self._by_load)

    def started(self, server: Server, rollouts: int) -> None:
        server.inflight += rollouts  # its key rises: select() finds out when its entry is on top
        if server.first_request_at is None:
            server.first_request_at = time.time()

    def finished(self, server: Server, rollouts: int) -> None:
        server.inflight -= rollouts
        self._index(server)

    def record_success(self, server: Server) -> None:
        server.consecutive_failures = 0

    def record_failure(self, server: Server, error: BaseException) -> None:
        """Count a failure that says the server is sick; enough in a row (or one refused connection)
        take it out of selection until a health probe succeeds."""
        server.consecutive_failures += 1
        refused = getattr(error, "refused", False)  # nothing listening: down, not just slow
        if server.healthy and (refused or server.consecutive_failures >= self.unhealthy_after):
            server.healthy = False
            server.unhealthy_since = self._clock()
            log.warning(
                "server %s marked unhealthy after %d failures in a row: %s",
                server.url,
                server.consecutive_failures,
                error,
            )

    def mark_down(self, server: Server, error: BaseException | str) -> None:
        """Take a server out of selection at once (it failed a weight update, or restarted) until it is
        brought back."""
        if server.healthy:
            server.healthy = False
            server.unhealthy_since = self._clock()
            log.warning("server %s marked unhealthy: %s", server.url, error)

    async def refresh(self) -> None:
        """Poll the load of healthy servers and re-probe unhealthy ones whose wait is over."""
        await asyncio.gather(*(self._refresh_one(s) for s in self.servers))

    async def _refresh_one(self, server: Server) -> None:
        if server.joining or server.retired:  # its own task (set_members) looks after it
            return
        if server.healthy:
            try:
                server.observe(await server.client.load())
                self._index(server)
            except Exception as exc:  # load is advisory: a failed scrape changes nothing
                log.debug("polling load of %s failed: %s", server.url, exc)
            await self.confirm_weights(server)
            return
        if self._clock() - server.unhealthy_since < self.reprobe_s:
            return
        if await server.client.health():
            await self._bring_back(server)
        else:
            server.unhealthy_since = self._clock()

    async def confirm_weights(self, server: Server) -> None:
        """Take a server that restarted since its last weight update (it reports other weights than it
        was given: its initial ones) out of selection, and bring it back on the current weights. Checked
        at every refresh and after a connection failure, the sign of a restart under load."""
        if not server.healthy:
            return
        if server.checking is None:  # one check at a time: a restart fails many requests together
            server.checking = asyncio.ensure_future(self._check_weights(server))
            server.checking.add_done_callback(lambda _: setattr(server, "checking", None))
        # Shielded: the check redoes the launches on a restarted server, perhaps the one waiting here.
        await asyncio.shield(server.checking)

    async def _check_weights(self, server: Server) -> None:
        try:
            restarted = await server.client.restarted()
        except Exception as exc:  # unreachable: its requests' failures will say so
            log.debug("asking %s for its weights failed: %s", server.url, exc)
            return
        if restarted and server.healthy:
            self.mark_down(server, "it restarted since its last weight update and serves its initial weights")
            if self._on_restart is not None:
                self._on_restart(server)
            await self._bring_back(server)

    async def _bring_back(self, server: Server) -> None:
        if self._restore is not None:
            try:
                await self._restore(server)
            except Exception as exc:  # down a while longer; probed again later
                log.warning("server %s is up but did not take the current weights: %s", server.url, exc)
                server.unhealthy_since = self._clock()
                return
        server.healthy = True
        server.consecutive_failures = 0
        if self._on_serving is not None:
            self._on_serving()
        log.info("server %s is healthy again", server.url)

    # -- membership ----------------------------------------------------------------------------------

    def set_members(self, urls: Sequence[str], connect: Connect, drain_timeout_s: float) -> None:
        """The fleet is `urls` now (called on the loop): a new server joins once it answers and holds the
        current weights (`restore`); one no longer listed drains: no new group goes to it, what it still
        runs after `drain_timeout_s` moves to another server with its tokens, and then it leaves."""
        wanted = set(urls)
        present = {s.url: s for s in self.servers if not s.retired}
        for url in urls:
            server = present.get(url)
            if server is None:
                self._spawn(self._join(self._add(connect(url))))
            elif server.draining:
                server.draining = False
                log.info("server %s is in the fleet again: it takes new groups", url)
        for server in present.values():
            if server.url not in wanted and not server.draining:
                server.draining = True
                self._spawn(self._drain(server, drain_timeout_s))

    def _add(self, client: PoolClient) -> Server:
        server = Server(
            client, self._next_order, str(client.base_url), healthy=False, joining=True, asked_to_join_at=time.time()
        )
        self._next_order += 1
        self.servers.append(server)
        self._index(server)
        log.info("server %s joins: loading the current weights before its first request", server.url)
        return server

    async def _join(self, server: Server) -> None:
        try:
            while not server.draining:
                if await server.client.health():
                    await self._bring_back(server)
                    if server.healthy:
                        server.joined_at = time.time()
                        log.info(
                            "server %s joined in %.2fs", server.url, server.joined_at - (server.asked_to_join_at or 0)
                        )
                        return
                await asyncio.sleep(min(1.0, self.reprobe_s))
        finally:
            server.joining = False

    async def _drain(self, server: Server, timeout_s: float) -> None:
        log.info(
            "server %s left the fleet: draining (%d rollouts on it, at most %gs)",
            server.url,
            server.inflight,
            timeout_s,
        )
        deadline = time.monotonic() + timeout_s
        while server.inflight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            if not server.draining:
                return  # listed again
        while server.joining:
            await asyncio.sleep(0.05)
        if not server.draining:
            return
        moved = server.inflight
        server.retired, server.healthy = True, False
        server.client.retire()  # what it still runs moves to another server with its tokens (failover)
        while server.inflight > 0:
            await asyncio.sleep(0.05)
        self.servers.remove(server)
        await server.client.aclose()
        log.info("server %s left: %d rollouts moved off it after the drain", server.url, moved)

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for server in self.servers:
            await server.client.aclose()
