"""Score: rewards from each rollout's environment, then drop errored rollouts, compute advantages,
stamp temperatures, run the pre-batch filters."""

from __future__ import annotations

import apache_beam as beam

from beam_rl import components
from beam_rl.config import RunConfig
from beam_rl.rewards import assign_rewards
from beam_rl.sink import ScoredGroup, score_group
from transforms import coders  # noqa: F401  (registers the coder of ScoredGroup)


class _ScoreFn(beam.DoFn):
    def __init__(self, config: RunConfig) -> None:
        self._config = config

    def setup(self) -> None:
        self._envs = components.build_envs(self._config)
        self._algorithms = components.algorithms(self._config)
        self._filters = components.pre_batch_filters(self._config)
        self._temperature = self._config.inference.temperature
        self._counters = {}

    def process(self, keyed_group):
        _, rollouts = keyed_group
        assign_rewards(rollouts, self._envs[rollouts[0].env_name])
        scored = score_group(rollouts, self._algorithms[rollouts[0].env_name], self._filters, self._temperature)
        for reason, count in scored.counts.enforced.items():
            beam.metrics.Metrics.counter("beam_rl", f"filtered_{reason}").inc(count)
        yield scored


class ScoreGroups(beam.PTransform):
    def __init__(self, config: RunConfig) -> None:
        super().__init__()
        self._config = config

    def expand(self, groups) -> beam.PCollection[ScoredGroup]:
        return groups | beam.ParDo(_ScoreFn(self._config)).with_output_types(ScoredGroup)
