"""Hosts a Dispatcher's event loop on a daemon thread so synchronous callers (Beam DoFns) can drive it.

The loop outlives any one bundle: groups go in with `add_groups`, finished rollouts come out of `poll`
through one queue, and in-flight HTTP calls keep running between calls.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from beam_rl.dispatch.dispatcher import Dispatcher
from beam_rl.dispatch.resume import ResumePoint
from beam_rl.dispatch.server_pool import Connect, Restore, Server
from beam_rl.inference.client import DRAIN_QUIET_S, InferenceConnectionError, InferenceTimeout, UpdateMode
from beam_rl.inference.inflight import UpdateTiming
from beam_rl.types import GroupRequest, Rollout

log = logging.getLogger(__name__)

T = TypeVar("T")
Emit = Callable[[Rollout], None]
_LOOP_DIED = object()  # put on the output queue to wake a blocked poll() when the loop fails


class DispatcherThread:
    """A Dispatcher running on its own thread.

    `build(emit, restore)` is called on that thread, so clients bound to an event loop are created on the
    loop that uses them; the Dispatcher it returns must emit every finished rollout through `emit`, and
    have its pool bring a server back through `restore` (Dispatcher's `restore`): this host keeps the
    newest weights a server that was down must load first. `connect` makes the client of a server that
    joins (`set_servers`); a server that leaves drains for at most `drain_timeout_s`.
    """

    def __init__(
        self,
        build: Callable[[Emit, Restore], Dispatcher],
        refresh_s: float = 5.0,
        tick_s: float = 0.5,
        name: str = "beam-rl-dispatcher",
        abandoned_after_s: float | None = None,
        connect: Connect | None = None,
        drain_timeout_s: float = 60.0,
    ) -> None:
        self._build = build
        self._connect = connect
        self._drain_timeout_s = drain_timeout_s
        self._refresh_s = refresh_s
        self._tick_s = tick_s
        # A runner that cancelled its job (or moved the work elsewhere) never polls again: past this
        # long without a poll the thread closes itself, cancelling what it still runs.
        self._abandoned_after_s = abandoned_after_s
        self._last_poll = time.monotonic()
        self._lock = threading.Lock()
        # Group id -> attempts added whose rollouts `poll` has not returned yet: what the caller has not
        # taken delivery of, so what a runner checkpoint must ask to run again.
        self._unreturned: dict[str, set[int]] = {}
        self._out: queue.SimpleQueue[Any] = queue.SimpleQueue()  # the one queue from the loop to Beam
        self._error: BaseException | None = None
        self._closed = False
        self._weights: tuple[str, int] | None = None  # the newest checkpoint (path, version) servers must hold
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise RuntimeError(f"building the dispatcher failed: {self._error}") from self._error

    # -- synchronous API (any thread) ----------------------------------------------------------

    def add_groups(self, requests: Sequence[GroupRequest]) -> None:
        """Queue groups for admission; the dispatcher opens them as permits free up."""
        self._raise_if_dead()
        with self._lock:
            ids = [r.group_id for r in requests]
            duplicates = sorted({g for g in ids if ids.count(g) > 1 or g in self._unreturned})
            if duplicates:
                raise ValueError(f"groups already in flight in this dispatcher: {duplicates}")
            for request in requests:
                self._unreturned[request.group_id] = set(request.attempts_to_run)
        self.dispatcher.add(requests)
        self._loop.call_soon_threadsafe(self.dispatcher.wake)

    def poll(self, max_wait_s: float) -> list[Rollout]:
        """Finished rollouts, as they finish: blocks at most `max_wait_s` for the first one."""
        self._raise_if_dead()
        self._last_poll = time.monotonic()
        items = []
        try:
            items.append(self._out.get(timeout=max_wait_s) if max_wait_s > 0 else self._out.get_nowait())
            while True:
                items.append(self._out.get_nowait())
        except queue.Empty:
            pass
        rollouts = [item for item in items if item is not _LOOP_DIED]
        with self._lock:
            for rollout in rollouts:
                attempts = self._unreturned.get(rollout.group_id)
                if attempts is not None:
                    attempts.discard(rollout.attempt)
                    if not attempts:
                        del self._unreturned[rollout.group_id]
        if len(rollouts) < len(items):
            self._raise_if_dead()
        return rollouts

    def unreturned(self) -> dict[str, tuple[int, ...]]:
        """Group id -> attempts added whose rollouts `poll` has not returned yet."""
        with self._lock:
            return {group: tuple(sorted(attempts)) for group, attempts in self._unreturned.items()}

    def resume_points(self) -> list[ResumePoint]:
        """What a runner checkpoint keeps of the launches in flight now (Dispatcher.resume_points)."""
        return self._call(self.dispatcher.resume_points)

    def is_unreturned(self, group_id: str) -> bool:
        """Some rollout of the group has not been returned by `poll` yet."""
        with self._lock:
            return group_id in self._unreturned

    def inflight_groups(self) -> list[str]:
        """Groups added whose rollouts `poll` has not all returned yet."""
        with self._lock:
            return list(self._unreturned)

    def pending_groups(self) -> int:
        """Groups added but not yet opened by the dispatcher (waiting for permits)."""
        return self.dispatcher.waiting

    @property
    def inflight_cap(self) -> int:
        """How many rollouts the dispatcher keeps in flight now (its concurrency controller's cap)."""
        return self.dispatcher.inflight_cap

    def counters(self) -> dict[str, int]:
        return self._call(self._snapshot)

    def counters_and_servers(self) -> tuple[dict[str, int], list[dict[str, Any]]]:
        """`counters()` and, taken at the same instant, per server: our rollouts running on it, its
        health, and its own last polled queue."""
        return self._call(lambda: (self._snapshot(), self._server_loads()))

    def set_servers(self, urls: Sequence[str]) -> None:
        """The fleet of this dispatcher is `urls` now: new servers join once they hold the newest weights,
        servers not listed drain and leave (ServerPool.set_members)."""
        if self._connect is None:
            raise RuntimeError("this dispatcher was built without `connect`: its servers are fixed")
        connect, drain_s = self._connect, self._drain_timeout_s
        self._call(lambda: self.dispatcher.pool.set_members(list(urls), connect, drain_s))

    def cancel_groups(self, group_ids: Iterable[str]) -> list[str]:
        """Cancel groups wherever they are; every rollout of each still comes out of `poll`."""
        ids = set(group_ids)
        return self._call(lambda: self.dispatcher.cancel_waiting(ids) + self.dispatcher.cancel_groups(ids))

    def cancel_stale(self, min_version: int) -> list[str]:
        return self._call(lambda: self.dispatcher.cancel_stale(min_version))

    def handle_stale(self, min_version: int) -> tuple[int, int]:
        """Dispatcher.handle_stale on the loop: (rollouts regenerated, rollouts cancelled)."""
        return self._call(lambda: self.dispatcher.handle_stale(min_version))

    def update_weights(
        self,
        path: object,
        version: int,
        mode: UpdateMode = "keep",
        *,
        drain_quiet_s: float = DRAIN_QUIET_S,
        timeout_s: float = 600.0,
    ) -> list[UpdateTiming]:
        """Every healthy server in the pool loads the checkpoint at `path` as policy `version`, all at once,
        in `mode` (InferenceClient.update_weights); returns when all have, with what each update cost. A
        server unreachable meanwhile is marked unhealthy, and one that was down loads the newest checkpoint
        when it is back, before any request (`_restore`)."""
        self._raise_if_dead()

        async def update_all() -> list[UpdateTiming]:
            self._weights = (str(path), version)
            servers = self.dispatcher.pool.healthy()
            results = await asyncio.gather(
                *(
                    s.client.update_weights(str(path), version, mode, drain_quiet_s=drain_quiet_s, timeout_s=timeout_s)
                    for s in servers
                ),
                return_exceptions=True,
            )
            timings = []
            for server, result in zip(servers, results):
                if isinstance(result, (InferenceConnectionError, InferenceTimeout)):
                    self.dispatcher.pool.mark_down(server, result)  # died: restored when it is back
                elif isinstance(result, BaseException):
                    raise result
                else:
                    timings.append(result)
            return timings

        return asyncio.run_coroutine_threadsafe(update_all(), self._loop).result(timeout_s)

    async def _restore(self, server: Server) -> None:
        """A server back from the dead loads the newest checkpoint (no request runs on it: reload mode)."""
        loaded = None
        while self._weights is not None and self._weights != loaded:  # again if an update came meanwhile
            loaded = self._weights
            await server.client.update_weights(*loaded, "reload")
            log.info("server %s is back: loaded policy version %d", server.url, loaded[1])

    def close(self, timeout_s: float = 10.0) -> None:
        """Cancel in-flight work, close the clients and stop the thread (in-flight groups are dropped)."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout_s)

    @property
    def closed(self) -> bool:
        return self._closed or self._error is not None or not self._thread.is_alive()

    def __enter__(self) -> DispatcherThread:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- loop thread --------------------------------------------------------------------------

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        try:
            self.dispatcher = self._build(self._out.put, self._restore)
            self._stop = asyncio.Event()
        except BaseException as exc:
            self._error = exc
            return
        finally:
            self._ready.set()
        refresher = asyncio.create_task(self._refresh_forever())
        try:
            while not self._stop.is_set():
                self.dispatcher.fill()
                await self.dispatcher.wait_for_work(self._tick_s)
        except BaseException as exc:
            log.exception("dispatcher loop failed")
            self._error = exc
            self._out.put(_LOOP_DIED)
        finally:
            refresher.cancel()
            await self.dispatcher.aclose()

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            idle_s = time.monotonic() - self._last_poll
            if self._abandoned_after_s is not None and idle_s > self._abandoned_after_s:
                log.warning("nobody polled the dispatcher for %.0fs: closing it", idle_s)
                self._closed = True
                self._stop.set()
                return
            try:
                await self.dispatcher.pool.refresh()
                self.dispatcher.observe_loads()
            except Exception:
                log.exception("refreshing the server pool failed")
            self.dispatcher.wake()  # a server back in service may let fill() start work

    def _snapshot(self) -> dict[str, int]:
        c = self.dispatcher.counters
        return {
            "started": c.started,
            "ok": c.ok,
            "errored": c.errored,
            "cancelled": c.cancelled,
            "groups_admitted": c.groups_admitted,
            "redispatched": c.redispatched,
            "regenerated": c.regenerated,
            "cancelled_stale": c.cancelled_stale,
            "redone_on_restart": c.redone_on_restart,
            "resumed": c.resumed,
            "resumed_tokens": c.resumed_tokens,
            "inflight": self.dispatcher.inflight,
            "inflight_cap": self.dispatcher.inflight_cap,
            "healthy_servers": len(self.dispatcher.pool.healthy()),
        }

    def _server_loads(self) -> list[dict[str, Any]]:
        return [
            {
                "url": server.url,
                "healthy": server.healthy,
                "inflight": server.inflight,
                "running": server.load.running if server.load else None,
                "waiting": server.load.waiting if server.load else None,
                "kv_cache_usage": server.load.kv_cache_usage if server.load else None,
                "slots": server.slots,
                "tokens_received": server.client.tokens_received,
                "joining": server.joining,
                "draining": server.draining,
                "joined_at": server.joined_at,
                # From being listed to holding the current weights, and to its first rollout (servers that joined).
                "join_s": _since(server.asked_to_join_at, server.joined_at),
                "join_to_first_request_s": _since(server.asked_to_join_at, server.first_request_at),
            }
            for server in self.dispatcher.pool.servers
        ]

    def _call(self, fn: Callable[[], T], timeout_s: float = 30.0) -> T:
        """Run `fn` on the loop thread (the dispatcher is not thread-safe) and return its result."""
        self._raise_if_dead()

        async def call() -> T:
            result = fn()
            self.dispatcher.wake()
            return result

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(timeout_s)

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the dispatcher loop failed: {self._error!r}") from self._error
        if self._closed or not self._thread.is_alive():
            raise RuntimeError("the dispatcher thread is closed")


def _since(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round(end - start, 3)
