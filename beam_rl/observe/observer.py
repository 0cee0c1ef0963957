"""The run observer: follows a run directory as it grows and feeds the experiment trackers and the
Prometheus endpoint, reading only what the run gained since its last poll."""

from __future__ import annotations

import contextlib
import logging
import os
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from beam_rl.config import RunConfig
from beam_rl.observe.figures import EVAL, ROLLOUTS, TRAINER, Figures, eval_figures, step_figures, trainer_figures
from beam_rl.observe.snapshot import PACKED_TOTALS, BeamCounters, Snapshot
from beam_rl.observe.trackers import Sample, Tracker
from beam_rl.rundir import MetricsTail, RunDir

_LOG = logging.getLogger(__name__)

SampleRows = Callable[[int], Sequence[Sample]]  # a committed step -> a few of its rollouts, for W&B's table


class RunObserver:
    """Follows one run directory for the life of a run: call `poll()` every ~0.5 s and `close()` at the end.

    Each committed step (its COMMIT.json), each trainer record and each eval round in metrics.jsonl is
    logged to every enabled tracker once, on the trainer-step axis; status.json and the totals feed the
    Prometheus endpoint (`logging.prometheus_port`). A poll reads only the commit records of new steps,
    the metrics lines appended since the last poll, and status.json when its mtime changed. Memory stays
    bounded: nothing is kept per step beyond the last one's figures and the load samples since it.

    `sample_rows(step)`: a few rollouts of a committed step (dicts of strings and numbers) for W&B's
    samples table. `beam_counters()`: the runner's counters for Prometheus.
    """

    def __init__(
        self,
        run_dir: RunDir | str | os.PathLike[str],
        config: RunConfig,
        *,
        sample_rows: SampleRows | None = None,
        beam_counters: BeamCounters | None = None,
    ) -> None:
        self.run_dir = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
        self.snapshot = Snapshot()
        self._sample_rows = sample_rows
        self._metrics = MetricsTail(self.run_dir.metrics_path)
        self._next_step: int | None = None  # the step whose commit record comes next
        self._status_mtime: list[int] = []  # of the status files, at the last read
        self._dispatch: list[dict[str, Any]] = []  # load samples since the last processed commit, by time
        self.trackers = _open_trackers(self.run_dir, config)
        self.prometheus_port: int | None = None
        self._server = None
        if config.logging.prometheus_port:
            from beam_rl.observe.prometheus import serve

            host, port = config.logging.prometheus_host, config.logging.prometheus_port
            try:
                self._server, self.prometheus_port = serve(lambda: self.snapshot, beam_counters, host, port)
            except OSError as err:
                self.close()
                raise OSError(
                    f"logging.prometheus_port = {port}: cannot serve /metrics on {host}:{port}: {err}"
                ) from err

    def poll(self) -> None:
        """Read what the run directory gained; log each new step to the trackers; refresh the snapshot."""
        # Commit records first, then the metrics lines: the load samples taken before a commit seen
        # are then read too, and the trainer's record of a step follows the step's own.
        steps = self._new_steps()
        trainer, evals = [], []
        for record in self._metrics.read_new():
            if "dispatch" in record:
                self._dispatch.append(record["dispatch"])
            elif "trainer" in record:
                trainer.append(record["trainer"])
            elif "eval" in record:
                evals.append(record["eval"])
        self._dispatch.sort(key=_time)  # appended in time order but for stragglers: cheap when sorted
        snapshot, kept = self.snapshot, 0
        for step in steps:  # one record at a time: a first poll may go over days of steps
            snapshot, kept = self._on_commit(snapshot, _as_dict(self.run_dir.read_commit(step)), kept)
        del self._dispatch[:kept]
        for record in trainer:
            figures = trainer_figures(record)
            self._log(TRAINER, int(record["step"]), figures)
            snapshot = replace(snapshot, trainer_step=int(record["step"]), trainer=figures)
        for record in evals:
            figures = eval_figures(record)
            self._log(EVAL, int(record["after_step"]), figures)
            snapshot = replace(snapshot, eval_after_step=int(record["after_step"]), eval=figures)
        status = self._read_status()
        if status is not None:
            snapshot = replace(snapshot, status=status)
        if steps or trainer or evals:
            for tracker in self.trackers:
                tracker.flush()
        self.snapshot = snapshot

    def close(self) -> None:
        """Stop serving /metrics and close the trackers (a later observer of the same run continues them)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []

    def __enter__(self) -> RunObserver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- reading the run directory -------------------------------------------------------------------

    def _new_steps(self) -> range:
        """The steps committed since the last poll (all of them at the first)."""
        if self._next_step is None:
            # Listing the step directories costs O(all steps): once. Steps commit in order
            # (`RunDir.next_step`), so probing the next one then finds each new commit.
            committed = self.run_dir.committed_steps()
            self._next_step = committed[0] if committed else 1
        first = self._next_step
        while self.run_dir.is_committed(self._next_step):
            self._next_step += 1
        return range(first, self._next_step)

    def _read_status(self) -> dict[str, Any] | None:
        """The dispatch shards' status files, merged, when one changed since the last poll (each shard
        replaces its own about once a second)."""
        mtimes = []
        for path in sorted(self.run_dir.path.glob("status-*.json")):
            try:
                mtimes.append(path.stat().st_mtime_ns)
            except FileNotFoundError:
                continue
        if not mtimes or mtimes == self._status_mtime:
            return None
        self._status_mtime = mtimes
        return self.run_dir.read_status()

    # -- one committed step --------------------------------------------------------------------------

    def _on_commit(self, snapshot: Snapshot, commit: dict[str, Any], first: int) -> tuple[Snapshot, int]:
        """The snapshot after `commit`, and the first load sample the next commit can need (the ones
        before it are dropped at the end of the poll)."""
        step, at = int(commit["step"]), commit["committed_at"]
        previous = snapshot.last_committed_at
        end = bisect_right(self._dispatch, at, lo=first, key=_time)
        start = first if previous is None else bisect_right(self._dispatch, previous, lo=first, hi=end, key=_time)
        # The load samples since the previous commit; the last one before, if none (as `beam-rl report`).
        window = self._dispatch[start:end] or self._dispatch[max(end - 1, first) : end]
        figures = step_figures(commit, previous, window)
        if any(tracker.logged[ROLLOUTS] < step for tracker in self.trackers):
            self._log(ROLLOUTS, step, figures, self._samples(step))
        totals = dict(snapshot.totals)
        for (part, key), name in PACKED_TOTALS.items():
            totals[name] = totals.get(name, 0.0) + float((commit.get(part) or {}).get(key) or 0)
        tokens_by_fate = dict(snapshot.tokens_by_fate)
        for fate, tokens in ((commit.get("window") or {}).get("tokens_by_fate") or {}).items():
            tokens_by_fate[fate] = tokens_by_fate.get(fate, 0.0) + float(tokens)
        snapshot = replace(
            snapshot,
            steps_committed=step,
            last_committed_at=at,
            step=figures,
            totals=totals,
            tokens_by_fate=tokens_by_fate,
        )
        return snapshot, max(end - 1, first)  # the last sample before this commit stands in for a step without one

    def _samples(self, step: int) -> list[Sample] | None:
        if self._sample_rows is None:
            return None
        try:
            return list(self._sample_rows(step))
        except Exception:  # the step's figures matter more than its samples table
            _LOG.warning(
                "sample rollouts of step %d could not be read; logging the step without them", step, exc_info=True
            )
            return None

    def _log(self, stream: str, step: int, figures: Figures, samples: list[Sample] | None = None) -> None:
        for tracker in list(self.trackers):
            if step <= tracker.logged[stream]:  # each tracker holds what it held when the run resumed
                continue
            try:
                tracker.log(stream, step, figures, samples)
            except Exception:
                # A tracker must not stop a run of days; the run directory keeps every figure, and the
                # next process that follows the run logs what this tracker missed.
                _LOG.error(
                    "%s failed logging %s step %d; it is closed for the rest of this process",
                    tracker.name,
                    stream,
                    step,
                    exc_info=True,
                )
                self.trackers.remove(tracker)
                with contextlib.suppress(Exception):
                    tracker.close()


def _open_trackers(run_dir: RunDir, config: RunConfig) -> list[Tracker]:
    trackers: list[Tracker] = []
    if config.logging.tensorboard.enabled:
        from beam_rl.observe.tensorboard_tracker import TensorBoardTracker

        trackers.append(TensorBoardTracker(run_dir.path / "tensorboard"))
    if config.logging.wandb.mode != "disabled":
        from beam_rl.observe.wandb_tracker import WandbTracker

        trackers.append(
            WandbTracker(
                run_dir.path / "wandb",
                config.logging.wandb,
                run_name=run_dir.path.name,
                config=config.model_dump(mode="json"),
            )
        )
    return trackers


def _as_dict(commit: Any) -> dict[str, Any]:
    """A commit record as a dict, whether `read_commit` gives a dict or a pydantic model."""
    return commit if isinstance(commit, dict) else commit.model_dump(mode="json")


def _time(sample: Mapping[str, Any]) -> float:
    return sample["t"]
