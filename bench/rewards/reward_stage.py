"""The code environment's rewards through the scoring stage (CompleteGroups -> ScoreGroups on Prism):
rollouts/s, p50/p99 latency of a group in the stage, and groups per bundle, with `reward.concurrency` at
each level; beside it, the sandbox alone with as many rewards in flight (bench/rewards/code_rewards.py's loop).
Every group reaches the stage at once, as when groups queue up behind slow rewards. Concurrency 1 is
what the stage did before rewards were asynchronous: one reward at a time.

    .venv/bin/python -m bench.rewards.reward_stage --concurrency 1,4,16 --groups 12 \
        --out bench/rewards/reward_stage.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import time
from typing import Any, List, Tuple

import apache_beam as beam
import numpy as np
from rich.console import Console
from rich.table import Table

from beam_rl.config import config_from_dict
from beam_rl.envs import make_env
from beam_rl.envs.base import Trajectory
from beam_rl.envs.code import Code
from beam_rl.model.tokenizer import load_tokenizer
from beam_rl.types import Rollout, Turn
from bench.rewards.code_rewards import MIXES, measure, program
from bench.common.results import write_results
from runners.options import pipeline_options
from transforms import score
from transforms.groups import CompleteGroups

GROUP_SIZE = 8
_ENTERED: dict[str, float] = {}  # group id -> when it reached ScoreGroups (LOOPBACK: this process)
_LEFT: dict[str, float] = {}
_BUNDLES: list[int] = []  # groups per bundle of the scoring stage


def groups(env: Code, n: int, seed: int, shares: dict[str, float]) -> list[list[Rollout]]:
    """`n` groups of GROUP_SIZE attempts at one task each, the attempts' kinds drawn from `shares`."""
    rng = random.Random(seed)
    rows = env.load_rows("train") + env.load_rows("eval")
    out = []
    for g in range(n):
        row = rng.choice(rows)
        group = []
        for attempt in range(GROUP_SIZE):
            kind = rng.choices(list(shares), weights=list(shares.values()))[0]
            ids = env.tokenizer.encode(f"```python\n{program(row, kind)}```", add_special_tokens=False)
            ids.append(env.tokenizer.eos_token_id)
            group.append(Rollout(f"e0-i{g}", "code", attempt, GROUP_SIZE, prompt_ids=[1], row=row, index=g,
                                 turns=[Turn(ids, [0.0] * len(ids), "stop")], info={"kind": kind}))
        out.append(group)
    return out


def _entered(keyed: Tuple[str, List[Rollout]]) -> Tuple[str, List[Rollout]]:
    _ENTERED[keyed[0]] = time.perf_counter()
    return keyed


def _left(scored: Any) -> None:
    _LEFT[scored.group_id] = time.perf_counter()


def count_bundles() -> None:
    """Record how many groups each bundle of the scoring stage held (in _BUNDLES)."""
    finish = score._ScoreFn.finish_bundle

    def counting(self):
        _BUNDLES.append(self._bundle_groups)
        yield from finish(self)

    score._ScoreFn.finish_bundle = counting


def through_stage(batch: list[list[Rollout]], concurrency: int) -> dict[str, Any]:
    config = config_from_dict({
        "envs": [{"name": "code", "group_size": GROUP_SIZE, "reward": {"concurrency": concurrency}}],
        "batch": {"rollouts_per_step": GROUP_SIZE},
    })
    _ENTERED.clear(), _LEFT.clear(), _BUNDLES.clear()
    with beam.Pipeline(options=pipeline_options("direct")) as p:
        _ = (p | beam.Impulse()
             | beam.FlatMap(lambda _: [(g[0].group_id, g) for g in batch]).with_output_types(Tuple[str, List[Rollout]])
             | CompleteGroups() | beam.Map(_entered).with_output_types(Tuple[str, List[Rollout]])
             | score.ScoreGroups(config)).scored | beam.Map(_left)
    assert len(_LEFT) == len(batch), f"{len(_LEFT)} of {len(batch)} groups left the stage"
    wall_s = max(_LEFT.values()) - min(_ENTERED.values())
    latency = np.array([_LEFT[g] - _ENTERED[g] for g in _LEFT])
    rollouts = len(batch) * GROUP_SIZE
    return {
        "concurrency": concurrency, "rollouts": rollouts, "wall_s": round(wall_s, 2),
        "rollouts_per_s": round(rollouts / wall_s, 2),
        "group_p50_s": round(float(np.percentile(latency, 50)), 3),
        "group_p99_s": round(float(np.percentile(latency, 99)), 3),
        "groups_per_bundle": list(_BUNDLES),
    }


def sandbox_alone(env: Code, batch: list[list[Rollout]], concurrency: int) -> dict[str, Any]:
    rollouts = [(r.info["kind"], r.row, Trajectory(r.turns, r.info)) for g in batch for r in g]
    result = asyncio.run(measure(env, rollouts, concurrency))
    return {k: result[k] for k in ("rollouts_per_s", "p50_s", "p99_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,4,16", help="reward.concurrency levels, comma-separated")
    parser.add_argument("--groups", type=int, default=12, help=f"groups of {GROUP_SIZE} scored at each level")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/rewards/reward_stage.json")
    args = parser.parse_args()
    env = make_env("code", load_tokenizer("tiny"))
    count_bundles()
    report: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                          "loadavg_at_start": os.getloadavg()}}
    console = Console()
    for mix, shares in MIXES.items():
        batch = groups(env, args.groups, args.seed, shares)
        through_stage(batch[:1], 1)  # warm-up: Prism, the tiny model's files, the sandbox's network check
        levels = []
        for n in (int(c) for c in args.concurrency.split(",")):
            level = through_stage(batch, n)
            level["sandbox_alone"] = sandbox_alone(env, batch, n)
            levels.append(level)
        report[mix] = {"kinds": shares, "levels": levels}
        table = Table("in flight", "rollouts/s", "group p50 s", "group p99 s", "groups/bundle",
                      "sandbox alone rollouts/s", "stage / alone",
                      title=f"code rewards through ScoreGroups, {mix.replace('_', ' ')}: "
                            f"{args.groups} groups of {GROUP_SIZE} per level")
        for lv in levels:
            alone = lv["sandbox_alone"]["rollouts_per_s"]
            table.add_row(str(lv["concurrency"]), str(lv["rollouts_per_s"]), str(lv["group_p50_s"]),
                          str(lv["group_p99_s"]), ",".join(map(str, lv["groups_per_bundle"])), str(alone),
                          f"{lv['rollouts_per_s'] / alone:.2f}")
        console.print(table)
    write_results(args.out, report)


if __name__ == "__main__":
    main()
