"""An asyncio event loop on a daemon thread of its own, for work that must not wait behind another loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Self

CLOSE_TIMEOUT_S = 5.0


class LoopThread:
    """Coroutines submitted from any thread run on this loop. Stopped by `close`, once nothing holds it, or at
    interpreter exit (a cancelled job's workers may never tear their DoFns down), after its closers ran."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self._closers: list[Callable[[], Awaitable[None]]] = []
        self._finalizer = weakref.finalize(self, _stop_loop, self._loop, self._thread, self._closers)

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def at_close(self, closer: Callable[[], Awaitable[None]]) -> None:
        """Await `closer()` on the loop before it stops (what holds connections: an HTTP session)."""
        self._closers.append(closer)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _stop_loop(
    loop: asyncio.AbstractEventLoop, thread: threading.Thread, closers: list[Callable[[], Awaitable[None]]]
) -> None:
    if loop.is_closed():
        return
    on_loop_thread = thread is threading.current_thread()
    for closer in closers:
        done = asyncio.run_coroutine_threadsafe(_awaited(closer()), loop)
        if not on_loop_thread:
            with contextlib.suppress(Exception):
                done.result(timeout=CLOSE_TIMEOUT_S)
    loop.call_soon_threadsafe(loop.stop)
    if not on_loop_thread:
        thread.join(timeout=CLOSE_TIMEOUT_S)
    if not thread.is_alive():
        loop.close()


async def _awaited(pending: Awaitable[None]) -> None:
    await pending
