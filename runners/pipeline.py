"""Assembles the rollout pipeline; the same graph runs on Prism and on Flink.

RunSpec -> DispatchRollouts -> CompleteGroups -> ScoreGroups -> PackBatches -> WriteTrainBatches
"""

from __future__ import annotations

import logging
import math
import uuid

import apache_beam as beam

from beam_rl import components
from beam_rl.config import RunConfig
from beam_rl.rollout_source import SourceSpec, close_source
from beam_rl.rundir import RunDir
from runners.options import RunnerSettings, pipeline_options
from transforms.coders import PackerItem
from transforms.dispatch import END_OF_INPUT, DispatchRollouts
from transforms.groups import CompleteGroups
from transforms.pack import PackBatches, forget_packer
from transforms.score import ScoreGroups
from transforms.write import WriteTrainBatches

_LOG = logging.getLogger(__name__)


def build_rollout_pipeline(pipeline: beam.Pipeline, spec: SourceSpec) -> beam.PCollection[int]:
    """Adds the rollout graph to `pipeline`; returns the PCollection of committed step numbers."""
    dispatched = pipeline | "Dispatch" >> DispatchRollouts(spec)
    scored = (dispatched.rollouts
              | "CompleteGroups" >> CompleteGroups()
              | "Score" >> ScoreGroups(spec.config))
    return ((scored, dispatched[END_OF_INPUT])
            | "WithEndOfInput" >> beam.Flatten().with_output_types(PackerItem)
            | "PackBatches" >> PackBatches(spec.config, spec.run_id, spec.first_step, spec.with_trainer, spec.run_dir)
            | "WriteTrainBatches" >> WriteTrainBatches(spec.run_dir))


_SAMPLE_BYTES_PER_TOKEN = 20  # five per-token arrays (17 bytes) and their pickling


def runner_settings(config: RunConfig) -> RunnerSettings:
    r = config.runner
    heap_mb = r.flink_local_heap_mb
    if heap_mb is None:  # the packer's state holds up to ~2 steps of samples; checkpoints copy it
        step_mb = config.batch.rollouts_per_step * config.model.max_context * _SAMPLE_BYTES_PER_TOKEN / 2**20
        heap_mb = 512 + math.ceil(4 * step_mb)
    return RunnerSettings(name=r.name, flink_master=r.flink_master, parallelism=r.parallelism,
                          checkpointing_interval_ms=r.checkpointing_interval_ms, state_backend=r.state_backend,
                          state_backend_storage_path=r.state_backend_storage_path,
                          shutdown_sources_after_idle_ms=r.shutdown_sources_after_idle_ms, jvm_heap_mb=heap_mb)


class RolloutJob:
    """A submitted rollout pipeline: wait for it to finish (max_steps committed, or the data
    exhausted), or cancel it."""

    def __init__(self, spec: SourceSpec, result) -> None:
        self.spec = spec
        self.result = result

    def wait(self) -> None:
        try:
            self.result.wait_until_finish()
        finally:
            self._release()

    def cancel(self) -> None:
        try:
            self.result.cancel()
        finally:
            self._release()

    def _release(self) -> None:
        close_source(self.spec.run_id)
        forget_packer(self.spec.run_id)


def start_rollouts(config: RunConfig, server_urls: list[str], run_dir: str | None = None,
                   with_trainer: bool = True) -> RolloutJob:
    directory = RunDir(run_dir or config.run.dir)
    directory.check_writable()
    removed = directory.clean_uncommitted()  # what a killed run left half-written
    if removed:
        _LOG.warning("removed %d uncommitted leftovers of an earlier run: %s", len(removed), removed[:5])
    spec = SourceSpec(config=config, server_urls=tuple(server_urls), run_dir=str(directory.path),
                      run_id=uuid.uuid4().hex, first_step=directory.next_step(), with_trainer=with_trainer,
                      schedule_groups=len(components.build_schedule(config, components.build_envs(config))))
    pipeline = beam.Pipeline(options=pipeline_options(runner_settings(config)))
    build_rollout_pipeline(pipeline, spec)
    return RolloutJob(spec, pipeline.run())


def run_rollouts(config: RunConfig, server_urls: list[str], run_dir: str | None = None,
                 with_trainer: bool = True) -> SourceSpec:
    """Runs the rollout pipeline to completion."""
    job = start_rollouts(config, server_urls, run_dir, with_trainer)
    job.wait()
    return job.spec
