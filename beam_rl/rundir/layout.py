"""Where everything lives in a run directory: the paths of steps, their files, weights and run files."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

from schemas.commit_record import WINDOW_FILE, rank_file_name

COMMIT_FILE = "COMMIT.json"
STABLE_FILE = "STABLE"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step_{step}"


def step_dirs(parent: Path) -> Iterator[tuple[int, Path]]:
    """(step, path) of every step_<N> directory under `parent`, in no particular order."""
    if not parent.is_dir():
        return
    for path in parent.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir():
            yield int(match.group(1)), path


class RunLayout:
    """The paths of one run directory. Steps count from 1: step s trains policy s-1 into policy s.

    config.json                       the run config (RunConfig.model_dump(mode="json"))
    status-<K>.json                   dispatch shard K's live state, replaced as it changes
    INPUT_EXHAUSTED.json              every group of the input is in a committed step: the run is over
    metrics.jsonl                     one JSON object per line
    servers                           the fleet, one base URL per line (inference.discovery = "file")
    fleet.json                        the servers each dispatch shard drives now (beam_rl/fleet/assignment.py)
    rollouts/step_<N>/rank_<R>.arrow  packed micro-batches of rank R (Arrow IPC file, TRAIN_BATCH_SCHEMA)
    rollouts/step_<N>/window.arrow    every rollout seen since the previous step (ROLLOUT_RECORD_SCHEMA)
    rollouts/step_<N>/COMMIT.json     written last (schemas/commit_record.py): the step exists once it does
    weights/step_<N>/ + STABLE        published by the trainer; STABLE written last
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.rollouts_dir = self.path / "rollouts"
        self.weights_dir = self.path / "weights"
        self.metrics_path = self.path / "metrics.jsonl"
        self.config_path = self.path / "config.json"
        self.input_exhausted_path = self.path / "INPUT_EXHAUSTED.json"
        self.servers_path = self.path / "servers"
        self.fleet_path = self.path / "fleet.json"

    def status_path(self, shard: int = 0) -> Path:
        return self.path / f"status-{shard}.json"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"

    def step_dir(self, step: int) -> Path:
        return self.rollouts_dir / step_dir_name(step)

    def rank_path(self, step: int, rank: int) -> Path:
        return self.step_dir(step) / rank_file_name(rank)

    def window_path(self, step: int) -> Path:
        return self.step_dir(step) / WINDOW_FILE

    def commit_path(self, step: int) -> Path:
        return self.step_dir(step) / COMMIT_FILE

    def weights_path(self, step: int) -> Path:
        return self.weights_dir / step_dir_name(step)
