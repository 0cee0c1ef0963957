"""Which dispatch shard drives which server, as the fleet changes: the run directory's fleet.json, written
by the launcher (beam_rl/job/fleet_keeper.py) and followed by every shard's source.

The rules (`deal`): a server stays with its shard while it is in the fleet; a new one goes to the shard
with the fewest; when servers leaving make one shard hold two more than another, the newest server of
the largest moves to the smallest, which takes it into service only `handoff_s` later: the shard it
leaves drains it meanwhile, so no server is driven by two shards.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from beam_rl.fleet.discovery import DiscoveryError
from beam_rl.rundir.atomic import json_bytes, write_atomic

_LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    url: str
    shard: int
    joined_at: float  # Unix time it entered the fleet
    serve_from: float = 0.0  # Unix time from which its shard may drive it (after a hand-over between shards)


@dataclass(frozen=True)
class Fleet:
    generation: int  # counts the changes since the run's first fleet
    servers: tuple[Placement, ...]

    def urls(self) -> list[str]:
        return [p.url for p in self.servers]

    def of_shard(self, shard: int, now: float) -> list[str]:
        """The servers `shard` drives at Unix time `now`."""
        return [p.url for p in self.servers if p.shard == shard and p.serve_from <= now]

    def placement(self, url: str) -> Placement | None:
        return next((p for p in self.servers if p.url == url), None)

    def write(self, path: Path) -> None:
        write_atomic(
            path, json_bytes({"generation": self.generation, "servers": [asdict(p) for p in self.servers]}, indent=1)
        )

    @classmethod
    def read(cls, path: Path) -> Fleet | None:
        """The fleet recorded at `path`; None when there is none. DiscoveryError when it does not parse."""
        try:
            record = json.loads(path.read_text())
            return cls(int(record["generation"]), tuple(Placement(**p) for p in record["servers"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError) as err:
            raise DiscoveryError(f"{path} does not hold a fleet record: {err}") from err


def deal(previous: Fleet | None, urls: Iterable[str], shards: int, now: float, handoff_s: float) -> Fleet:
    """The fleet of `urls` over `shards` shards, moving as few servers from their `previous` shard as
    keeps the shards within one server of each other (module docstring)."""
    wanted = sorted(set(urls))
    placed = {p.url: p for p in (previous.servers if previous else ()) if p.url in wanted and p.shard < shards}
    counts = Counter(dict.fromkeys(range(shards), 0))
    counts.update(p.shard for p in placed.values())

    def fewest() -> int:
        return min(range(shards), key=lambda s: (counts[s], s))

    for url in wanted:
        if url not in placed:
            shard = fewest()
            placed[url] = Placement(url, shard, joined_at=now)
            counts[shard] += 1
    while True:
        small, big = fewest(), max(range(shards), key=lambda s: (counts[s], -s))
        if counts[big] - counts[small] < 2:
            break
        mover = max((p for p in placed.values() if p.shard == big), key=lambda p: (p.joined_at, p.url))
        placed[mover.url] = replace(mover, shard=small, serve_from=now + handoff_s)
        counts[big] -= 1
        counts[small] += 1
    servers = tuple(sorted(placed.values(), key=lambda p: p.url))
    if previous is None:
        return Fleet(1, servers)
    return Fleet(previous.generation + (servers != previous.servers), servers)


class FleetFollower:
    """One shard's view of fleet.json: the servers it drives, re-read when the file changes."""

    def __init__(self, path: Path, shard: int) -> None:
        self._path = path
        self._shard = shard
        self._stamp: tuple[int, int] | None = None
        self._fleet: Fleet | None = None
        self._given: list[str] | None = None
        self._problem: str | None = None

    def servers(self, now: float) -> list[str] | None:
        """The servers this shard drives now; None while no fleet is recorded."""
        try:
            stat = self._path.stat()
        except FileNotFoundError:
            return None if self._fleet is None else self._fleet.of_shard(self._shard, now)
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp != self._stamp:
            try:
                self._fleet = Fleet.read(self._path)
                self._problem = None
            except DiscoveryError as err:  # a torn copy on a shared filesystem: the last good one holds
                if str(err) != self._problem:
                    _LOG.warning("%s; dispatch keeps the servers it has", err)
                self._problem = str(err)
            else:
                self._stamp = stamp
        return None if self._fleet is None else self._fleet.of_shard(self._shard, now)

    def changed(self, now: float) -> list[str] | None:
        """The servers this shard drives now, when they differ from what this last returned."""
        servers = self.servers(now)
        if servers is None or servers == self._given:
            return None
        self._given = servers
        return servers
