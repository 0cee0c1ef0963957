"""The run's records beside the steps: metrics.jsonl (appended, read incrementally) and each dispatch
shard's status file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from beam_rl.rundir.atomic import atomic_write, json_bytes, json_default
from beam_rl.rundir.errors import MetricsError
from beam_rl.rundir.layout import RunLayout


class MetricsStore(RunLayout):
    """metrics.jsonl, one JSON object per line, and the dispatch shards' status files."""

    def append_metrics(self, metrics: dict[str, Any]) -> None:
        """Append one JSON line; numpy scalars and arrays are converted (metrics often come from numpy)."""
        self.path.mkdir(parents=True, exist_ok=True)
        line = json.dumps(metrics, default=json_default, separators=(",", ":"))
        with self.metrics_path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")

    def read_metrics(self) -> list[dict[str, Any]]:
        """All metrics lines; a torn last line (a crash mid-append) is skipped, a torn earlier one is an error."""
        return MetricsTail(self.metrics_path).read_new()

    def write_status(self, status: dict[str, Any], shard: int = 0) -> None:
        """A dispatch shard's live state (in flight, policy version, ...), replaced as it changes."""
        data = json_bytes(status)
        atomic_write(self.status_path(shard), lambda f: f.write(data), fsync_dir=False)

    def repair_metrics(self) -> int:
        """Drop a torn last line (a crash mid-append) before anything appends again, which would glue the
        next record to it; returns the bytes dropped. What follows the last newline was never a record."""
        try:
            with self.metrics_path.open("r+b") as f:
                size = f.seek(0, os.SEEK_END)
                keep = max(0, size - (1 << 16))
                f.seek(keep)
                tail = f.read()
                end = tail.rfind(b"\n")
                if end == len(tail) - 1 or (end < 0 and keep > 0):
                    return 0  # whole, or a last line longer than the look-back: left to the reader
                f.truncate(keep + end + 1)
                return size - (keep + end + 1)
        except FileNotFoundError:
            return 0

    def read_status(self) -> dict[str, Any]:
        """Every dispatch shard's live state, merged (see merge_status); {} before any is written. A status
        file that is not JSON is skipped: its shard rewrites it within a second."""
        shards = []
        for path in sorted(self.path.glob("status-*.json")):
            try:
                status = json.loads(path.read_bytes())
            except (FileNotFoundError, ValueError):
                continue
            if isinstance(status, dict):
                shards.append(status)
        return merge_status(shards)


_SUMMED_STATUS = (
    "inflight",
    "max_inflight",
    "started",
    "ok",
    "errored",
    "cancelled",
    "groups_admitted",
    "healthy_servers",
    "groups_out",
    "groups_in_transit",
    "groups_emitted",
    "cancelled_stale_groups",
    "redispatched",
    "regenerated",
    "cancelled_stale",
    "redone_on_restart",
    "resumed",
    "resumed_tokens",
)


def merge_status(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's live state from its shards': counts summed, servers listed together, the oldest policy
    version, waiting for the trainer if any shard is, the newest update time."""
    if not shards:
        return {}
    merged = dict(shards[0])
    for key in _SUMMED_STATUS:
        if any(key in s for s in shards):
            merged[key] = sum(s.get(key, 0) for s in shards)
    merged["servers"] = [server for s in shards for server in s.get("servers", [])]
    merged["policy_version"] = min(s.get("policy_version", 0) for s in shards)
    merged["waiting_for_trainer"] = any(s.get("waiting_for_trainer") for s in shards)
    merged["updated_at"] = max(s.get("updated_at", 0.0) for s in shards)
    merged["shards"] = len(shards)
    merged["errors"] = _merged_errors(shards)
    return merged


def _merged_errors(shards: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each error cause over every shard (beam_rl/source/status.py:ErrorTally): counts summed, the newest
    example kept; the newest cause first."""
    causes: dict[str, dict[str, Any]] = {}
    for shard in shards:
        for entry in shard.get("errors") or []:
            have = causes.setdefault(entry["cause"], {**entry, "count": 0})
            have["count"] += entry["count"]
            if entry["last_at"] > have["last_at"]:
                have.update(example=entry["example"], last_at=entry["last_at"])
    return sorted(causes.values(), key=lambda entry: -entry["last_at"])


class MetricsTail:
    """Reads a metrics.jsonl incrementally: each `read_new` parses only the lines appended since the last.

    A last line without its newline (a writer mid-append) is left for a later call, and so is a last line
    that is not valid JSON (torn by a crash): it is an error only once a line follows it, as in
    `MetricsStore.read_metrics`. A file shorter than what was read was truncated or replaced: reading restarts.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0  # bytes read: just past the last line consumed
        self._line = 0  # lines consumed, to name a bad line by its number

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                if os.fstat(f.fileno()).st_size < self.offset:
                    self.offset = self._line = 0
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        *lines, unterminated = data.split(b"\n")
        records = []
        for index, line in enumerate(lines):
            if line.strip():
                try:
                    record = json.loads(line)
                    if not isinstance(record, dict):
                        raise ValueError(f"a JSON {type(record).__name__}, not an object")
                except ValueError as exc:  # not JSON, or not UTF-8
                    if index == len(lines) - 1 and not unterminated:
                        break  # the file's last line
                    raise MetricsError(f"{self.path}:{self._line + 1}: not valid JSON: {exc}") from None
                records.append(record)
            self.offset += len(line) + 1
            self._line += 1
        return records
