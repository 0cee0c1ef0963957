"""Score: each complete group's rewards (beam_rl.scoring.rewards), then its advantages, temperatures and pre-batch
filters (beam_rl.scoring.group.score_group). Evaluation groups are only rewarded, and leave on their own output;
a shard's EndOfInput goes on to the packer with the scored groups."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import apache_beam as beam
from apache_beam.utils.shared import Shared
from apache_beam.utils.windowed_value import WindowedValue

from beam_rl import wiring
from beam_rl.config import RunConfig
from beam_rl.envs.plugins import PluginFailure
from beam_rl.processes import worker_id
from beam_rl.rundir.failures import record_failure
from beam_rl.scoring.group import TOO_FEW_SCORED
from beam_rl.scoring.rewards import GroupRewards, Rewarder, RewardFailed, RewardLoop, wait_for_any
from beam_rl.source import EndOfInput
from beam_rl.types import RolloutRecord, RolloutStatus
from transforms.coders import PackerItem

EVALUATION = "evaluation"
_METRICS = "beam_rl"


class _ScoreFn(beam.DoFn):
    """Async rewards run on one event loop per worker process (held through Beam's Shared): `process`
    starts a group's rewards and returns, emitting the groups whose rewards are already in;
    `finish_bundle` emits the rest as their rewards come in. So the groups of a bundle are rewarded
    together, and a bundle holds more groups exactly when groups queue up behind slow rewards."""

    def __init__(self, config: RunConfig, run_dir: str | None) -> None:
        self._config = config
        self._run_dir = run_dir  # where a failure that stops the run is recorded (None: nowhere)
        self._reward_loop = Shared()  # one per worker process, whichever DoFn instances run there

    def setup(self) -> None:
        self._parts = wiring.scoring_parts(self._config)
        self._worker = worker_id()
        self._loop = self._reward_loop.acquire(RewardLoop)
        self._rewarder = Rewarder.from_config(self._config, self._parts.envs, self._loop)
        self._rewarding: list[tuple[GroupRewards, WindowedValue]] = []
        self._groups_per_bundle = beam.metrics.Metrics.distribution(_METRICS, "reward_groups_per_bundle")
        self._bundle_groups = 0

    def start_bundle(self) -> None:
        self._rewarding = []
        self._bundle_groups = 0

    def process(self, keyed_group, timestamp=beam.DoFn.TimestampParam, window=beam.DoFn.WindowParam):
        _, rollouts = keyed_group
        if isinstance(rollouts, EndOfInput):
            yield rollouts
            return
        self._bundle_groups += 1
        with self._recording_failure():
            # The output keeps this element's timestamp and window, whenever it is emitted.
            self._rewarding.append((self._rewarder.start(rollouts), WindowedValue(None, timestamp, (window,))))
            yield from self._emit(wait=False)

    def finish_bundle(self):
        with self._recording_failure():
            yield from self._emit(wait=True)
        self._groups_per_bundle.update(self._bundle_groups)

    def teardown(self) -> None:
        rewarder = getattr(self, "_rewarder", None)
        if rewarder is not None:
            rewarder.close()
        self._loop = self._rewarder = None  # type: ignore[assignment]  # the Shared loop stops once no instance holds it

    @contextlib.contextmanager
    def _recording_failure(self) -> Iterator[None]:
        """A reward that stops the run (a broken plug-in, a judge refusing the key) is recorded first."""
        try:
            yield
        except (RewardFailed, PluginFailure) as err:
            if self._run_dir is not None:
                record_failure(self._run_dir, "score", err)
            raise

    def _emit(self, wait: bool) -> Iterator[Any]:
        """The outputs of every group whose rewards are in, as they come in; with `wait`, of every group."""
        while self._rewarding:
            done = [item for item in self._rewarding if item[0].done()]
            if not done:
                if not wait:
                    return
                wait_for_any([rewarding for rewarding, _ in self._rewarding])
                continue
            emitted = {id(item) for item in done}
            self._rewarding = [item for item in self._rewarding if id(item) not in emitted]
            for rewarding, context in done:
                for output in self._score(rewarding.wait()):
                    tagged = isinstance(output, beam.pvalue.TaggedOutput)
                    windowed = context.with_value(output.value if tagged else output)
                    yield beam.pvalue.TaggedOutput(output.tag, windowed) if tagged else windowed

    def _score(self, rollouts) -> Iterator[Any]:
        env_name = rollouts[0].env_name
        reward_errors = sum(r.status is RolloutStatus.REWARD_ERROR for r in rollouts)
        if reward_errors:
            beam.metrics.Metrics.counter(_METRICS, f"reward_errors_{env_name}").inc(reward_errors)
        scored_at = time.time()
        for rollout in rollouts:
            rollout.score_worker, rollout.t_scored = self._worker, scored_at
        if rollouts[0].is_eval:
            yield beam.pvalue.TaggedOutput(EVALUATION, (rollouts[0].eval_round, [r.record() for r in rollouts]))
            return
        scored = self._parts.scoring.score(rollouts)
        if scored.counts.enforced.get(TOO_FEW_SCORED):
            beam.metrics.Metrics.counter(_METRICS, f"groups_too_few_scored_{env_name}").inc()
        for reason, count in scored.counts.enforced.items():
            beam.metrics.Metrics.counter(_METRICS, f"filtered_{reason}").inc(count)
        yield scored


class ScoreGroups(beam.PTransform):
    """Complete groups -> ScoredGroup (main output, with each EndOfInput that came in) and (eval round,
    rollout records) on EVALUATION."""

    def __init__(self, config: RunConfig, run_dir: str | None = None) -> None:
        super().__init__()
        self._config = config
        self._run_dir = run_dir

    def expand(self, groups):
        return groups | beam.ParDo(_ScoreFn(self._config, self._run_dir)).with_output_types(PackerItem).with_outputs(
            EVALUATION, main="scored"
        )


EvalGroup = list[RolloutRecord]
