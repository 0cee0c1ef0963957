"""WriteTrainBatches: each step's files written in parallel, then its commit record, never twice; and the
end of the run's input once its last step is committed.

The packer's single key only cuts: each step leaves it as parts (beam_rl/rundir/step_parts.py). Each
rank's file and the window file are written by `WriteStepFiles`, keyed by (step, part), so that steps
and ranks are written side by side on as many workers as the runner has; `CommitSteps`, on one key, writes
a step's commit record once its plan and all its files have come, in step order. Exactly once:

- a file's bytes depend on its step only (the window's commit stamp aside, written once per attempt), and
  each is written atomically, so a retried or duplicated write puts the same file in place;
- a file is written only while its step is uncommitted, and a commit record only once every file it
  names has been written and made durable (one directory fsync), so a reader never sees a step half-written;
- a replayed step that is committed already must hold the same groups: it is counted and skipped.
"""

from __future__ import annotations

import time
from typing import Any

import apache_beam as beam
from apache_beam.coders import PickleCoder
from apache_beam.transforms import userstate
from apache_beam.transforms.util import ReshufflePerKey

from beam_rl.packing.batches import InputExhausted
from beam_rl.packing.goodput import goodput
from beam_rl.rundir import RunDir, RunDirError
from beam_rl.rundir.failures import record_failure
from beam_rl.rundir.step_parts import (
    WINDOW_PART,
    CommitQueue,
    FileToWrite,
    RankFile,
    StepPart,
    StepPlan,
    WindowFile,
    files_to_write,
)
from beam_rl.types import TrainBatch
from transforms.coders import CommitItem

_COMMIT_KEY = "commit"


_PLAN_PART, _END_PART = -2, -3  # beside the files' parts (ranks, WINDOW_PART), passed on to the committer


def _split(item: TrainBatch | InputExhausted):
    """A step as the parts the writers take, keyed (step, part): its files, and its plan, passed on to the
    committer with them, so that one output and no Flatten leaves the packer's key. Cheap: it runs on the key."""
    if isinstance(item, InputExhausted):
        yield (item.last_step, _END_PART), item
    else:
        yield (item.step, _PLAN_PART), _plan(item)
        for files in files_to_write(item):
            yield (files.step, files.part), files


def _plan(batch: TrainBatch) -> StepPlan:
    last_finished = max((r.t_finished for r in batch.rollouts), default=0.0)
    workers = {
        "dispatch": sorted({r.dispatch_worker for r in batch.rollouts if r.dispatch_worker}),
        "score": sorted({r.score_worker for r in batch.rollouts if r.score_worker}),
    }
    return StepPlan.of(
        batch,
        offsets={r.prompt_offset for r in batch.rollouts},
        extra={"last_rollout_finished_at": last_finished, "workers": workers},
    )


class _WriteFileFn(beam.DoFn):
    """Writes one file of an uncommitted step; a step committed already has all its files."""

    def __init__(self, run_dir: str) -> None:
        self._run_dir = run_dir

    def setup(self) -> None:
        self._dir = RunDir(self._run_dir)

    def process(self, keyed: tuple[tuple[int, int], Any]):
        _, value = keyed
        if not isinstance(value, FileToWrite):
            yield _COMMIT_KEY, value  # a plan or the end of input, for the committer
        elif not self._dir.is_committed(value.step):
            yield _COMMIT_KEY, self._write(value)

    def _write(self, files: FileToWrite) -> StepPart:
        try:
            if files.part == WINDOW_PART:
                return self._dir.write_window(files.step, files.window)
            return self._dir.write_rank(files.step, files.part, files.micro_batches)
        except RunDirError as err:  # a full disk: the CLI names it from the record, not Beam's text
            record_failure(self._run_dir, "write", err)
            raise


