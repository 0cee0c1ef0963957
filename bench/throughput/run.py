"""Run every figure of the benchmark and write one JSON: `python -m bench.throughput.run [--size small|full]
[--runners direct,flink-local] --out bench/throughput/results.json`."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

from bench.common.pipeline import SIZES
from bench.throughput import overhead, sink, utilization

FIGURES = ("engine_utilization", "prefix_cache", "orchestration_overhead", "commit_latency", "memory", "sink")


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "processor": _cpu_model()}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def run(size_name: str, runners: list[str]) -> dict[str, Any]:
    size = SIZES[size_name]
    t0 = time.time()
    util = utilization.measure(size)
    pipe = overhead.measure(size, runners)
    sink_fig = sink.measure(size)
    policies = util["policies"]
    return {
        "size": size_name,
        "command": " ".join(["python -m bench.throughput.run", *sys.argv[1:]]),
        "machine": machine(),
        "started_at": t0,
        "elapsed_s": round(time.time() - t0, 1),
        "figures": {
            "engine_utilization": {k: v for k, v in util.items() if k != "policies"} | {
                "full_share_mean": {p: r["full_share_mean"] for p, r in policies.items()},
                "policies": policies},
            "prefix_cache": {"hit_rate": {p: r["prefix_cache_hit_rate"] for p, r in policies.items()}},
            "orchestration_overhead": pipe,
            "commit_latency": {r: v["commit_latency_s"] for r, v in pipe["runners"].items()},
            "memory": {r: {"rss_mb": v["rss_mb"], "growth_after_warmup": v["rss_growth_after_warmup"]}
                       for r, v in pipe["runners"].items()},
            "sink": sink_fig,
        },
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--runners", default="direct", help="comma-separated: direct, flink-local")
    parser.add_argument("--out", default="bench/throughput/results.json")
    args = parser.parse_args(argv)
    runners = [r for r in args.runners.split(",") if r]
    result = run(args.size, runners)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["figures"] | {"elapsed_s": result["elapsed_s"]}, indent=1))


if __name__ == "__main__":
    main()
