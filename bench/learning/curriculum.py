"""The curriculum on the tiny run: the main job's config (configs/tiny.toml, its tiny model learning
arithmetic_easy on two embedded servers with the reference trainer), three epochs of `--rows` prompts,
run without a curriculum and with one, one after the other on this machine. From each run's committed
windows: the share of generated tokens that trained (the rest were filtered, mostly zero-advantage
groups), the mean reward of the trained rollouts and the reward per trained token, and the groups the
curriculum kept back.

    .venv/bin/python -m bench.learning.curriculum --rows 40 --out bench/learning/curriculum.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from beam_rl.config import CurriculumSection, load_config
from beam_rl.rundir import RunDir
from bench.common.results import write_results

VARIANTS = {
    "none": None,
    "defaults": {},  # solved prompts retired, unsolved ones every epoch
    "unsolved_every_2": {"unsolved_every": 2},
}


def run_variant(name: str, curriculum: dict | None, rows: int, root: Path) -> dict[str, Any]:
    from beam_rl.job.run import run_job

    base = load_config("configs/tiny.toml")
    env = base.envs[0].model_copy(update={
        "epochs": 3, "limit": rows, "curriculum": None if curriculum is None else CurriculumSection(**curriculum)})
    config = base.model_copy(update={
        "run": base.run.model_copy(update={"dir": root / name, "max_steps": 1000}),
        "envs": [env], "eval": base.eval.model_copy(update={"every_steps": 0})})
    started = time.monotonic()
    run_job(config, Console(quiet=True))
    return {"seconds": round(time.monotonic() - started, 1), **window_figures(RunDir(root / name))}


def window_figures(run_dir: RunDir) -> dict[str, Any]:
    generated = trained = groups = 0
    trained_reward = 0.0
    rewards: list[float] = []
    for step in run_dir.committed_steps():
        for r in run_dir.read_window(step).to_pylist():
            if r["is_eval"]:
                continue
            generated += r["completion_tokens"] + sum(n or 0 for n in r["discarded_tokens"].values())
            groups += r["attempt"] == 0
            if r["status"] == "ok" and not r["filtered"]:
                trained += r["completion_tokens"]
                trained_reward += r["reward"]
                rewards.append(r["reward"])
    kept_back = {(m["curriculum_skip"]["epoch"], m["curriculum_skip"]["index"])
                 for m in run_dir.read_metrics() if "curriculum_skip" in m}
    return {
        "steps": len(run_dir.committed_steps()), "groups_sent": groups, "groups_kept_back": len(kept_back),
        "generated_tokens": generated, "trained_tokens": trained,
        "trained_share": round(trained / generated, 4) if generated else None,
        "mean_trained_reward": round(sum(rewards) / len(rewards), 4) if rewards else None,
        "reward_per_trained_token": round(trained_reward / trained, 5) if trained else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--out", default="bench/learning/curriculum.json")
    args = parser.parse_args()
    results: dict[str, Any] = {"rows": args.rows, "epochs": 3, "config": "configs/tiny.toml", "variants": {}}
    with tempfile.TemporaryDirectory(prefix="beam-rl-curriculum-") as root:
        for name, curriculum in VARIANTS.items():
            results["variants"][name] = {"curriculum": curriculum,
                                         **run_variant(name, curriculum, args.rows, Path(root))}
            print(name, results["variants"][name], flush=True)
    write_results(args.out, results)


if __name__ == "__main__":
    main()
