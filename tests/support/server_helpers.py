"""Helpers for tests that talk to the embedded server over loopback HTTP: its metrics, the Server-Sent
Events of a streamed completion, and the weights versions it says sampled each token."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from beam_rl.inference import client as client_module
from beam_rl.inference.inflight import LiveRequest


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


@contextlib.contextmanager
def served_versions() -> Iterator[dict[int, list[int]]]:
    """What the embedded server says sampled each token it sent (`return_weight_versions`), recorded beside
    what the client makes of it: keyed by the id of the client's Completion.policy_versions list, which a
    single-turn rollout's Turn keeps. The product never reads these (real vLLM has no such field)."""
    served: dict[int, list[int]] = collections.defaultdict(list)
    pending: collections.deque[list[int]] = collections.deque()  # one entry per choice, in LiveRequest.add order
    # Every list recorded is held here: one a discarded rollout dropped would otherwise free its id for
    # another's, and the two rollouts' tokens would be recorded as one.
    recorded: list[list[int]] = []
    add, add_chunk, parse = LiveRequest.add, LiveRequest.add_chunk, client_module.parse_completions

    def record_add(self, index, token_ids, logprobs, finish_reason):
        versions = self.choices[index].policy_versions
        if id(versions) not in served:
            recorded.append(versions)
        served[id(versions)].extend(pending.popleft())
        return add(self, index, token_ids, logprobs, finish_reason)

    def record_chunk(self, chunk, bad):
        pending.extend(c.get("token_weight_versions") or [] for c in chunk.get("choices") or [])
        return add_chunk(self, chunk, bad)

    def record_parse(body, url, n):
        completions = parse(body, url, n)
        by_index = {c.get("index", 0): c.get("token_weight_versions") or [] for c in body["choices"]}
        pending.extend(by_index[i] for i in range(n))
        return completions

    LiveRequest.add, LiveRequest.add_chunk, client_module.parse_completions = record_add, record_chunk, record_parse
    try:
        yield served
    finally:
        LiveRequest.add, LiveRequest.add_chunk, client_module.parse_completions = add, add_chunk, parse
