"""What an event loop holds for its environments while its dispatcher runs: the inference proxy, an
environment server's process and client, an in-process environment's serving context. Each is started
by the first episode that needs it and closed, in reverse order, when the dispatcher closes."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")


class _Held:
    def __init__(self) -> None:
        self.stack = contextlib.AsyncExitStack()
        self.started: dict[Hashable, asyncio.Future[Any]] = {}


_LOOPS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Held] = weakref.WeakKeyDictionary()


async def loop_local(key: Hashable, start: Callable[[contextlib.AsyncExitStack], Awaitable[T]]) -> T:
    """The running loop's value for `key`, started once by `start(stack)` (which registers its cleanup on
    `stack`); callers that come while it starts wait for it. A start that fails is tried again by the
    next caller."""
    held = _LOOPS.setdefault(asyncio.get_running_loop(), _Held())
    future = held.started.get(key)
    if future is None:
        future = held.started[key] = asyncio.ensure_future(start(held.stack))
        future.add_done_callback(lambda f: held.started.pop(key, None) if f.cancelled() or f.exception() else None)
    return await asyncio.shield(future)


async def close_loop_locals() -> None:
    """Closes everything the running loop holds (its dispatcher is closing)."""
    held = _LOOPS.pop(asyncio.get_running_loop(), None)
    if held is not None:
        for future in held.started.values():
            future.cancel()
        await held.stack.aclose()
