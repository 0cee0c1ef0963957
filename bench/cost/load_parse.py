"""What reading a server's load costs the dispatcher, which polls every server's /metrics: the whole
exposition handed to prometheus_client's parser against only the lines a ServerLoad reads, side by side:

    .venv/bin/python -m bench.cost.load_parse

On the embedded simulated server's exposition, and on a vLLM-shaped one (per-engine gauges and counters,
latency histograms: most of a real server's lines)."""

from __future__ import annotations

import argparse
import json
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from beam_rl.inference.parsing import parse_server_load


def vllm_like_metrics(engines: int = 2, buckets: int = 40, histograms: int = 2) -> str:
    """A vLLM-shaped exposition: per-engine gauges and counters (with their _created samples), a name that only
    starts like a read one, and latency histograms."""
    lines = []
    for name, kind, value in (("vllm:num_requests_running", "gauge", 3.0), ("vllm:num_requests_waiting", "gauge", 2.0),
                              ("vllm:kv_cache_usage_perc", "gauge", 0.25), ("vllm:prefix_cache_hits", "counter", 40.0),
                              ("vllm:prefix_cache_queries", "counter", 100.0), ("vllm:num_preemptions", "counter", 1.0),
                              ("vllm:num_requests_running_peak", "gauge", 99.0)):
        lines += [f"# HELP {name} what it counts", f"# TYPE {name} {kind}"]
        for engine in range(engines):
            labels = f'{{engine="{engine}",model_name="tiny"}}'
            lines.append(f"{name}_total{labels} {value * (engine + 1)}" if kind == "counter"
                         else f"{name}{labels} {value * (engine + 1)}")
            if kind == "counter":
                lines.append(f"{name}_created{labels} 1.7e9")
    for h in range(histograms):
        histogram = f"vllm:latency_{h}_seconds"
        lines += [f"# HELP {histogram} latency", f"# TYPE {histogram} histogram"]
        for engine in range(engines):
            labels = f'engine="{engine}",model_name="tiny"'
            lines += [f'{histogram}_bucket{{{labels},le="{0.01 * 2 ** b}"}} {b}' for b in range(buckets)]
            lines += [f'{histogram}_bucket{{{labels},le="+Inf"}} {buckets}', f"{histogram}_count{{{labels}}} {buckets}",
                      f"{histogram}_sum{{{labels}}} 12.5"]
    return "\n".join(lines) + "\n"


def _whole(text: str) -> None:
    for family in text_string_to_metric_families(text):
        for _ in family.samples:
            pass


def _per_parse_us(parse, text: str, repeats: int) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        parse(text)
    return round((time.perf_counter() - started) / repeats * 1e6, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=500)
    args = parser.parse_args()
    from beam_rl.standin.server import EmbeddedServer

    with EmbeddedServer(mode="simulated") as server:
        embedded = httpx.get(f"{server.url}/metrics").text
    result = {}
    for name, text in (("embedded simulated server", embedded), ("vLLM-shaped, 1 engine, 10 histograms",
                                                                  vllm_like_metrics(engines=1, histograms=10))):
        result[name] = {"lines": len(text.splitlines()), "whole_us": _per_parse_us(_whole, text, args.repeats),
                        "load_lines_us": _per_parse_us(parse_server_load, text, args.repeats)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
