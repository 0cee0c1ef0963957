"""Score: rewards from each rollout's environment, then drop errored rollouts, compute advantages, stamp
temperatures and run the pre-batch filters. Evaluation groups are only rewarded, and leave on their own
output for EvaluateRounds."""

from __future__ import annotations

import time
from typing import List

import apache_beam as beam

from beam_rl import components
from beam_rl.config import RunConfig
from beam_rl.processes import worker_id
from beam_rl.rewards import assign_rewards
from beam_rl.sink import ScoredGroup, score_group
from beam_rl.types import RolloutRecord
from transforms import coders  # noqa: F401  (registers the coder of ScoredGroup)

EVALUATION = "evaluation"


class _ScoreFn(beam.DoFn):
    def __init__(self, config: RunConfig) -> None:
        self._config = config

    def setup(self) -> None:
        self._envs = components.build_envs(self._config)
        self._algorithms = components.algorithms(self._config)
        self._filters = components.pre_batch_filters(self._config)
        self._temperature = self._config.inference.temperature
        self._worker = worker_id()

    def process(self, keyed_group):
        _, rollouts = keyed_group
        assign_rewards(rollouts, self._envs[rollouts[0].env_name])
        scored_at = time.time()
        for rollout in rollouts:
            rollout.score_worker, rollout.t_scored = self._worker, scored_at
        if rollouts[0].is_eval:
            yield beam.pvalue.TaggedOutput(EVALUATION, (rollouts[0].eval_round, [r.record() for r in rollouts]))
            return
        scored = score_group(rollouts, self._algorithms[rollouts[0].env_name], self._filters, self._temperature)
        for reason, count in scored.counts.enforced.items():
            beam.metrics.Metrics.counter("beam_rl", f"filtered_{reason}").inc(count)
        yield scored


class ScoreGroups(beam.PTransform):
    """Complete groups -> ScoredGroup (main output) and (eval round, rollout records) on EVALUATION."""

    def __init__(self, config: RunConfig) -> None:
        super().__init__()
        self._config = config

    def expand(self, groups):
        return (groups
                | beam.ParDo(_ScoreFn(self._config)).with_output_types(ScoredGroup)
                .with_outputs(EVALUATION, main="scored"))


EvalGroup = List[RolloutRecord]
