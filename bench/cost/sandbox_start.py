"""What a reward program's start costs: the wall time of `run_python` for a short program, median over
N runs, for this checkout's sandbox and for the sandbox of a git ref (main by default) side by side.
The two take turns, so both see the same load on the machine.

    .venv/bin/python -m bench.cost.sandbox_start --runs 100 --baseline main --out bench/cost/sandbox_start.json

The baseline is `beam_rl/envs/sandbox.py` as committed at the ref, loaded as a module of its own (it
imports only the standard library).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from beam_rl.envs import sandbox
from bench.common.results import write_results

PROGRAM = "print(sum(range(1000)))\n"


def module_at(ref: str) -> ModuleType:
    """beam_rl/envs/sandbox.py as committed at `ref`, imported under a name of its own."""
    source = subprocess.run(
        ["git", "show", f"{ref}:beam_rl/envs/sandbox.py"], capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp(prefix="sandbox-baseline-")) / "sandbox_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("sandbox_baseline", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


async def start_cost(module: ModuleType) -> float:
    started = time.perf_counter()
    result = await module.run_python(PROGRAM)
    elapsed = time.perf_counter() - started
    if not (result.exit_code == 0 and result.stdout == "499500\n"):
        raise RuntimeError(f"the short program failed: {result}")
    return elapsed


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": round(statistics.median(ordered) * 1e3, 1),
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1e3, 1),
        "min_ms": round(ordered[0] * 1e3, 1),
    }


async def main(runs: int, baseline: str | None) -> dict[str, Any]:
    variants = {"this checkout": sandbox}
    if baseline:
        variants[f"baseline ({baseline})"] = module_at(baseline)
    for module in variants.values():  # the first run of each pays its one-time checks
        await start_cost(module)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(runs):
        for name, module in variants.items():
            samples[name].append(await start_cost(module))
    return {
        "machine": {"cpus": len(sandbox.os.sched_getaffinity(0)), "platform": platform.platform()},
        "program": PROGRAM,
        "runs": runs,
        "mechanism": sandbox.total_caps_mechanism(),
        "results": {name: summary(values) for name, values in samples.items()},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--baseline", default="main", help="a git ref; '' runs this checkout alone")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = asyncio.run(main(args.runs, args.baseline or None))
    for name, numbers in report["results"].items():
        print(f"{name:>20}: " + ", ".join(f"{key} {value}" for key, value in numbers.items()))
    print(f"total caps: {report['mechanism']}")
    if args.out:
        write_results(args.out, report)
