"""DispatchRollouts: PromptSource + Dispatch as a splittable DoFn per shard, an unbounded source of rollouts.

Like an IO connector's reader, each shard's DoFn claims prompt offsets from its restriction as the
dispatcher has room, emits finished rollouts as they finish (keyed by group, for CompleteGroups), and
checkpoints itself every fraction of a second so they leave in small bundles. Its end of input leaves on
the same output, keyed apart, and passes through CompleteGroups and Score to the packer: the scored
groups then meet no Flatten on their way, which made the runner unfuse the stage after Score (each
scored group crossed the runner twice). The dispatcher's event loop
lives across bundles in the worker process (one RolloutSource per shard, held with Beam's `Shared`). A
shard's restriction (beam_rl.source.DispatchRange) carries what a restore must run again.
"""

from __future__ import annotations

import threading
import time
import uuid

import apache_beam as beam
from apache_beam.io.iobase import RestrictionProgress, RestrictionTracker
from apache_beam.transforms.core import RestrictionProvider
from apache_beam.transforms.window import TimestampedValue
from apache_beam.typehints.native_type_compatibility import convert_to_beam_type
from apache_beam.utils import shared
from apache_beam.utils.timestamp import Duration, Timestamp

from beam_rl import wiring
from beam_rl.dispatch.heap import settle_heap
from beam_rl.source import DispatchRange, EndOfInput, RolloutSource, Shard, SourceSpec
from beam_rl.types import Rollout
from transforms.coders import GroupPart
from transforms.flink_keys import operator_index
from transforms.sdf import WatermarkFromStart

END_OF_INPUT = "end_of_input"  # the key prefix of a shard's EndOfInput
# How long one process() call runs before it checkpoints. A call's output reaches the next stage only as it
# ends, so it ends at most BUNDLE_S after its first output; a call with nothing to give runs up to
# IDLE_BUNDLE_S, since each call costs the runner and the worker the same whatever it carries (a bundle, its
# progress reports and its residual's state).
BUNDLE_S = 0.5
IDLE_BUNDLE_S = 1.0
POLL_S = 0.02

# (run id, (shard index, offsets in the shard)): plain values with a deterministic coder, which Flink needs
# to key the source's residuals; pairs, because Prism 2.62 knows no coder of longer tuples.
ShardElement = tuple[str, tuple[int, int]]


class _RangeTracker(RestrictionTracker):
    """Claims offsets of a DispatchRange in increasing order. Never splits but to checkpoint: a shard
    is one reader (shards are how dispatch scales out), so a runner's dynamic split is declined."""

    def __init__(self, restriction: DispatchRange) -> None:
        self._restriction = restriction
        self._next = restriction.start
        self._draws = list(restriction.draws)

    def current_restriction(self) -> DispatchRange:
        return self._restriction

    def try_claim(self, position: int | tuple[int, int]) -> bool:
        """Claim `position`: an offset, or (offset, stream) when the source chose which stream it draws
        from; the draw is counted here, under the runner's lock on the tracker, so a split never
        separates it from its offset."""
        offset, stream = position if isinstance(position, tuple) else (position, None)
        if not self._next <= offset < self._restriction.stop:
            return False
        self._next = offset + 1
        if stream is not None:
            self._draws += [0] * (stream + 1 - len(self._draws))
            self._draws[stream] += 1
        return True

    def try_split(self, fraction_of_remainder: float):
        r = self._restriction
        if fraction_of_remainder > 0 or self._next >= r.stop:
            return None
        # The residual copies what the process() call last noted as in flight (DispatchRange).
        primary = DispatchRange(r.start, self._next, draws=r.draws)
        residual = DispatchRange(self._next, r.stop, r.in_flight, tuple(self._draws))
        self._restriction = primary
        return primary, residual

    def check_done(self) -> None:
        if self._next < self._restriction.stop:
            raise ValueError(f"dispatch range {self._restriction} left unclaimed from offset {self._next}")

    def current_progress(self) -> RestrictionProgress:
        # As a fraction: the SDK replaces `completed` with the output's byte count, which it takes as
        # NaN until its size sampling has measured an element, and a NaN progress fails Prism's split
        # requests (the bundle's outputs were then lost).
        r = self._restriction
        completed, remaining = self._next - r.start, r.stop - self._next + len(r.in_flight.redo)
        return RestrictionProgress(fraction=completed / (completed + remaining) if completed + remaining else 1.0)

    def is_bounded(self) -> bool:
        return True


