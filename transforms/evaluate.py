"""EvaluateRounds: collects each evaluation round's groups in keyed state and, once every held-out prompt
has come back, appends the round's summary to the run's metrics."""

from __future__ import annotations

import apache_beam as beam
from apache_beam.transforms import userstate

from beam_rl import wiring
from beam_rl.config import RunConfig
from beam_rl.rundir import RunDir
from beam_rl.scoring.evaluation import summarize_round
from beam_rl.types import RolloutRecord
from transforms.coders import DomainCoder


class _CollectRound(beam.DoFn):
    GROUPS = userstate.BagStateSpec("groups", DomainCoder())  # the round's groups so far, as records

    def __init__(self, config: RunConfig, run_dir: str) -> None:
        self._config = config
        self._run_dir = run_dir

    def setup(self) -> None:
        self._parts = wiring.eval_parts(self._config)
        self._dir = RunDir(self._run_dir)

    def process(self, keyed: tuple[int, list[RolloutRecord]], groups=beam.DoFn.StateParam(GROUPS)):
        after_step, group = keyed
        arrived = [*groups.read(), group]
        if len(arrived) < self._parts.prompts_per_round:
            groups.add(group)
            return
        groups.clear()
        self._dir.append_metrics({"eval": summarize_round(after_step, [r for g in arrived for r in g])})


class EvaluateRounds(beam.PTransform):
    def __init__(self, config: RunConfig, run_dir: str) -> None:
        super().__init__()
        self._fn = _CollectRound(config, run_dir)

    def expand(self, eval_groups):
        return eval_groups | beam.ParDo(self._fn)
