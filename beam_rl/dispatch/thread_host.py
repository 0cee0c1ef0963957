"""Hosts a Dispatcher's event loop on a daemon thread so synchronous callers (Beam DoFns) can drive it.

The loop outlives any one bundle: groups go in with `add_groups`, finished rollouts come out of
`poll`, and in-flight HTTP calls keep running between calls.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from beam_rl.dispatch.dispatcher import Dispatcher
from beam_rl.types import GroupRequest, Rollout

log = logging.getLogger(__name__)

T = TypeVar("T")
NextGroup = Callable[[], GroupRequest | None]
_LOOP_DIED = object()  # put on the output queue to wake a blocked poll() when the loop fails


class DispatcherThread:
    """A Dispatcher running on its own thread.

    `build(next_group)` is called on that thread, so clients bound to an event loop are created on
    the loop that uses them; the Dispatcher it returns must pull groups through `next_group`.
    """

    def __init__(
        self,
        build: Callable[[NextGroup], Dispatcher],
        refresh_s: float = 5.0,
        tick_s: float = 0.5,
        name: str = "beam-rl-dispatcher",
    ) -> None:
        self._build = build
        self._refresh_s = refresh_s
        self._tick_s = tick_s
        self._lock = threading.Lock()
        self._pending: collections.deque[GroupRequest] = collections.deque()  # added, not yet admitted
        self._outstanding: dict[str, int] = {}  # group id -> rollouts poll() has yet to return
        self._out: queue.Queue[Any] = queue.Queue()
        self._error: BaseException | None = None
        self._closed = False
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
        """Queue groups for admission; the dispatcher pulls them as permits free up."""
        self._raise_if_dead()
        with self._lock:
            counts = collections.Counter(r.group_id for r in requests)
            duplicates = sorted(g for g, k in counts.items() if k > 1 or g in self._outstanding)
            if duplicates:
                raise ValueError(f"groups already in flight in this dispatcher: {duplicates}")
            for request in requests:
                self._pending.append(request)
                self._outstanding[request.group_id] = request.group_size
        self._loop.call_soon_threadsafe(self.dispatcher.wake)

    def poll(self, max_wait_s: float) -> list[Rollout]:
        """Finished rollouts, as they finish: blocks at most `max_wait_s` for the first one."""
        self._raise_if_dead()
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
                left = self._outstanding.get(rollout.group_id, 0) - 1
                if left > 0:
                    self._outstanding[rollout.group_id] = left
                else:
                    self._outstanding.pop(rollout.group_id, None)
        if len(rollouts) < len(items):
            self._raise_if_dead()
        return rollouts

    def inflight_groups(self) -> list[str]:
        """Groups added whose rollouts `poll` has not all returned yet (what a checkpoint must replay)."""
        with self._lock:
            return list(self._outstanding)

    def pending_groups(self) -> int:
        """Groups added but not yet admitted by the dispatcher (waiting for permits)."""
        with self._lock:
            return len(self._pending)

    def counters(self) -> dict[str, int]:
        return self._call(self._snapshot)

    def counters_and_servers(self) -> tuple[dict[str, int], list[dict[str, Any]]]:
        """`counters()` and, taken at the same instant, per server: our rollouts running on it, its
        health, and its own last polled queue."""
        return self._call(lambda: (self._snapshot(), self._server_loads()))

    def cancel_groups(self, group_ids: Iterable[str]) -> list[str]:
        """Cancel groups wherever they are; every rollout of each still comes out of `poll`."""
        return self._call(lambda: self._cancel(set(group_ids)))

    def cancel_stale(self, min_version: int) -> list[str]:
        return self._call(lambda: self.dispatcher.cancel_stale(min_version))

    def reload_weights(self, path: object, timeout_s: float = 600.0) -> None:
        """Ask every server in the pool to load the checkpoint at `path`; returns when all have."""
        self._raise_if_dead()
        servers = self.dispatcher.pool.servers

        async def reload_all() -> None:
            await asyncio.gather(*(s.client.reload_weights(str(path)) for s in servers))

        asyncio.run_coroutine_threadsafe(reload_all(), self._loop).result(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Cancel in-flight work, close the clients and stop the thread (in-flight groups are dropped)."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout_s)

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
            self.dispatcher = self._build(self._next_pending)
            self._stop = asyncio.Event()
        except BaseException as exc:
            self._error = exc
            return
        finally:
            self._ready.set()
        refresher = asyncio.create_task(self._refresh_forever())
        try:
            while not self._stop.is_set():
                await self.dispatcher.fill()
                for rollout in await self.dispatcher.wait_completed(self._tick_s):
                    self._out.put(rollout)
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
            try:
                await self.dispatcher.pool.refresh()
            except Exception:
                log.exception("refreshing the server pool failed")
            self.dispatcher.wake()  # a server back in service may let fill() start work

    def _next_pending(self) -> GroupRequest | None:
        with self._lock:
            return self._pending.popleft() if self._pending else None

    def _cancel(self, group_ids: set[str]) -> list[str]:
        with self._lock:
            unadmitted = [r for r in self._pending if r.group_id in group_ids]
            for request in unadmitted:
                self._pending.remove(request)
        for request in unadmitted:
            self.dispatcher.cancel_request(request)
        return [r.group_id for r in unadmitted] + self.dispatcher.cancel_groups(group_ids)

    def _snapshot(self) -> dict[str, int]:
        c = self.dispatcher.counters
        return {
            "started": c.started,
            "ok": c.ok,
            "errored": c.errored,
            "cancelled": c.cancelled,
            "groups_admitted": c.groups_admitted,
            "inflight": self.dispatcher.inflight,
            "healthy_servers": len(self.dispatcher.pool.healthy()),
        }

    def _server_loads(self) -> list[dict[str, Any]]:
        return [{
            "url": server.url,
            "healthy": server.healthy,
            "inflight": server.inflight,
            "running": server.load.running if server.load else None,
            "waiting": server.load.waiting if server.load else None,
            "kv_cache_usage": server.load.kv_cache_usage if server.load else None,
        } for server in self.dispatcher.pool.servers]

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
