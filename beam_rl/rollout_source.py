"""The prompt source and the dispatcher, as one object a streaming source can drive.

It decides when to admit the next group (backpressure), hands admitted groups to the dispatcher's
event-loop thread, returns finished rollouts as they finish, and knows when the run is over. The
Beam layer (transforms/dispatch.py) only claims offsets and emits what this returns.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from beam_rl import components
from beam_rl.config import RunConfig
from beam_rl.rundir import RunDir
from beam_rl.types import Rollout

_LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourceSpec:
    """What a worker needs to start the source: the config, the servers and the run directory."""

    config: RunConfig
    server_urls: tuple[str, ...]
    run_dir: str
    run_id: str  # one source object per run id per worker process
    first_step: int = 1  # the step this pipeline run starts at (last committed + 1)
    with_trainer: bool = True  # False: nobody publishes weights, so staleness is not checked


@dataclass(frozen=True)
class EndOfInput:
    """Sent once the source has nothing more to emit: `groups` groups left it in this run."""

    groups: int


@dataclass
class _Progress:
    admitted: int = 0
    emitted_rollouts: int = 0
    stopped: bool = False
    last_stop_check: float = field(default=0.0)


class RolloutSource:
    STOP_CHECK_S = 0.25  # how often the run directory is asked whether max_steps is committed

    def __init__(self, spec: SourceSpec) -> None:
        config = spec.config
        self.spec = spec
        self.envs = components.build_envs(config)
        self.schedule = components.build_schedule(config, self.envs)
        self._run_dir = RunDir(spec.run_dir)
        self._max_steps = config.run.max_steps
        self._group_sizes = {e.name: e.group_size for e in config.envs}
        # Keep about one full set of permits' worth of groups queued, so a permit that frees up
        # always finds work without waiting for the next bundle.
        self._backlog_groups = max(2, config.inference.max_inflight // min(self._group_sizes.values()))
        self._progress = _Progress()
        self._dispatcher = components.dispatcher_thread(
            config, list(spec.server_urls), self.envs, policy_version=self.policy_version)

    def __len__(self) -> int:
        return len(self.schedule)

    # -- policy version -------------------------------------------------------------------------

    def policy_version(self) -> int:
        return 0  # no trainer publishes weights yet

    # -- admission ------------------------------------------------------------------------------

    def wants_more(self) -> bool:
        """Backpressure: admit only while the dispatcher's queue of waiting groups is short."""
        return not self.stopping() and self._dispatcher.pending_groups() < self._backlog_groups

    def admit(self, position: int) -> None:
        self._dispatcher.add_groups([self.schedule.group(position, self.policy_version())])
        self._progress.admitted += 1

    @property
    def admitted(self) -> int:
        return self._progress.admitted

    # -- completion -----------------------------------------------------------------------------

    def poll(self, max_wait_s: float) -> list[Rollout]:
        rollouts = self._dispatcher.poll(max_wait_s)
        self._progress.emitted_rollouts += len(rollouts)
        return rollouts

    def idle(self) -> bool:
        """Every admitted group's rollouts have been returned by `poll`."""
        return not self._dispatcher.inflight_groups()

    def stopping(self) -> bool:
        """True once the run's last step is committed: in-flight groups are cancelled, none admitted."""
        progress = self._progress
        now = time.monotonic()
        if not progress.stopped and now - progress.last_stop_check >= self.STOP_CHECK_S:
            progress.last_stop_check = now
            last = self._run_dir.last_committed_step()
            if last is not None and last >= self._max_steps:
                progress.stopped = True
                cancelled = self._dispatcher.cancel_groups(self._dispatcher.inflight_groups())
                _LOG.info("step %d committed: run complete, cancelled %d in-flight groups", last, len(cancelled))
        return progress.stopped

    def counters(self) -> dict[str, int]:
        return self._dispatcher.counters()

    def close(self) -> None:
        self._dispatcher.close()


_SOURCES: dict[str, RolloutSource] = {}
_SOURCES_LOCK = threading.Lock()


def source_for(spec: SourceSpec) -> RolloutSource:
    """The worker-wide source of a run: every DoFn instance (and every resumed bundle) shares it,
    because in-flight rollouts live in its event loop, not in any one bundle."""
    with _SOURCES_LOCK:
        source = _SOURCES.get(spec.run_id)
        if source is None:
            source = _SOURCES[spec.run_id] = RolloutSource(spec)
        return source


def close_source(run_id: str) -> None:
    with _SOURCES_LOCK:
        source = _SOURCES.pop(run_id, None)
    if source is not None:
        source.close()
