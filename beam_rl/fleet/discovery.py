"""The servers file of a run directory, edited by `beam-rl servers`: one of the fleet's sources (the other
is a DNS name, beam_rl/fleet/dns_fleet.py; `beam_rl/job/fleet_keeper.py:discover` reads either). A source that
cannot be read raises DiscoveryError naming it, and the run keeps the fleet it has."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from beam_rl.config import has_credentials
from beam_rl.rundir.atomic import write_atomic
from beam_rl.rundir.layout import RunLayout

# The comment that marks a server the run started itself: replaced by the ones it starts next time.
EMBEDDED = "embedded"


class DiscoveryError(Exception):
    """The fleet could not be discovered (the message names the file or the name)."""


def base_url(text: str) -> str:
    """`text` as a base URL clients can append routes to; ValueError when it is not one."""
    url = text.strip().rstrip("/")
    if has_credentials(url):  # never echoed: the message would print the secret
        raise ValueError(
            "a URL with credentials (user:password@) would be written to the servers file: put the "
            "key in an environment variable and name it in inference.api_key_env"
        )
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1]) == 0 or " " in url:
        raise ValueError(f"{text.strip()!r} is not an http(s) base URL")
    return url


@dataclass(frozen=True)
class ServerLine:
    url: str
    embedded: bool = False

    def render(self) -> str:
        return f"{self.url}  # {EMBEDDED}" if self.embedded else self.url


class ServersFile:
    """One base URL per line; `#` starts a comment. Edits hold an exclusive lock and replace the file
    atomically, so a reader sees the old list or the new one."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def of_run(cls, run_dir: str | Path) -> ServersFile:
        return cls(RunLayout(run_dir).servers_path)

    def exists(self) -> bool:
        return self.path.is_file()

    def read(self) -> list[ServerLine]:
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            raise DiscoveryError(f"the servers file {self.path} does not exist") from None
        except (OSError, UnicodeDecodeError) as err:
            raise DiscoveryError(f"the servers file {self.path} cannot be read: {err}") from err
        lines, seen = [], set()
        for number, line in enumerate(text.splitlines(), 1):
            entry, _, comment = line.partition("#")
            if not entry.strip():
                continue
            try:
                url = base_url(entry)
            except ValueError as err:
                raise DiscoveryError(f"the servers file {self.path}, line {number}: {err}") from None
            if url not in seen:
                seen.add(url)
                lines.append(ServerLine(url, comment.strip() == EMBEDDED))
        return lines

    def urls(self) -> list[str]:
        return [line.url for line in self.read()]

    def add(self, url: str) -> bool:
        """Add `url` (False when it is there already)."""
        url = base_url(url)
        with self._editing() as lines:
            if any(line.url == url for line in lines):
                return False
            lines.append(ServerLine(url))
            return True

    def remove(self, url: str) -> bool:
        """Remove `url` (False when it is not there)."""
        url = base_url(url)
        with self._editing() as lines:
            kept = [line for line in lines if line.url != url]
            removed = len(kept) < len(lines)
            lines[:] = kept
            return removed

    def seed(self, urls: list[str], embedded: bool) -> list[str]:
        """At the start of a run: without a file, write `urls`; with one, `embedded` servers (started now)
        take the place of those an earlier start wrote. Returns the fleet the file then lists."""
        with self._editing(create=True) as lines:
            if not lines and not embedded:
                lines.extend(ServerLine(url) for url in urls)
            elif embedded:
                lines[:] = [line for line in lines if not line.embedded] + [ServerLine(u, True) for u in urls]
            return [line.url for line in lines]

    @contextlib.contextmanager
    def _editing(self, create: bool = False) -> Iterator[list[ServerLine]]:
        lock_path = self.path.with_name(f".{self.path.name}.lock")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with lock_path.open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            lines = self.read() if self.exists() or not create else []
            before = list(lines)
            yield lines
            if lines != before or not self.exists():
                body = "".join(f"{line.render()}\n" for line in lines)
                write_atomic(self.path, body.encode())