class _CommitFn(beam.DoFn):
    """One key: holds the parts of uncommitted steps and commits each step, in order, once they are all in."""

    PARTS = userstate.BagStateSpec("parts", PickleCoder())  # StepPlan | RankFile | WindowFile | InputExhausted

    def __init__(self, run_dir: str) -> None:
        self._run_dir = run_dir

    def setup(self) -> None:
        self._dir = RunDir(self._run_dir)

    def process(self, keyed: tuple[str, Any], parts=beam.DoFn.StateParam(PARTS)):
        _, part = keyed
        if not isinstance(part, InputExhausted) and self._dir.is_committed(part.step):
            self._replayed(part)
        else:
            yield from self._add(part, parts)

    def _add(self, part: StepPart | InputExhausted, parts):
        held = list(parts.read())
        # A state restored from a checkpoint older than the run directory holds parts of steps committed since.
        behind = [p for p in held if not isinstance(p, InputExhausted) and self._dir.is_committed(p.step)]
        for old in behind:
            self._replayed(old)
        queue = CommitQueue(
            (p for p in held if not isinstance(p, InputExhausted) and not any(p is b for b in behind)),
            self._dir.is_committed,
        )
        ends = [p for p in [*held, part] if isinstance(p, InputExhausted)]
        if not isinstance(part, InputExhausted):
            queue.add(part)
        ready = queue.ready()
        for step in ready:
            self._commit(step.plan, step.ranks, step.window)
            yield step.plan.step
        queue.forget(step.plan.step for step in ready)
        still_open = [end for end in ends if not self._exhausted(end, queue)]
        if ready or behind or len(still_open) < len(ends):  # the stored parts changed, not only grew by this one
            parts.clear()
            for kept in [*queue.parts(), *still_open]:
                parts.add(kept)
        else:
            parts.add(part)

    def _replayed(self, part: StepPart) -> None:
        """A part of a step committed already: a duplicated file write, or a replayed bundle's step, which
        must hold the same groups (a runner retrying a bundle replays the packer deterministically from its
        state at the bundle's start)."""
        if not isinstance(part, StepPlan):
            return
        committed = self._dir.read_commit(part.step).group_ids
        if committed != part.group_ids:
            raise RuntimeError(
                f"step {part.step} is committed with other groups than this replay "
                f"produced: committed {committed}, replay {part.group_ids}"
            )
        beam.metrics.Metrics.counter("beam_rl", "steps_replayed").inc()

    def _exhausted(self, end: InputExhausted, queue: CommitQueue) -> bool:
        """Record the end of the input once no step up to its last is waiting (the packer emits the marker
        after its last step's plan; steps past `run.max_steps` were never emitted)."""
        if any(plan.step <= end.last_step for plan in queue.plans()):
            return False
        self._dir.mark_input_exhausted(end.last_step)
        return True

    def _commit(self, plan: StepPlan, ranks: list[RankFile], window: WindowFile) -> None:
        try:
            self._dir.commit_step(plan, ranks, window)
        except RunDirError as err:  # a full disk: the CLI names it from the record, not Beam's text
            record_failure(self._run_dir, "write", err)
            raise
        stats = plan.window.model_dump(mode="json", exclude_unset=True)  # the stats as the packer computed them
        self._dir.append_metrics(
            {
                "step": plan.step,
                "committed_at": time.time(),
                **stats,
                "goodput": goodput(stats.get("tokens_by_fate") or {}),
            }
        )
        beam.metrics.Metrics.counter("beam_rl", "steps_committed").inc()


class WriteTrainBatches(beam.PTransform):
    def __init__(self, run_dir: str) -> None:
        super().__init__()
        self._run_dir = run_dir

    def expand(self, batches):
        return (
            batches
            | "SplitSteps" >> beam.FlatMap(_split).with_output_types(tuple[tuple[int, int], CommitItem])
            # Keyed by (step, part), so each file is written apart from the packer's key and beside the others.
            | "ByStepFile" >> ReshufflePerKey()
            | "WriteStepFiles" >> beam.ParDo(_WriteFileFn(self._run_dir)).with_output_types(tuple[str, CommitItem])
            | "CommitSteps" >> beam.ParDo(_CommitFn(self._run_dir)).with_output_types(int)
        )
