"""WriteTrainBatches: each step's Arrow files, then its commit record, atomically, never twice; and the
end of the run's input once the packer has cut its last batch."""

from __future__ import annotations

import time

import apache_beam as beam

from beam_rl.packing.batches import InputExhausted
from beam_rl.packing.goodput import goodput
from beam_rl.rundir import RunDir, RunDirError
from beam_rl.rundir.failures import record_failure
from beam_rl.types import TrainBatch


class _WriteStepFn(beam.DoFn):
    def __init__(self, run_dir: str) -> None:
        self._run_dir = run_dir

    def setup(self) -> None:
        self._dir = RunDir(self._run_dir)

    def process(self, item: TrainBatch | InputExhausted):
        if isinstance(item, InputExhausted):
            self._dir.mark_input_exhausted(item.last_step)
            return
        batch = item
        if self._dir.is_committed(batch.step):
            # A runner retrying a bundle replays the packer deterministically from its state at
            # the bundle's start; a step it already committed must come out identical.
            committed = self._dir.read_commit(batch.step).group_ids
            if committed != list(batch.group_ids):
                raise RuntimeError(
                    f"step {batch.step} is committed with other groups than this replay "
                    f"produced: committed {committed}, replay {list(batch.group_ids)}"
                )
            beam.metrics.Metrics.counter("beam_rl", "steps_replayed").inc()
            return
        offsets = sorted({r.prompt_offset for r in batch.rollouts})
        last_finished = max((r.t_finished for r in batch.rollouts), default=0.0)
        workers = {
            "dispatch": sorted({r.dispatch_worker for r in batch.rollouts if r.dispatch_worker}),
            "score": sorted({r.score_worker for r in batch.rollouts if r.score_worker}),
        }
        try:
            self._dir.write_step(
                batch,
                offsets=offsets,
                window=batch.rollouts,
                extra={"last_rollout_finished_at": last_finished, "workers": workers},
            )
        except RunDirError as err:  # a full disk: the CLI names it from the record, not Beam's text
            record_failure(self._run_dir, "write", err)
            raise
        self._dir.append_metrics(
            {
                "step": batch.step,
                "committed_at": time.time(),
                **batch.window,
                "goodput": goodput(batch.window.get("tokens_by_fate") or {}),
            }
        )
        beam.metrics.Metrics.counter("beam_rl", "steps_committed").inc()
        yield batch.step


class WriteTrainBatches(beam.PTransform):
    def __init__(self, run_dir: str) -> None:
        super().__init__()
        self._run_dir = run_dir

    def expand(self, batches):
        return batches | beam.ParDo(_WriteStepFn(self._run_dir)).with_output_types(int)
