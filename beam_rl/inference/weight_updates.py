"""A server's weight updates in their three modes (docs/weight-updates.md): "reload" loads while requests
run; "keep" pauses them frozen, loads, resumes; "continue" aborts them (each keeps its tokens), loads, and
the client continues them under the new weights. Under LoRA (docs/lora.md) each version is an adapter of its
own: a request keeps the adapter it named to its end, so "reload" and "keep" load the new one without a pause
and stamp exact versions; "continue" still aborts and continues under the new one.

`WeightUpdates` is the part of `InferenceClient` that runs them: it drives the client's server routes and
restamps the requests the client has in flight (`inflight.LiveRequest`), and holds what the client's
requests consult while an update runs (whether to wait for its resume, whether versions can be known).
It takes the client rather than importing it: the client imports this module.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Protocol

from beam_rl.inference.errors import InferenceError, InferenceHTTPError
from beam_rl.inference.inflight import UNKNOWN_VERSION, LiveRequest, UpdateTiming
from beam_rl.loop_thread import LoopThread

log = logging.getLogger(__name__)

UpdateMode = Literal["reload", "keep", "continue"]
# How long no stream may receive a token before a keep pause counts them drained. A server answers the pause
# once it has sent what was sampled before it (vLLM waits 20 ms for its output tasks first), so this covers
# only what is on its way (docs/weight-updates.md).
DRAIN_QUIET_S = 0.005


class UpdatedClient(Protocol):
    """What an update uses of `InferenceClient`: its server's routes, and its requests in flight. Read through
    the client at each use, never copied: an update moves `version`, and tests stand in for `pause`."""

    base_url: str
    route: Literal[
        "completions", "generate"
    ]  # "generate": the server labels each token's weights (its spans), no drain is needed
    stream: bool
    stream_interval: int  # streamed tokens come in chunks of this many
    version: int
    lora: bool
    adapter: str | None  # the LoRA adapter requests name now
    _live: set[LiveRequest]
    _on_this_machine: bool  # a server on this machine has sent everything by the pause's answer

    async def pause(self, mode: str = "keep") -> None: ...
    async def resume(self) -> None: ...
    async def reload_weights(self, path: str, timeout_s: float | None = None) -> None: ...
    async def load_lora_adapter(self, name: str, path: str, timeout_s: float | None = None) -> None: ...
    async def unload_lora_adapter(self, name: str) -> None: ...
    async def _request(
        self, method: str, path: str, *, retry: bool = True, timeout_s: float | None = None, **kwargs: Any
    ) -> Any: ...
    async def _close_session(self) -> None: ...


class WeightUpdates:
    """The weight updates of one client's server, one at a time."""

    def __init__(self, client: UpdatedClient) -> None:
        self._client = client
        self._lock: asyncio.Lock | None = None  # made on first use, on the requests' loop
        # The loop of its own a paused update's pause, load and resume run on (`_pause_elsewhere`).
        self._pause_loop: LoopThread | None = None
        #: Set once the keep/continue update holding the server is over; None when there is none. No request
        #: is sent meanwhile (`finished`): it would only queue, and must carry the new version's cache salt.
        self.over: asyncio.Event | None = None
        #: Reload-mode updates in flight: requests sent meanwhile get unknown versions.
        self.reloading = 0
        #: The version this client last loaded and told the server to report (vLLM's /update_weight_version):
        #: a server that reports another has restarted since, on its initial weights. None: nothing to check
        #: (no update yet, one under way, or a server without the route).
        self.labelled: int | None = None
        #: False once the server turned out to lack vLLM's RL routes: its labels (and spans) name none of
        #: our versions.
        self.labels_supported = True
        #: LoRA: the adapter this client loaded for each version and has not unloaded yet.
        self.adapters: dict[int, str] = {}

    async def run(
        self, path: str | Path, version: int, mode: UpdateMode, drain_quiet_s: float, timeout_s: float | None
    ) -> UpdateTiming:
        """`InferenceClient.update_weights`."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        if mode not in ("reload", "keep", "continue"):
            raise ValueError(f"update mode must be reload, keep or continue, not {mode!r}")
        async with self._lock:
            self.labelled = None
            try:
                if self._client.lora and mode != "continue":
                    timing = await self._adapter_beside_running(path, version, mode, timeout_s)
                elif mode == "reload":
                    timing = await self._reload_while_running(path, version, timeout_s)
                else:
                    timing = await self._paused_update(path, version, mode, drain_quiet_s, timeout_s)
                if self.labelled != version:
                    await self.label(version)  # after the resume: the engine need not wait for it
                if self._client.lora:
                    await self._unload_unused_adapters()
                return timing
            finally:
                if not self.labels_supported:
                    for request in self._client._live:
                        request.label_version = None  # its spans name none of our versions

    async def finished(self) -> None:
        """Once no keep or continue update holds the server (at once when none does)."""
        while (over := self.over) is not None and not over.is_set():  # set at the resume's answer
            await over.wait()

    def close(self) -> None:
        if self._pause_loop is not None:
            self._pause_loop.close()  # closes its session first
            self._pause_loop = None

    # -- reload: no pause -----------------------------------------------------------------------------

    async def _reload_while_running(self, path: str | Path, version: int, timeout_s: float | None) -> UpdateTiming:
        client = self._client
        # Nothing marks the step at which the server switched: a token arriving from now on may come from
        # either side of it, so running requests and those sent meanwhile stamp it unknown.
        self.reloading += 1
        for request in client._live:
            request.version = UNKNOWN_VERSION
            request.label_version = None  # the label moves after the load, not with it: its spans would be wrong
        try:
            reload_s = await self._timed_reload(path, version, timeout_s)
        finally:
            self.reloading -= 1
        client.version = version
        return UpdateTiming(client.base_url, "reload", version, 0.0, reload_s)

    # -- LoRA: an adapter per version ---------------------------------------------------------------------

    async def _adapter_beside_running(
        self, path: str | Path, version: int, mode: str, timeout_s: float | None
    ) -> UpdateTiming:
        """The new version's adapter loads while requests run; they keep the adapter they named, so their
        versions stay exact, and requests sent from now on name the new one."""
        load_s = await self._timed_reload(path, version, timeout_s)
        self._client.version = version
        return UpdateTiming(self._client.base_url, mode, version, 0.0, load_s)

    async def _load_adapter(self, path: str | Path, version: int, timeout_s: float | None) -> None:
        # Named by version and checkpoint path: runs sharing a server never take each other's adapter.
        name = f"beam-rl-v{version}-{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
        await self._client.load_lora_adapter(name, str(path), timeout_s)
        self.adapters[version] = name
        self._client.adapter = name

    async def _unload_unused_adapters(self) -> None:
        """Unload every older adapter no request in flight names (one still named goes at a later update)."""
        named = {request.floor for request in self._client._live}
        for version, name in list(self.adapters.items()):
            if version != self._client.version and version not in named:
                await self._client.unload_lora_adapter(name)
                del self.adapters[version]

    # -- keep and continue: pause, load, resume ---------------------------------------------------------

    async def _paused_update(
        self, path: str | Path, version: int, mode: str, drain_quiet_s: float, timeout_s: float | None
    ) -> UpdateTiming:
        client = self._client
        self.over = asyncio.Event()
        try:
            # On the generate route the server labels every token with the label current when it was sampled:
            # set while nothing samples, it moves exactly with the load, so no stream need drain.
            labelled = client.route == "generate" and self.labels_supported and not client.lora
            for request in client._live:
                request.updates_lived += 1
                if mode == "continue":
                    request.aborted_by_us = True  # the pause ends each running request with its tokens so far
                if labelled:
                    request.version = UNKNOWN_VERSION  # from either side of the pause, until its spans say
                elif mode == "keep" and not request.streamed:
                    request.version = UNKNOWN_VERSION  # its tokens arrive all at once: no boundary to see
                elif mode == "keep" and client.stream_interval > 1:
                    # vLLM holds a partial chunk through the pause: the next chunk's first tokens may be
                    # the old weights', and how many cannot be seen (RunConfig.stream_interval sends no chunks here)
                    request.version = UNKNOWN_VERSION
            paused_s, reload_s = await self._pause_elsewhere(path, version, mode, labelled, drain_quiet_s, timeout_s)
        finally:
            self.over.set()
            self.over = None
        return UpdateTiming(client.base_url, mode, version, paused_s, reload_s)

    async def _pause_elsewhere(
        self, path: str | Path, version: int, mode: str, labelled: bool, drain_quiet_s: float, timeout_s: float | None
    ) -> tuple[float, float]:
        """Run the pause, the load and the resume on a loop of their own. The loop this is called on runs every
        request's stream and can be busy for a large part of a second (an abort pause, a dead server's
        requests): a pause whose answers waited behind it would keep the server paused that long.

        What requests in flight receive is stamped anew just before the resume. In keep mode that waits for
        the streams to drain here (`check_drained`, from the pause on, while the weights load). In continue
        mode a request the pause cut, or one that had a token by then, is settled when it ends
        (`LiveRequest.settle_aborted`);
        answers that are not streamed have no token before they end, so the resume waits for this loop to
        read those waiting once the load is over. On the generate route the spans say which tokens came
        before, and nothing waits for this loop."""
        client = self._client
        requests_loop = asyncio.get_running_loop()
        drains = mode == "keep" and not labelled
        drained: concurrent.futures.Future = concurrent.futures.Future()
        caught_up: Callable[[], concurrent.futures.Future] | None = None
        if drains:

            def caught_up() -> concurrent.futures.Future:
                return drained
        elif mode == "continue" and not labelled and not client.stream:

            def caught_up() -> concurrent.futures.Future:
                return asyncio.run_coroutine_threadsafe(asyncio.sleep(0), requests_loop)

        def on_paused() -> None:
            if drains:
                # The quiet is a margin for a network, where bytes sent on other connections before the answer
                # may still be on their way; a server on this machine has put them in our sockets already.
                quiet_s = 0.0 if client._on_this_machine else drain_quiet_s
                paused_at = time.monotonic()
                requests_loop.call_soon_threadsafe(
                    self.check_drained, drained, quiet_s, paused_at, paused_at + max(1.0, 50 * drain_quiet_s)
                )

        over = self.over
        assert over is not None  # set by _paused_update

        def on_resumed() -> None:  # requests held back go out now, not a few passes of the requests' loop later
            with contextlib.suppress(RuntimeError):  # that loop has closed: nothing waits
                requests_loop.call_soon_threadsafe(over.set)

        work = asyncio.wrap_future(
            self._paused_loop().submit(
                self._pause_load_and_resume(
                    path,
                    version,
                    "abort" if mode == "continue" else "keep",
                    labelled,
                    timeout_s,
                    on_paused,
                    on_resumed,
                    caught_up,
                    streams_drained=drains,
                )
            )
        )
        try:
            return await asyncio.shield(work)  # begun, an update runs to its resume even if this task is cancelled
        finally:
            drained.cancel()  # if still waited for (this task was cancelled), the resume goes out at once

    async def _pause_load_and_resume(
        self,
        path: str | Path,
        version: int,
        pause_mode: str,
        labelled: bool,
        timeout_s: float | None,
        on_paused: Callable[[], object],
        on_resumed: Callable[[], object],
        caught_up: Callable[[], concurrent.futures.Future] | None,
        streams_drained: bool,
    ) -> tuple[float, float]:
        """On the pause's loop: pause; load (and label, `labelled`); once the requests' loop has `caught_up`,
        stamp what requests in flight receive next (the new version's after a drain, else unknown); resume,
        and release the requests held back meanwhile (`on_resumed`).
        Returns the seconds from the pause call to the resume's answer, and the load's."""
        client = self._client
        started = time.monotonic()
        try:
            await client.pause(pause_mode)
            on_paused()
            if labelled:
                reload_s = await self._load_and_label(path, version, timeout_s)
            else:
                reload_s = await self._timed_reload(path, version, timeout_s)
            if caught_up is not None:
                await asyncio.wrap_future(caught_up())
            # The server samples nothing until it resumes: every token sampled from here on is the new version's.
            client.version = version
            for request in list(client._live):  # a copy: the requests' loop starts and ends requests meanwhile
                request.resuming(self._version_after_update(request, drained=streams_drained))
        finally:
            await client.resume()
        on_resumed()
        return time.monotonic() - started, reload_s

    def _paused_loop(self) -> LoopThread:
        if self._pause_loop is None:
            self._pause_loop = LoopThread(f"beam-rl-pause {self._client.base_url}")
            # The client has a session per loop that talks to the server: this loop's closes with it.
            self._pause_loop.at_close(self._client._close_session)
        return self._pause_loop

    def _version_after_update(self, request: LiveRequest, drained: bool) -> int:
        """The version to stamp on what a request in flight across a keep or continue update receives next."""
        if request.label_version is not None:
            return UNKNOWN_VERSION  # until its spans come: a token arriving now may have been sampled before
        if request.version == UNKNOWN_VERSION or not drained:
            # Without a drain, what arrives now may still be from before the pause: the tail of a stream
            # the pause aborted, or of one it froze.
            return UNKNOWN_VERSION
        return self._client.version  # every stream drained: what arrives now comes from the new weights

    def check_drained(
        self,
        drained: concurrent.futures.Future,
        quiet_s: float,
        paused_at: float,
        deadline: float,
        read_since: bool = False,
    ) -> None:
        """On the requests' loop, as a plain callback (a task would wait a loop pass more at every step). The
        server answered the pause at `paused_at` having sent every token the engine sampled before it. A pass
        of the loop reads its sockets, then runs its due timers; what a read brings, each stream's reader
        takes in the next pass. The drain ends at a timer set once the streams had been quiet for `quiet_s`
        since the answer (`read_since`: the pass it runs in read the sockets after that), if they still are
        and none holds bytes read but not yet taken. A stream still busy at `deadline` gets unknown versions."""
        if drained.done():
            return
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        streams = [r for r in self._client._live if r.streamed and r.version != UNKNOWN_VERSION]
        latest = max((r.last_data_at for r in streams), default=paused_at)
        wait = max(latest, paused_at) + quiet_s - now
        if now < deadline:
            if wait > 0:
                loop.call_later(wait, self.check_drained, drained, quiet_s, paused_at, deadline)
                return
            if any(r.untaken_bytes for r in streams):
                loop.call_soon(self.check_drained, drained, quiet_s, paused_at, deadline)  # after the readers
                return
            if not read_since:
                loop.call_later(0, self.check_drained, drained, quiet_s, paused_at, deadline, True)
                return
        else:
            busy = [r for r in streams if r.last_data_at + quiet_s > now or r.untaken_bytes]
            if busy:
                log.warning(
                    "%s: %d streams still received tokens while paused; their versions are unknown",
                    self._client.base_url,
                    len(busy),
                )
            for request in busy:
                request.version = UNKNOWN_VERSION
        drained.set_result(None)

    # -- the load and its label -----------------------------------------------------------------------

    async def _timed_reload(self, path: str | Path, version: int, timeout_s: float | None) -> float:
        started = time.monotonic()
        if self._client.lora:
            await self._load_adapter(path, version, timeout_s)
        else:
            await self._client.reload_weights(str(path), timeout_s)
        return time.monotonic() - started

    async def _load_and_label(self, path: str | Path, version: int, timeout_s: float | None) -> float:
        """Load and label at once, while paused: nothing samples, so either may land first. A load that
        fails gives the old weights their label back before the resume."""
        loaded, labelled = await asyncio.gather(
            self._timed_reload(path, version, timeout_s), self.label(version), return_exceptions=True
        )
        if isinstance(loaded, BaseException):
            if not isinstance(labelled, BaseException):
                with contextlib.suppress(InferenceError):
                    await self.label(self._client.version)
            raise loaded
        if isinstance(labelled, BaseException):
            raise labelled
        return loaded

    async def label(self, version: int) -> None:
        """Have the server report `version` as its weights' label (vLLM's `/update_weight_version`)."""
        if not self.labels_supported:
            return
        try:
            await self._client._request(
                "POST", "/update_weight_version", json={"new_version": str(version)}, retry=False
            )
        except InferenceHTTPError as exc:
            if exc.status not in (404, 405):
                raise
            self.labels_supported = False  # a server without vLLM's RL routes: restarts go unnoticed
            log.warning(
                "%s has no /update_weight_version: a restart between updates will not be noticed", self._client.base_url
            )
            return
        self.labelled = version
