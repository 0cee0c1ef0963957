"""Helpers for tests that talk to the embedded server over loopback HTTP: its metrics, and the
Server-Sent Events of a streamed completion."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families


def parse_metrics(text: str) -> dict[str, float]:
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def metrics(url: str, **kwargs: Any) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics", timeout=10, **kwargs).text)


async def wait_for_metrics(url: str, predicate, deadline_s: float = 20.0) -> dict[str, float]:
    """Poll /metrics until `predicate` holds (a generous deadline, never a timing assertion)."""
    async with httpx.AsyncClient(timeout=10) as client:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            snapshot = parse_metrics((await client.get(url + "/metrics")).text)
            if predicate(snapshot):
                return snapshot
            await asyncio.sleep(0.01)
    raise AssertionError("metrics never reached the expected state")


def sse_data(lines: list[str]) -> list[Any]:
    """The `data:` payloads of an event stream, JSON-decoded except the final "[DONE]"."""
    events = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
