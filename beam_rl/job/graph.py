"""The rollout pipeline, the same graph on Prism and on Flink:

RunSpec -> DispatchRollouts -> CompleteGroups -> ScoreGroups -> PackBatches -> WriteTrainBatches
                                                        \\-> EvaluateRounds (held-out rounds)

Starting the job it makes and following it is beam_rl/job/rollouts.py.
"""

from __future__ import annotations

import uuid

import apache_beam as beam
from apache_beam.pvalue import PCollection

from beam_rl.rundir import RunDir
from beam_rl.source import SourceSpec
from beam_rl.wiring import JobParts
from transforms.dispatch import DispatchRollouts
from transforms.evaluate import EvaluateRounds
from transforms.groups import CompleteGroups
from transforms.pack import PackBatches
from transforms.score import EVALUATION, ScoreGroups
from transforms.write import WriteTrainBatches


def build_rollout_pipeline(pipeline: beam.Pipeline, spec: SourceSpec) -> PCollection[int]:
    """Adds the rollout graph to `pipeline`; returns the PCollection of committed step numbers."""
    # Each shard's end of input travels with the rollouts, through CompleteGroups and Score, to the packer.
    scored = (
        pipeline
        | "Dispatch" >> DispatchRollouts(spec)
        | "CompleteGroups" >> CompleteGroups()
        | "Score" >> ScoreGroups(spec.config, spec.run_dir)
    )
    if spec.config.eval.every_steps:
        scored[EVALUATION] | "Evaluate" >> EvaluateRounds(spec.config, spec.run_dir)
    return (
        scored.scored
        | "PackBatches" >> PackBatches(spec.config, spec.first_step, spec.with_trainer, spec.run_dir)
        | "WriteTrainBatches" >> WriteTrainBatches(spec.run_dir)
    )


def source_spec(parts: JobParts, server_urls: list[str], directory: RunDir, with_trainer: bool) -> SourceSpec:
    schedule = parts.schedule
    return SourceSpec(
        config=parts.config,
        server_urls=tuple(server_urls),
        run_dir=str(directory.path),
        run_id=uuid.uuid4().hex,
        first_step=directory.next_step(),
        with_trainer=with_trainer,
        schedule_groups=len(schedule),
        schedule_streams=schedule.stream_lengths,
    )
