"""The goodput controller against a model of bench/throughput/concurrency.py's workloads, offline: many seeds in
seconds where the real benchmark takes a run of minutes per sample. `python -m bench.throughput.concurrency_model
[--seeds 60] [--probe-step 0.125] [--tolerance 0.03]`.

The model: the trained rate under a cap is the fixed caps' sweep of `bench/throughput/concurrency.json`, linear between
them; each policy step draws a factor around it (log-normal, `--noise` per step: 0.15 gives the spread of one
measurement of the runs, about 7%); the rate moves to a new cap's over a rollout's lifetime (4 s), not at
once. Rollouts of the workload's mean length finish at that rate and go to the real `GoodputController`.
Reported per workload: trained tokens over 180 s (after 5 s not counted) against the best cap of the sweep,
mean and 10th percentile over the seeds, and the same for a cap fixed at the best (the model's own ceiling:
its mean is over 1 because a log-normal factor's mean is).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from collections.abc import Callable
from pathlib import Path

import numpy as np

from beam_rl.dispatch.concurrency import ConcurrencyController, FixedConcurrency, GoodputController
from bench.throughput.concurrency import WORKLOADS, sweep

LAG_S = 4.0  # about a rollout's lifetime near the best cap, in the benchmark's real seconds


def rate_at(curve: dict[int, float], cap: float) -> float:
    """Linear between the sweep's caps, from 0 at no cap in flight; the largest cap's rate beyond it."""
    caps = sorted(curve)
    return float(np.interp(cap, [0, *caps], [0.0, *(curve[c] for c in caps)]))


def trained_share(controller: ConcurrencyController, curve: dict[int, float], workload: dict, seed: int,
                  noise: float, seconds: float = 185.0, warmup_s: float = 5.0) -> float:
    """Trained tokens/s over the counted span, over the sweep's best."""
    rng = random.Random(seed)
    tokens = min(workload["max_tokens"], workload["length_median"] * math.exp(workload["length_sigma"] ** 2 / 2))
    step_s = workload["step_s"] * workload["time_scale"]
    now, version, next_step, trained = 0.0, 0, step_s, 0.0
    level, factor = rate_at(curve, controller.cap), math.exp(rng.gauss(0, noise))
    while now < seconds:
        dt = tokens / max(level, 1.0)
        level += (rate_at(curve, controller.cap) * factor - level) * (1 - math.exp(-dt / LAG_S))
        now += dt
        if now >= next_step:
            version, next_step, factor = version + 1, next_step + step_s, math.exp(rng.gauss(0, noise))
        if now > warmup_s:
            trained += tokens
        controller.finished(round(tokens), now, version)
    return trained / (seconds - warmup_s) / max(curve.values())


def summary(make: Callable[[], ConcurrencyController], curve: dict[int, float], workload: dict, seeds: int,
            noise: float) -> tuple[float, float]:
    shares = sorted(trained_share(make(), curve, workload, seed, noise) for seed in range(seeds))
    return round(statistics.mean(shares), 3), round(shares[len(shares) // 10], 3)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=Path("bench/throughput/concurrency.json"))
    parser.add_argument("--seeds", type=int, default=60)
    parser.add_argument("--noise", type=float, default=0.15)
    parser.add_argument("--probe-step", type=float, help="GoodputController's probe_step (default: its own)")
    parser.add_argument("--tolerance", type=float, help="GoodputController's tolerance (default: its own)")
    args = parser.parse_args(argv)
    measured = json.loads(args.results.read_text())["workloads"]
    tuning = {key: value for key, value in (("probe_step", args.probe_step), ("tolerance", args.tolerance))
              if value is not None}
    out = {}
    for name, result in measured.items():
        curve, ceiling = sweep(result["results"]), result["ceiling"]
        best = max(curve, key=curve.__getitem__)
        goodput = summary(lambda: GoodputController(ceiling, **tuning),
                          curve, WORKLOADS[name], args.seeds, args.noise)
        fixed = summary(lambda: FixedConcurrency(best), curve, WORKLOADS[name], args.seeds, args.noise)
        out[name] = {"goodput_mean_p10": goodput, "fixed_best_mean_p10": fixed}
        print(f"{name}: goodput {goodput[0]} (10th percentile {goodput[1]}), fixed at {best} {fixed[0]} ({fixed[1]})")
    return out


if __name__ == "__main__":
    main()
