"""Load metrics of the embedded server in vLLM's Prometheus names: running/waiting sequences, a
simulated KV-cache usage, prefix-cache hits, token counters, plus beam_rl test counters.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from beam_rl.standin.backend import PauseState

KV_BLOCK_SIZE = 16  # vLLM's default block size


class PrefixCache:
    """An LRU of (cache salt, prompt) pairs seen, standing in for vLLM's prefix cache in the
    hit/query counters: a prompt hits only under the salt it was cached with."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._prompts: OrderedDict[tuple[str | None, tuple[int, ...]], None] = OrderedDict()
        self.queries = 0
        self.hits = 0

    def lookup(self, prompt: tuple[int, ...], salt: str | None = None) -> None:
        # Per request, as the n choices share one prefill: a repeated prompt hits all its tokens.
        self.queries += len(prompt)
        key = (salt, prompt)
        if key in self._prompts:
            self.hits += len(prompt)
            self._prompts.move_to_end(key)
        else:
            self._prompts[key] = None
            if len(self._prompts) > self.capacity:
                self._prompts.popitem(last=False)

    def reset(self) -> None:
        """Forget every cached prompt (vLLM's /reset_prefix_cache); the counters keep counting."""
        self._prompts.clear()


def kv_cache_usage(active_states: list[Any], capacity_blocks: int) -> float:
    """Fraction (0..1) of a paged KV cache of `capacity_blocks` blocks that running sequences hold."""
    blocks = 0
    for state in active_states:
        prompt = len(state.params.prompt_ids)
        blocks += sum(math.ceil((prompt + len(c.token_ids)) / KV_BLOCK_SIZE) for c in state.choices)
    return min(1.0, blocks / capacity_blocks)


class ServerMetrics:
    """A prometheus_client collector that reads the server's live state at scrape time."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        s, b = self.server, self.server.backend
        label = [s.served_model_name]

        def family(kind: type, name: str, doc: str, value: float) -> Metric:
            metric = kind(name, doc, labels=["model_name"])  # a counter is exposed as <name>_total
            metric.add_metric(label, value)
            return metric

        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield family(gauge, "vllm:num_requests_running", "Sequences being generated.", b.running)
        yield family(gauge, "vllm:num_requests_waiting", "Sequences waiting for a running slot.", b.waiting)
        yield family(gauge, "vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).", b.kv_cache_usage())
        yield family(
            counter, "vllm:num_preemptions", "Sequences preempted for KV-cache room.", getattr(b, "preemptions", 0)
        )
        yield family(counter, "vllm:prefix_cache_queries", "Prompt tokens looked up.", b.prefix_cache.queries)
        yield family(counter, "vllm:prefix_cache_hits", "Prompt tokens found cached.", b.prefix_cache.hits)
        yield family(counter, "vllm:prompt_tokens", "Prompt tokens processed.", b.prompt_tokens)
        yield family(
            counter, "vllm:generation_tokens", "Tokens generated, counted as they are sampled.", b.generation_tokens
        )
        yield family(gauge, "beam_rl:max_concurrent_requests", "Most sequences running at once.", b.max_running)
        yield family(counter, "beam_rl:requests", "Completion requests received.", s.requests_total)
        yield family(counter, "beam_rl:busy_seconds", "Seconds with at least one sequence running.", b.busy_seconds)
        yield family(gauge, "beam_rl:weights_version", "Successful weight reloads so far.", b.weights.loads)
        yield family(gauge, "beam_rl:paused", "1 while paused.", float(s.gate.state != PauseState.UNPAUSED))
        yield family(
            counter,
            "beam_rl:paused_seconds",
            "Seconds paused, from the pause call to the resume call.",
            s.gate.paused_seconds,
        )
        if b.stalled_seconds is not None:
            yield family(
                counter,
                "beam_rl:stalled_seconds",
                "Seconds a pause kept the engine from stepping while sequences ran or waited.",
                b.stalled_seconds,
            )
