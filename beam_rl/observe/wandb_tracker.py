"""Weights & Biases: one W&B run per run directory, continued by every resumed process, each step once.

The run's id lives in <run dir>/wandb/beam-rl-run-id. Every row carries "step" (the x-axis of every
chart) and "<stream>/step", which says what the run already holds when a process resumes it: in
offline mode its earlier segments' transaction logs (W&B flushes them a block at a time, so a crash
loses the last rows, and a resumed tracker logs exactly those again); online, the summary that W&B's
server hands back on resume. Offline, W&B is kept inside the run directory: its cache, config, data
and artifact staging folders are redirected there and its error reporting (which probes W&B's servers
even offline) is off, so it sends nothing.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from beam_rl.config import WandbLogging
from beam_rl.observe.figures import STREAMS, Figures
from beam_rl.observe.trackers import Sample
from beam_rl.observe.wandb_history import last_steps, run_logs
from beam_rl.rundir import write_atomic

_LOG = logging.getLogger(__name__)
RUN_ID_FILE = "beam-rl-run-id"
_MARKERS = {f"{stream}/step": stream for stream in STREAMS}


class WandbTracker:
    name = "wandb"

    def __init__(self, root: Path, settings: WandbLogging, run_name: str, config: dict[str, Any] | None = None) -> None:
        """`root`: <run dir>/wandb, where W&B writes; `run_name`: shown when settings.run_name is empty."""
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        _quiet(root, offline=settings.mode == "offline")
        import wandb  # here: a run without W&B does not pay for it

        run_id = _run_id(root)
        if settings.mode == "offline":
            self.logged = last_steps(run_logs(root, run_id), _MARKERS)  # before this segment starts its own
        _wait_for_a_new_segment_name(root, run_id)
        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity or None,
            name=settings.run_name or run_name,
            id=run_id,
            resume="allow",
            dir=root.parent,
            config=config,
            settings=wandb.Settings(
                mode=settings.mode,
                console="off",  # the live progress table owns the terminal
                silent=True,
                disable_git=True,
                save_code=False,
                disable_job_creation=True,
                x_disable_stats=True,
            ),
        )  # no system-metrics sampler process
        if settings.mode == "online":
            summary = self.run.summary
            self.logged = {stream: int(summary.get(f"{stream}/step") or 0) for stream in STREAMS}
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        if any(self.logged.values()):
            _LOG.info("W&B run %s: resuming after steps %s", run_id, self.logged)
        self._table, self._teardown = wandb.Table, wandb.teardown

    def log(self, stream: str, step: int, figures: Figures, samples: list[Sample] | None = None) -> None:
        row: dict[str, Any] = {"step": step, f"{stream}/step": step, **figures}
        if samples:
            columns = list(dict.fromkeys(column for sample in samples for column in sample))
            row[f"{stream}/samples"] = self._table(
                columns=list[str | int](columns),
                data=[[sample.get(column) for column in columns] for sample in samples],
            )
        self.run.log(row)
        self.logged[stream] = step

    def flush(self) -> None:
        """Nothing to do: W&B writes and sends rows on its own schedule."""

    def close(self) -> None:
        self.run.finish()
        # Stop W&B's service process too: it outlives the run otherwise, and a later run in this
        # process would reuse it with this run's folders.
        self._teardown()


def _run_id(root: Path) -> str:
    """The W&B run id of this run directory: made once, then read back by every resumed process."""
    path = root / RUN_ID_FILE
    if not path.exists():
        try:
            write_atomic(path, secrets.token_hex(4).encode(), overwrite=False)
        except FileExistsError:
            pass  # another process made it first: use theirs
    run_id = path.read_text().strip()
    if not run_id.isalnum():
        raise ValueError(f"{path}: not a W&B run id: {run_id!r}")
    return run_id


def _wait_for_a_new_segment_name(root: Path, run_id: str) -> None:
    """W&B names each process's folder of a run by its start time to the second, and a second
    segment started within the same second would overwrite the first's transaction log."""
    while True:
        now = time.time()
        stamp = datetime.fromtimestamp(now).strftime("%Y%m%d_%H%M%S")  # as W&B names it (local time)
        if not any((root / f"{mode}-{stamp}-{run_id}").exists() for mode in ("offline-run", "run")):
            return
        time.sleep(1.01 - now % 1)


def _quiet(root: Path, offline: bool) -> None:
    """W&B reads these from the environment (there is no setting for most of them)."""
    os.environ["WANDB_SILENT"] = "true"
    if not offline:
        return  # online W&B needs the user's own config (API key, entity): leave it alone
    os.environ["WANDB_ERROR_REPORTING"] = "false"
    for variable, folder in (
        ("WANDB_CACHE_DIR", ".cache"),
        ("WANDB_CONFIG_DIR", ".config"),
        ("WANDB_DATA_DIR", ".data"),
        ("WANDB_ARTIFACT_DIR", ".artifacts"),
    ):
        os.environ[variable] = str(root / folder)
