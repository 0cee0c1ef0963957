"""The packer's Beam state per step and the cost of writing window.arrow, for steps of 64 rollouts of 256
tokens (32 prompt + 224 completion), fed one scored group of 8 per element as the runner does.

    python -m bench.scale.pack_state [--steps 8] [--filtered-groups 2] [--repeat 15]

State is measured as a runner stores it (pickled): the largest value + bag held at a step's end, and the
bytes written per step. The write cost of window.arrow is measured twice, next to the step's rank files
done the same way: building the table alone (CPU), and building it plus an fsynced write; medians of
interleaved rounds, and their ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from beam_rl.config import config_from_dict
from beam_rl.rundir.arrow import rollouts_to_table, samples_to_table
from beam_rl.scoring.advantages import get_algorithm
from beam_rl.scoring.filters import ZeroAdvantageFilter
from beam_rl.scoring.group import score_group
from beam_rl.types import Rollout, Turn
from transforms.pack import _PackFn

GROUP_SIZE, ROLLOUTS_PER_STEP, PROMPT, COMPLETION = 8, 64, 32, 224


class StoredValue:
    """A ReadModifyWrite state that stores bytes, as a runner does."""

    def __init__(self) -> None:
        self.raw: bytes | None = None
        self.written = 0

    def read(self):
        return None if self.raw is None else pickle.loads(self.raw)

    def write(self, value) -> None:
        self.raw = pickle.dumps(value)
        self.written += len(self.raw)


class StoredBag:
    """A bag state that stores each element pickled, as a runner does."""

    def __init__(self) -> None:
        self.items: list[bytes] = []
        self.written = 0

    def read(self):
        return [pickle.loads(item) for item in self.items]

    def add(self, value) -> None:
        self.items.append(pickle.dumps(value))
        self.written += len(self.items[-1])

    def clear(self) -> None:
        self.items = []


def _write(path: Path, table) -> int:
    """An Arrow IPC file, fsynced, as the writer writes a step's files; returns its size."""
    with open(path, "wb") as f:
        with pa.ipc.new_file(f, table.schema) as writer:
            writer.write_table(table)
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


def scored_group(index: int, rng: np.random.Generator, flat: bool):
    rewards = np.ones(GROUP_SIZE) if flat else rng.random(GROUP_SIZE)
    prompt = rng.integers(0, 150_000, PROMPT).tolist()
    rollouts = [Rollout(f"e0-i{index}", "reverse_text", a, GROUP_SIZE, prompt_ids=prompt, index=index,
                        turns=[Turn(rng.integers(0, 150_000, COMPLETION).tolist(),
                                    (-rng.random(COMPLETION)).tolist(), "stop")],
                        reward=float(rewards[a]))
                for a in range(GROUP_SIZE)]
    return score_group(rollouts, get_algorithm("grpo"), [ZeroAdvantageFilter(mode="enforce")], temperature=1.0)


def measure(steps: int, filtered_groups: int, repeat: int) -> dict:
    rng = np.random.default_rng(0)
    per_step = ROLLOUTS_PER_STEP // GROUP_SIZE + filtered_groups
    groups = [scored_group(i, rng, flat=i % per_step < filtered_groups) for i in range(steps * per_step)]
    with tempfile.TemporaryDirectory(prefix="bench-pack-state-") as run_dir:
        fn = _PackFn(config_from_dict({
            "run": {"dir": run_dir, "max_steps": 10**6},
            "envs": [{"name": "reverse_text", "group_size": GROUP_SIZE}],
            "batch": {"rollouts_per_step": ROLLOUTS_PER_STEP},
        }), 1, check_staleness=False, run_dir=run_dir)
        fn.setup()
        state, pending, batches = StoredValue(), StoredBag(), []
        held, written, last_written = [], [], 0
        for group in groups:
            out = list(fn.process(("packer", [group]), state=state, pending=pending))
            now = len(state.raw) + sum(map(len, pending.items))
            held.append(now)
            if out:
                batches += out
                total = state.written + pending.written
                written.append(total - last_written)
                last_written = total
        batch = batches[0]
        window_s, rank_s, window_build_s, rank_build_s = [], [], [], []
        for i in range(repeat):  # interleaved: the machine's noise hits both alike
            t0 = time.perf_counter()
            rollouts_to_table(batch.rollouts)
            t1 = time.perf_counter()
            [samples_to_table(rank) for rank in batch.micro_batches]
            t2 = time.perf_counter()
            window_build_s.append(t1 - t0)
            rank_build_s.append(t2 - t1)
            t0 = time.perf_counter()
            window_bytes = _write(Path(run_dir) / f"window-{i}.arrow", rollouts_to_table(batch.rollouts))
            t1 = time.perf_counter()
            rank_bytes = sum(_write(Path(run_dir) / f"rank-{i}-{r}.arrow", samples_to_table(rank))
                             for r, rank in enumerate(batch.micro_batches))
            t2 = time.perf_counter()
            window_s.append(t1 - t0)
            rank_s.append(t2 - t1)
    window_ms, rank_ms = statistics.median(window_s) * 1e3, statistics.median(rank_s) * 1e3
    window_build_ms, rank_build_ms = statistics.median(window_build_s) * 1e3, statistics.median(rank_build_s) * 1e3
    return {
        "steps": len(batches),
        "window_rollouts_per_step": len(batch.rollouts),
        "state_held_bytes_max": max(held),
        "state_written_bytes_per_step": int(statistics.median(written)),
        "window_file_bytes": window_bytes,
        "rank_files_bytes": rank_bytes,
        "window_table_ms": round(window_build_ms, 3),
        "rank_tables_ms": round(rank_build_ms, 3),
        "window_vs_rank_tables": round(window_build_ms / rank_build_ms, 3),
        "window_write_ms": round(window_ms, 3),
        "rank_files_write_ms": round(rank_ms, 3),
        "window_vs_rank_files": round(window_ms / rank_ms, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--filtered-groups", type=int, default=0, help="zero-advantage groups per step")
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    print(json.dumps(measure(args.steps, args.filtered_groups, args.repeat), indent=2))


if __name__ == "__main__":
    main()
