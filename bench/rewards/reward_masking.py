"""What a failing reward does to advantages, offline: the groups of a finished run (every training group
whose rollouts were all scored), with `--failure-rate` of their rewards made to fail at random, scored
three ways through beam_rl.scoring.group.score_group: no failures (the truth); failures scored as 0; failures
masked (reward_error, left out of the baseline, the group dropped below min_scored). Reports the mean
absolute advantage error against the truth, over the rollouts whose rewards were known and over the
failed ones a 0-scoring trainer trains on, averaged over `--draws` draws of failures.

    .venv/bin/python -m bench.rewards.reward_masking --run-dir runs/bench-judge-wait/judge_off \
        --out bench/rewards/reward_masking.json
"""

from __future__ import annotations

import argparse
import copy
import random
from collections import defaultdict
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from beam_rl.rundir import RunDir
from beam_rl.scoring.advantages import AdvantageAlgorithm, get_algorithm
from beam_rl.scoring.group import score_group
from beam_rl.scoring.rewards import mark_reward_error
from beam_rl.types import Rollout, Turn
from bench.common.results import write_results


def run_groups(run_dir: RunDir) -> list[list[Rollout]]:
    """Every training group of the run whose rollouts all have a reward, as rollouts with one token each
    (advantages need only the rewards)."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for step in run_dir.committed_steps():
        for row in run_dir.read_window(step).to_pylist():
            if not row["is_eval"]:
                groups[row["group_id"]].append(row)
    out = []
    for group_id, rows in groups.items():
        if all(r["status"] == "ok" for r in rows):
            out.append([Rollout(group_id, r["env"], r["attempt"], len(rows), prompt_ids=[1],
                                turns=[Turn([2], [0.0], "stop")], reward=r["reward"]) for r in rows])
    return out


def advantages(group: list[Rollout], algorithm: AdvantageAlgorithm, min_scored: int) -> dict[int, float | None]:
    """attempt -> advantage it is trained with (None: not trained)."""
    scored = score_group(group, algorithm, [], temperature=1.0, min_scored=min_scored)
    trained = {r.attempt for r in scored.clean}
    return {r.attempt: (r.advantage if r.attempt in trained else None) for r in group}


def one_draw(groups: list[list[Rollout]], algorithm: AdvantageAlgorithm, rate: float, min_scored: int,
             rng: random.Random) -> dict[str, Any]:
    known = {"zero": [], "masked": []}  # |A - A_true| over rollouts whose reward was known (and trained)
    failed_as_zero: list[float] = []  # |A - A_true| of failed rollouts that 0-scoring trains on
    flat_made_live = dropped_groups = failures = 0
    for group in groups:
        truth = advantages(copy.deepcopy(group), algorithm, 1)
        failed = {r.attempt for r in group if rng.random() < rate}
        failures += len(failed)
        zero, masked = copy.deepcopy(group), copy.deepcopy(group)
        for r in zero:
            if r.attempt in failed:
                r.reward = 0.0
        for r in masked:
            if r.attempt in failed:
                mark_reward_error(r, "injected")
        as_zero = advantages(zero, algorithm, 1)
        as_masked = advantages(masked, algorithm, min_scored)
        if len({r.reward for r in group}) == 1 and len({r.reward for r in zero}) > 1:
            flat_made_live += 1  # no signal in truth; 0-scoring invents one
        if failed and all(v is None for v in as_masked.values()):
            dropped_groups += 1
        for r in group:
            if r.attempt in failed:
                failed_as_zero.append(abs(as_zero[r.attempt] - truth[r.attempt]))
                continue
            known["zero"].append(abs(as_zero[r.attempt] - truth[r.attempt]))
            if as_masked[r.attempt] is not None:
                known["masked"].append(abs(as_masked[r.attempt] - truth[r.attempt]))
    return {
        "failures": failures,
        "known_zero": float(np.mean(known["zero"])), "known_masked": float(np.mean(known["masked"])),
        "failed_zero": float(np.mean(failed_as_zero)) if failed_as_zero else 0.0,
        "all_trained_zero": float(np.mean(known["zero"] + failed_as_zero)),
        "flat_groups_given_signal": flat_made_live, "groups_dropped_masked": dropped_groups,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", required=True, help="a finished run whose windows hold the groups")
    parser.add_argument("--failure-rate", type=float, default=0.1)
    parser.add_argument("--algorithm", default="grpo")
    parser.add_argument("--min-scored", type=int, default=2)
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/rewards/reward_masking.json")
    args = parser.parse_args()
    groups = run_groups(RunDir(args.run_dir))
    algorithm = get_algorithm(args.algorithm)
    rng = random.Random(args.seed)
    draws = [one_draw(groups, algorithm, args.failure_rate, args.min_scored, rng) for _ in range(args.draws)]
    summary = {k: {"mean": round(float(np.mean([d[k] for d in draws])), 4),
                   "std": round(float(np.std([d[k] for d in draws])), 4)} for k in draws[0]}
    flat = sum(len({r.reward for r in g}) == 1 for g in groups)
    report = {"run_dir": args.run_dir, "groups": len(groups), "rollouts": sum(map(len, groups)),
              "groups_with_equal_rewards": flat, "failure_rate": args.failure_rate, "algorithm": args.algorithm,
              "min_scored": args.min_scored, "draws": args.draws, "summary": summary}
    table = Table("mean |advantage error| (std over draws)", "failures scored 0", "failures masked",
                  title=f"{args.algorithm}, {report['groups']} groups ({report['rollouts']} rollouts) of "
                        f"{args.run_dir}, {args.failure_rate:.0%} failures, {args.draws} draws")

    def cell(key: str) -> str:
        return f"{summary[key]['mean']:.4f} ({summary[key]['std']:.4f})"

    table.add_row("rollouts whose reward was known", cell("known_zero"), cell("known_masked"))
    table.add_row("failed rollouts (trained only when scored 0)", cell("failed_zero"), "not trained")
    table.add_row("every trained rollout", cell("all_trained_zero"), cell("known_masked"))
    table.add_row("equal-reward groups given a signal", cell("flat_groups_given_signal"), "0")
    table.add_row("groups dropped (min_scored)", "0", cell("groups_dropped_masked"))
    Console().print(table)
    write_results(args.out, report)


if __name__ == "__main__":
    main()
