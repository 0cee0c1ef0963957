"""What reading a step back costs: `beam-rl replay --step N` and `beam-rl inspect --step N --samples K` on one
committed step, in this process (warm: imports done, the tokenizer loaded) and as the commands (a fresh
interpreter each, imports included).

    .venv/bin/python -m bench.cost.replay_cost RUN_DIR --step N [--repeat 5] [--out bench/cost/replay_cost.json]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from rich.console import Console

from beam_rl import wiring
from beam_rl.model.location import tokenizer_for
from beam_rl.observe.replay import replay_steps, run_config
from beam_rl.observe.rollout_text import TokenText, rollout_panel, step_sample_rows, window_rows
from beam_rl.rundir import RunDir


def timed(fn: Callable[[], Any], repeat: int) -> dict[str, float]:
    """Median wall and CPU milliseconds of `repeat` calls."""
    walls, cpus = [], []
    for _ in range(repeat):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return {"wall_ms": round(1000 * statistics.median(walls), 2), "cpu_ms": round(1000 * statistics.median(cpus), 2)}


def command(argv: list[str], repeat: int) -> dict[str, float]:
    """Median wall milliseconds of the command in a fresh interpreter (what a user waits for)."""
    walls = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "beam_rl.cli", *argv], check=False, capture_output=True)
        walls.append(time.perf_counter() - t0)
    return {"wall_ms": round(1000 * statistics.median(walls), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--step", type=int, required=True)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    run, step = RunDir(args.run_dir), args.step
    window = run.read_window(step)
    config = run_config(run)
    text = TokenText(tokenizer_for(config.model.name))
    [replayed] = replay_steps(run, [step], wiring.replay_parts(run))  # warms the components (model config, filters) once

    def replay() -> None:
        list(replay_steps(run, [step], wiring.replay_parts(run)))

    def inspect_all() -> None:
        console = Console(file=io.StringIO(), width=120, force_terminal=True)
        for row in window_rows(run.read_window(step)):
            console.print(rollout_panel(row, text))

    results = {
        "run_dir": str(run.path), "step": step, "window_rollouts": window.num_rows,
        "trained_samples": run.read_commit(step).counts.samples, "replay_identical": replayed.identical,
        "replay_first_difference": str(replayed.differences[0]) if replayed.differences else None,
        "in_process": {
            "replay_step": timed(replay, args.repeat),
            "read_window": timed(lambda: run.read_window(step), args.repeat),
            f"inspect_render_all_{window.num_rows}": timed(inspect_all, args.repeat),
            "wandb_sample_rows_8": timed(lambda: step_sample_rows(run, step, text.tokenizer, 8), args.repeat),
        },
        "commands": {
            f"replay --step {step}": command(["replay", str(run.path), "--step", str(step)], args.repeat),
            f"inspect --step {step} --samples {window.num_rows}": command(
                ["inspect", str(run.path), "--step", str(step), "--samples", str(window.num_rows)], args.repeat),
            "replay --all": command(["replay", str(run.path), "--all"], 1),
        },
        "committed_steps": len(run.committed_steps()),
    }
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
