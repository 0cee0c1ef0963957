"""Load metrics of the embedded server in vLLM's Prometheus names: running/waiting sequences, a
simulated KV-cache usage, prefix-cache hits, token counters, plus beam_rl test counters.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

KV_BLOCK_SIZE = 16  # vLLM's default block size


class PrefixCache:
    """An LRU of prompts seen, standing in for vLLM's prefix cache in the hit/query counters."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._prompts: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self.queries = 0
        self.hits = 0

    def lookup(self, prompt: tuple[int, ...]) -> None:
        # Per request, as the n choices share one prefill: a repeated prompt hits all its tokens.
        self.queries += len(prompt)
        if prompt in self._prompts:
            self.hits += len(prompt)
            self._prompts.move_to_end(prompt)
        else:
            self._prompts[prompt] = None
            if len(self._prompts) > self.capacity:
                self._prompts.popitem(last=False)


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
        s = self.server
        label = [s.served_model_name]

        def family(kind: type, name: str, doc: str, value: float) -> Metric:
            metric = kind(name, doc, labels=["model_name"])  # a counter is exposed as <name>_total
            metric.add_metric(label, value)
            return metric

        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield family(gauge, "vllm:num_requests_running", "Sequences being generated.", s.admission.running)
        yield family(gauge, "vllm:num_requests_waiting", "Sequences waiting for a running slot.", s.admission.waiting)
        yield family(gauge, "vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).", s.kv_cache_usage())
        yield family(counter, "vllm:prefix_cache_queries", "Prompt tokens looked up.", s.prefix_cache.queries)
        yield family(counter, "vllm:prefix_cache_hits", "Prompt tokens found cached.", s.prefix_cache.hits)
        yield family(counter, "vllm:prompt_tokens", "Prompt tokens processed.", s.prompt_tokens_total)
        yield family(counter, "vllm:generation_tokens", "Tokens generated.", s.generation_tokens_total)
        yield family(gauge, "beam_rl:max_concurrent_requests", "Most sequences running at once.", s.admission.max_running)
        yield family(counter, "beam_rl:requests", "Completion requests received.", s.requests_total)
        yield family(counter, "beam_rl:busy_seconds", "Seconds with at least one sequence running.",
                     s.admission.busy_seconds)
        yield family(gauge, "beam_rl:weights_version", "Successful weight reloads so far.", s.weights_version)
        yield family(gauge, "beam_rl:paused", "1 while paused.", float(s.paused))
