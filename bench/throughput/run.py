"""Run every figure of the benchmark and write one JSON: `python -m bench.run [--size small|full]
[--runners direct,flink-local] --out bench/results.json`."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

from bench import overhead, sink, utilization

# Simulated engine settings of figures 1-2 (see beam_rl/standin/simulated.py for the cost model).
SIM_FULL = ("--sim-length-median", "64", "--sim-length-sigma", "1.0", "--sim-decode-base-s", "0.02",
            "--sim-decode-s-per-seq", "1e-4", "--sim-prefill-s-per-token", "2e-5")
SIM_SMALL = ("--sim-length-median", "24", "--sim-length-sigma", "1.0", "--sim-decode-base-s", "0.01",
             "--sim-decode-s-per-seq", "1e-4", "--sim-prefill-s-per-token", "2e-5")

SIZES: dict[str, dict[str, Any]] = {
    "full": {"servers": 4, "max_num_seqs": 256, "rollouts": 20_000, "group_size": 8, "max_tokens": 256,
             "sim_args": SIM_FULL, "tokens": 256, "rollouts_per_step": 256, "pipeline_rollouts": 20_000,
             "pipeline_permits": 512, "pipeline_servers": 2, "rss_warm_rollouts": 2_000, "sink_rollouts": 4_096},
    "small": {"servers": 2, "max_num_seqs": 32, "rollouts": 640, "group_size": 8, "max_tokens": 128,
              "sim_args": SIM_SMALL, "tokens": 256, "rollouts_per_step": 128, "pipeline_rollouts": 1_024,
              "pipeline_permits": 256, "pipeline_servers": 2, "rss_warm_rollouts": 256, "sink_rollouts": 512},
}
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
        "command": " ".join(["python -m bench.run", *sys.argv[1:]]),
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
    parser.add_argument("--out", default="bench/results.json")
    args = parser.parse_args(argv)
    runners = [r for r in args.runners.split(",") if r]
    result = run(args.size, runners)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["figures"] | {"elapsed_s": result["elapsed_s"]}, indent=1))


if __name__ == "__main__":
    main()
