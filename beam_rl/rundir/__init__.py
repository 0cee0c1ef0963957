"""The run directory, the durable contract between orchestrator and trainer: committed steps, weights,
metrics. `RunDir` is the one entry point; each module beside it holds one concern."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from beam_rl.rundir.atomic import TMP_MARK, atomic_write, json_bytes, write_atomic
from beam_rl.rundir.dataset import committed_dataset
from beam_rl.rundir.errors import (
    MetricsError,
    RunDirError,
    StepAlreadyCommittedError,
    StepCorruptError,
    StepNotCommittedError,
)
from beam_rl.rundir.layout import COMMIT_FILE, STABLE_FILE, RunLayout
from beam_rl.rundir.metrics import MetricsStore, MetricsTail
from beam_rl.rundir.steps import StepStore, open_arrow_file
from beam_rl.rundir.weights import WeightStore
from schemas.commit_record import WINDOW_FILE, CommitRecord, CommitRecordError, Offset, rank_file_name

if TYPE_CHECKING:
    import pyarrow.dataset as ds


class RunDir(StepStore, WeightStore, MetricsStore):
    """One run directory (layout: `RunLayout`): committed steps (`StepStore`), published weights
    (`WeightStore`), metrics and status (`MetricsStore`), and the run config."""

    def check_writable(self) -> None:
        """Fail before any work starts if the run directory cannot be created or written."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".write-probe{TMP_MARK}{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise RunDirError(f"run directory {self.path} is not writable: {err}") from err

    def write_config(self, config: dict[str, Any]) -> Path:
        self.path.mkdir(parents=True, exist_ok=True)
        data = json_bytes(config, indent=2)
        atomic_write(self.config_path, lambda f: f.write(data))
        return self.config_path

    def read_config(self) -> dict[str, Any]:
        """The run's config as written; RunDirError naming the file when it is not a JSON object."""
        try:
            config = json.loads(self.config_path.read_bytes())
        except OSError as err:
            raise RunDirError(f"{self.config_path}: unreadable ({err.strerror or err})") from None
        except ValueError as err:  # not UTF-8 or not JSON: damaged, or not a beam-rl run directory's
            raise RunDirError(f"{self.config_path}: not a beam-rl run config ({err})") from None
        if not isinstance(config, dict):
            raise RunDirError(
                f"{self.config_path}: not a beam-rl run config (a JSON {type(config).__name__}, not an object)"
            )
        return config

    def dataset(self, kind: str = "window", *, verify: bool = True) -> ds.FileSystemDataset:
        """The committed steps' window.arrow files ("window") or rank files ("samples") as one pyarrow
        dataset with a `step` column: what polars, duckdb and Hugging Face datasets read
        (beam_rl/rundir/dataset.py, docs/trainer-api.md)."""
        return committed_dataset(self, kind, verify=verify)


__all__ = [
    "COMMIT_FILE",
    "STABLE_FILE",
    "WINDOW_FILE",
    "CommitRecord",
    "CommitRecordError",
    "MetricsError",
    "MetricsTail",
    "Offset",
    "RunDir",
    "RunDirError",
    "RunLayout",
    "StepAlreadyCommittedError",
    "StepCorruptError",
    "StepNotCommittedError",
    "open_arrow_file",
    "rank_file_name",
    "write_atomic",
]