class _Ranges(RestrictionProvider):
    def initial_restriction(self, element: ShardElement) -> DispatchRange:
        return DispatchRange(0, element[1][1] + 1)  # every offset of the shard + the end marker

    def create_tracker(self, restriction: DispatchRange) -> _RangeTracker:
        return _RangeTracker(restriction)

    def split(self, element, restriction):
        yield restriction

    def restriction_size(self, element, restriction: DispatchRange) -> int:
        return restriction.size()


class _WorkerSources:
    """The sources of one run in one worker process, by shard: in-flight rollouts live in a source's
    event loop, not in any bundle, so every bundle (and every DoFn instance) of a shard uses the same one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_shard: dict[int, RolloutSource] = {}

    def get(self, parts: wiring.DispatchParts, shard: int, restriction: DispatchRange) -> RolloutSource:
        """The shard's source, rebuilt from `restriction` when there is none, when it is closed, or when
        it is ahead of the restriction: one it did not save means the runner restored an older checkpoint
        while this process lived on. A closed one was abandoned (wiring.ABANDONED_SOURCE_S)."""
        with self._lock:
            source = self._by_shard.get(shard)
            if source is not None and (source.token != restriction.in_flight.token or source.closed):
                source.close()
                source = None
            if source is None:
                source = self._by_shard[shard] = parts.source(Shard(shard, parts.spec.shards), restriction)
                settle_heap()
            return source

    def close(self) -> None:
        with self._lock:
            for source in self._by_shard.values():
                source.close()
            self._by_shard.clear()


class _GroupKeys:
    """The key each group is collected (and so scored) under. On Flink, groups are dealt round-robin
    over the parallel subtasks by their position in the prompt schedule: keyed by group id, Flink's hash
    left one worker with half as many groups again as the other on a 96-group run, and a worker scoring
    a CPU-heavy reward is as fast as its share is small. The key is a pure function of the group, so a
    group's parts, before and after a restore, meet under one key."""

    def __init__(self, runner: str, parallelism: int) -> None:
        self._parallelism = parallelism if runner != "direct" else 1
        self._coder = beam.coders.registry.get_coder(str)
        self._cache: dict[str, str] = {}

    def key(self, rollout: Rollout, source: RolloutSource) -> str:
        group_id = rollout.group_id
        if self._parallelism == 1:
            return group_id
        key = self._cache.get(group_id)
        if key is None:
            if len(self._cache) > 100_000:
                self._cache.clear()
            target = rollout.index if rollout.is_eval else source.schedule.position(rollout.prompt_offset)
            key = self._cache[group_id] = _key_for(group_id, target % self._parallelism, self._parallelism, self._coder)
        return key


def _key_for(group_id: str, subtask: int, parallelism: int, coder) -> str:
    for salt in range(100_000):
        key = f"{group_id}#{salt}"
        if operator_index(coder.encode_nested(key), parallelism) == subtask:
            return key
    raise AssertionError("no key found")  # each salt hits a subtask with probability 1/parallelism


_RANGES, _WATERMARK = _Ranges(), WatermarkFromStart()  # what Beam asks of the restriction and the watermark


