"""The code environment's reward stage on this machine: rollouts/s and p50/p99 latency with N rewards in
flight, over completions drawn from the bundled tasks' reference solutions and broken variants of them,
once with a few programs that loop forever (each costs its tests' timeouts) and once without.

    .venv/bin/python -m bench.rewards.code_rewards --concurrency 1,4,16 --rollouts 64 \
        --out bench/rewards/code_rewards.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import resource
import time
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from beam_rl.envs import make_env
from beam_rl.envs.base import Trajectory
from beam_rl.envs.code import Code, extract_program
from beam_rl.model.tokenizer import load_tokenizer
from beam_rl.types import Turn
from bench.common.results import write_results

# Completion kinds and their share of the rollouts: what a policy early in training writes.
KINDS = {"reference": 0.5, "wrong": 0.2, "exception": 0.1, "syntax_error": 0.15, "loop": 0.05}
MIXES = {"with_loops": KINDS, "without_loops": {k: v for k, v in KINDS.items() if k != "loop"}}


def program(row: dict[str, Any], kind: str) -> str:
    body = {
        "wrong": "    return None\n",
        "exception": "    raise ValueError('not written yet')\n",
        "loop": "    while True:\n        pass\n",
    }
    if kind == "reference":
        return row["reference"]
    if kind == "syntax_error":
        return row["reference"].replace(":\n", "\n", 1)  # the def line loses its colon
    return row["prompt"] + body[kind]


Rollouts = list[tuple[str, dict[str, Any], Trajectory]]  # (kind, row, trajectory)


def completions(env: Code, n: int, seed: int, shares: dict[str, float]) -> Rollouts:
    rng = random.Random(seed)
    rows = env.load_rows("train") + env.load_rows("eval")
    out = []
    for _ in range(n):
        kind = rng.choices(list(shares), weights=list(shares.values()))[0]
        row = rng.choice(rows)
        ids = env.tokenizer.encode(f"```python\n{program(row, kind)}```", add_special_tokens=False)
        ids.append(env.tokenizer.eos_token_id)
        out.append((kind, row, Trajectory([Turn(ids, [0.0] * len(ids), "stop")])))
    return out


async def measure(env: Code, rollouts: Rollouts, concurrency: int) -> dict[str, Any]:
    permits = asyncio.Semaphore(concurrency)

    async def one(row: dict[str, Any], trajectory: Trajectory) -> tuple[float, float, float]:
        async with permits:
            started = time.perf_counter()
            # What Code.reward does, keeping the report for the sandbox's CPU time.
            report = await env.run_tests(row, extract_program(env.final_text(trajectory)))
            return time.perf_counter() - started, report.score, report.sandbox.cpu_s or 0.0

    cpu_before = _cpu_s()
    started = time.perf_counter()
    results = await asyncio.gather(*(one(row, trajectory) for _, row, trajectory in rollouts))
    wall_s = time.perf_counter() - started
    cpu_s = _cpu_s() - cpu_before
    by_kind = {}
    present = {kind for kind, _, _ in rollouts}
    for kind in [k for k in KINDS if k in present]:
        picked = np.array([r for (k, _, _), r in zip(rollouts, results, strict=True) if k == kind])
        if len(picked):
            by_kind[kind] = {
                "rollouts": len(picked),
                "p50_s": round(float(np.percentile(picked[:, 0], 50)), 3),
                "mean_reward": round(float(picked[:, 1].mean()), 3),
                "sandbox_cpu_ms": round(1000 * float(picked[:, 2].mean()), 1),
            }
    latency = np.array([r[0] for r in results])
    return {
        "concurrency": concurrency,
        "rollouts": len(rollouts),
        "wall_s": round(wall_s, 2),
        "rollouts_per_s": round(len(rollouts) / wall_s, 2),
        "p50_s": round(float(np.percentile(latency, 50)), 3),
        "p99_s": round(float(np.percentile(latency, 99)), 3),
        "cpu_ms_per_rollout": round(1000 * cpu_s / len(rollouts), 1),
        "by_kind": by_kind,
    }


def _cpu_s() -> float:
    """CPU seconds of this process and of every sandbox it has reaped (bwrap and all inside it)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def print_tables(levels: list[dict[str, Any]], title: str) -> None:
    console = Console()
    overall = Table("in flight", "rollouts/s", "p50 s", "p99 s", "CPU ms/rollout", title=title)
    for lv in levels:
        figures = ("concurrency", "rollouts_per_s", "p50_s", "p99_s", "cpu_ms_per_rollout")
        overall.add_row(*(str(lv[k]) for k in figures))
    console.print(overall)
    in_flight = (f"p50 s, {lv['concurrency']} in flight" for lv in levels)
    kinds = Table("kind", "rollouts", "mean reward", "sandbox CPU ms", *in_flight)
    for kind, first in levels[0]["by_kind"].items():
        p50s = [str(lv["by_kind"][kind]["p50_s"]) for lv in levels]
        kinds.add_row(kind, *(str(first[k]) for k in ("rollouts", "mean_reward", "sandbox_cpu_ms")), *p50s)
    console.print(kinds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,4,16", help="rewards in flight, comma-separated levels")
    parser.add_argument("--rollouts", type=int, default=64, help="rollouts scored at each level")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/rewards/code_rewards.json")
    args = parser.parse_args()
    env = make_env("code", load_tokenizer("tiny"))
    asyncio.run(measure(env, completions(env, 2, args.seed, KINDS), 1))  # warm-up: the network check, page cache
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "limits": vars(env.limits) | {"test_timeout_s": env.test_timeout_s},
    }
    for mix, shares in MIXES.items():
        rollouts = completions(env, args.rollouts, args.seed, shares)
        levels = [asyncio.run(measure(env, rollouts, int(n))) for n in args.concurrency.split(",")]
        report[mix] = {"kinds": shares, "levels": levels}
        print_tables(levels, f"code rewards {mix.replace('_', ' ')}: {args.rollouts} rollouts per level")
    write_results(args.out, report)

if __name__ == "__main__":
    main()
