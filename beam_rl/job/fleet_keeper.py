"""The launcher's side of a living fleet: a thread that discovers the fleet every
`inference.discovery_interval_s`, checks each server that joins, and records in the run directory's
fleet.json which shard drives which server (beam_rl/fleet/assignment.py). The sources follow that record;
nothing of it lives only in this process."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from beam_rl.config import RunConfig
from beam_rl.fleet.assignment import Fleet, deal
from beam_rl.fleet.discovery import DiscoveryError, ServersFile
from beam_rl.fleet.dns_fleet import resolve_fleet
from beam_rl.inference.client import InferenceError
from beam_rl.model.location import tokenizer_for
from beam_rl.rundir.failures import ServersNotReadyError
from beam_rl.rundir.layout import RunLayout
from beam_rl.wiring import JobParts

_LOG = logging.getLogger(__name__)

# Tokenized by a joining server and by the run's tokenizer: words, digits, punctuation and spaces.
TOKENIZER_PROBE = "Reverse 'beam-rl 2026': 12 + 30 = 42, then stop."


def discover(config: RunConfig, run_dir: str | Path) -> list[str]:
    """The fleet as its source says now (inference.discovery "file" or "dns"): base URLs, sorted."""
    inf = config.inference
    if inf.discovery == "file":
        return sorted(ServersFile.of_run(run_dir).urls())
    if inf.discovery == "dns":
        assert inf.dns_name is not None  # the config requires it
        return resolve_fleet(inf.dns_name, inf.dns_resolver)
    raise ValueError(f"inference.discovery = {inf.discovery!r} discovers nothing while the run goes on")


def handoff_s(config: RunConfig) -> float:
    """How long after a server is moved between shards its new shard may drive it: the old shard's drain,
    and a discovery interval for the old shard to notice."""
    return config.inference.drain_timeout_s + config.inference.discovery_interval_s


def joining_problem(parts: JobParts, url: str) -> str | None:
    """Why the server at `url` cannot join the run (unreachable, another model, another tokenizer), or None."""
    config = parts.config

    async def check() -> str | None:
        async with parts.client(url) as client:
            try:
                if not await client.health():
                    return f"{url} does not answer /health yet"
                models = await client.served_models()
                if config.model.name not in models:
                    return f"{url} serves {models}, not the run's model {config.model.name!r}"
                theirs = await client.tokenize(TOKENIZER_PROBE)
            except InferenceError as err:
                return f"{url}: {err}"
        ours = tokenizer_for(config.model.name).encode(TOKENIZER_PROBE, add_special_tokens=False)
        if theirs is not None and list(theirs) != list(ours):
            return f"{url} tokenizes differently from the run's model {config.model.name!r} ({theirs[:8]} ...)"
        return None

    return asyncio.run(check())


class FleetKeeper:
    """Keeps RUN_DIR/fleet.json current while the run goes on (module docstring). A source that cannot be
    read, or lists no server, leaves the fleet as it is; a server that cannot join is named in a warning
    and checked again at the next discovery."""

    def __init__(
        self, parts: JobParts, run_dir: str, initial: list[str] | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self._parts = parts
        self._config = config = parts.config
        self._run_dir = run_dir
        self._path = RunLayout(run_dir).fleet_path
        self._clock = clock
        self._said: dict[str, str] = {}  # the last warning per server (or the source): repeated only when it changes
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            previous = Fleet.read(self._path)
        except DiscoveryError as err:
            _LOG.warning("%s; dealing the fleet afresh", err)
            previous = None
        if initial is None and previous is None:
            raise ValueError(f"{self._path} records no fleet to keep, and no initial servers were given")
        # `initial` None: the fleet as recorded (a launcher that attaches to a running job)
        urls = initial if initial is not None else previous.urls() if previous is not None else []
        self.fleet = self._record(deal(previous, urls, config.dispatch.shards, clock(), handoff_s(config)), previous)

    def start(self) -> FleetKeeper:
        self._thread = threading.Thread(target=self._run, name="beam-rl-fleet", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self._config.inference.discovery_interval_s):
            try:
                self.tick()
            except Exception:  # the fleet stays as it is; the next discovery tries again
                _LOG.exception("discovering the fleet failed")

    def tick(self) -> Fleet:
        """Discover the fleet once and record it if it changed."""
        try:
            found = discover(self._config, self._run_dir)
        except DiscoveryError as err:
            self._say("discovery", f"{err}: the run keeps its {len(self.fleet.servers)} servers")
            return self.fleet
        if not found:
            self._say(
                "discovery",
                f"inference.discovery = {self._config.inference.discovery!r} lists no server: "
                f"the run keeps its {len(self.fleet.servers)} servers",
            )
            return self.fleet
        self._said.pop("discovery", None)
        current = set(self.fleet.urls())
        admitted = []
        for url in found:
            problem = None if url in current else joining_problem(self._parts, url)
            if problem is None:
                self._said.pop(url, None)
                admitted.append(url)
            else:
                self._say(
                    url,
                    f"{problem}: it does not join the run (checked again in "
                    f"{self._config.inference.discovery_interval_s:g} s)",
                )
        fleet = deal(self.fleet, admitted, self._config.dispatch.shards, self._clock(), handoff_s(self._config))
        self.fleet = self._record(fleet, self.fleet)
        return self.fleet

    def _record(self, fleet: Fleet, previous: Fleet | None) -> Fleet:
        if previous is not None and fleet == previous:
            return fleet
        before = set(previous.urls()) if previous else set()
        for placement in fleet.servers:
            if placement.url not in before:
                _LOG.info("server %s joins the fleet, driven by dispatch shard %d", placement.url, placement.shard)
            elif previous and (old := previous.placement(placement.url)) is not None and old.shard != placement.shard:
                _LOG.info("server %s moves from dispatch shard %d to %d", placement.url, old.shard, placement.shard)
        for url in sorted(before - set(fleet.urls())):
            _LOG.info("server %s leaves the fleet: its shard drains it", url)
        fleet.write(self._path)
        return fleet

    def _say(self, key: str, message: str) -> None:
        if self._said.get(key) != message:
            self._said[key] = message
            _LOG.warning("%s", message)


def initial_fleet(config: RunConfig, run_dir: str, started: list[str]) -> list[str]:
    """The servers a run starts with, given those its launcher has (`inference.urls`, or the embedded
    servers it `started`): those, the run directory's servers file (seeded with them on the first start,
    its embedded servers replaced by the new ones on a restart), or the DNS name's records.
    ServersNotReadyError naming the file or the name when it cannot be read."""
    inf = config.inference
    try:
        if inf.discovery == "file":
            return ServersFile.of_run(run_dir).seed(started, embedded=not inf.urls)
        if inf.discovery == "dns":
            return discover(config, run_dir)
    except DiscoveryError as err:
        raise ServersNotReadyError(f"inference.discovery = {inf.discovery!r}: {err}") from err
    return started