class _DispatchFn(beam.DoFn):
    def __init__(self, spec: SourceSpec) -> None:
        self._spec = spec
        self._shared = shared.Shared()  # Beam's one-object-per-worker-process holder

    def setup(self) -> None:
        self._sources: _WorkerSources = self._shared.acquire(_WorkerSources)  # held: kept alive across bundles
        self._parts = wiring.dispatch_parts(self._spec)
        self._keys = _GroupKeys(self._spec.config.runner.name, self._spec.config.runner.parallelism)

    def teardown(self) -> None:
        self._sources.close()

    @beam.DoFn.unbounded_per_element()
    def process(
        self,
        element: ShardElement,
        tracker=beam.DoFn.RestrictionParam(_RANGES),
        watermark=beam.DoFn.WatermarkEstimatorParam(_WATERMARK),
    ):
        _, (shard, _) = element
        restriction = tracker.current_restriction()
        source = self._sources.get(self._parts, shard, restriction)
        # What this call saves is valid only for its successor: a later replay of the restriction it
        # got (a restore) is then told apart from normal progress.
        source.token = uuid.uuid4().hex
        next_offset = restriction.start
        deadline = time.monotonic() + IDLE_BUNDLE_S
        # What a checkpoint taken at any moment carries: set anew whenever admitting or finishing changes it.
        restriction.in_flight = source.in_flight()
        while True:
            # Claim.
            while next_offset < restriction.end_marker and source.wants_more():
                stream = source.next_stream()
                if not tracker.try_claim(next_offset if stream is None else (next_offset, stream)):
                    return
                source.admit(next_offset, stream)
                next_offset += 1
                restriction.in_flight = source.in_flight()
            # Work and yield: the rollouts of one group that finished together leave as one element
            # (a group-mode request finishes its whole group at once), so CompleteGroups' keyed
            # state is read and written once per part rather than once per rollout.
            now = Timestamp.now()
            parts: dict[str, list[Rollout]] = {}
            for rollout in source.poll(POLL_S):
                parts.setdefault(rollout.group_id, []).append(rollout)
            for part in parts.values():
                yield TimestampedValue((self._keys.key(part[0], source), part), now)
            if parts:
                deadline = min(deadline, time.monotonic() + BUNDLE_S)
            # The tokens of the rollouts generating are taken as the call ends: its residual is what a
            # checkpoint holds. One reading of the clock decides both, so a call never defers without them.
            ending = time.monotonic() >= deadline
            if parts or ending:
                restriction.in_flight = source.in_flight(with_tokens=ending)
            watermark.set_watermark(now)
            if source.finished(all_claimed=next_offset >= restriction.end_marker):
                if tracker.try_claim(restriction.end_marker):
                    yield TimestampedValue((f"{END_OF_INPUT}/{shard}", EndOfInput(shard, source.emitted)), now)
                source.close()
                return
            # Defer.
            if ending:
                tracker.defer_remainder(Duration.of(0))
                return


def _shard_elements(spec: SourceSpec) -> list[ShardElement]:
    """One element per shard. Flink keys the source's stage by the element, so on Flink each gets a
    routing key that sends shard i to subtask i (mod the parallelism): without it two shards may share a
    subtask, and so a worker, while another worker has none."""
    elements = []
    for i in range(spec.shards):
        size = spec.shard_draws(i)
        elements.append((_routing_key(spec, i, size), (i, size)))
    return elements


def _routing_key(spec: SourceSpec, shard: int, size: int) -> str:
    runner = spec.config.runner
    if runner.name == "direct":
        return spec.run_id
    # The element's coder as the runner knows it (KV of string and KV of varints): Flink keys by its nested
    # encoding.
    coder = beam.coders.registry.get_coder(convert_to_beam_type(ShardElement))
    for salt in range(100_000):
        key = f"{spec.run_id}/{salt}"
        if operator_index(coder.encode_nested((key, (shard, size))), runner.parallelism) == shard % runner.parallelism:
            return key
    raise AssertionError("no routing key found")  # each salt hits a subtask with probability 1/parallelism


class DispatchRollouts(beam.PTransform):
    """Every rollout of the run as it finishes, in parts keyed by their group (errored and cancelled ones
    too: every started rollout leaves exactly once); plus one EndOfInput per shard, keyed by its shard."""

    def __init__(self, spec: SourceSpec) -> None:
        super().__init__()
        self._spec = spec

    def expand(self, pbegin):
        elements = _shard_elements(self._spec)
        return (
            pbegin
            | beam.Impulse()
            | "Shards" >> beam.FlatMap(lambda _: elements).with_output_types(ShardElement)
            | beam.ParDo(_DispatchFn(self._spec)).with_output_types(tuple[str, GroupPart])
        )
