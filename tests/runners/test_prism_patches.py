"""Each of the Prism fixes in runners/prism_patches/ that keeps data and state correct, shown on Prism
itself: the same pipeline runs on Prism built with all of them (it passes) and without that one (the
defect shows). The two that only save CPU are covered by tests/runners/test_options.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import apache_beam as beam
import pytest
from apache_beam.coders import VarIntCoder
from apache_beam.io.restriction_trackers import OffsetRange, OffsetRestrictionTracker
from apache_beam.io.watermark_estimators import ManualWatermarkEstimator
from apache_beam.transforms import userstate
from apache_beam.transforms.core import RestrictionProvider, WatermarkEstimatorProvider
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.utils.timestamp import Duration, Timestamp

from beam_rl.wiring import job_parts
from beam_rl.config import config_from_dict
from beam_rl.rundir import RunDir
from runners import bootstrap
from runners.options import RunnerSettings, pipeline_options
from beam_rl.job.graph import build_rollout_pipeline, source_spec
from tests.support.proc_net import listeners


def _prism(without: str | None) -> str:
    patches = [p for p in bootstrap.PRISM_PATCHES if without is None or not p.name.startswith(without)]
    assert without is None or len(patches) == len(bootstrap.PRISM_PATCHES) - 1, f"no patch {without}"
    return str(bootstrap.ensure_prism(patches=patches))


def _run(build, without: str | None, timeout_s: float = 120, **settings):
    """Runs the pipeline `build` makes on Prism without the patch `without` (and with the runner `settings`
    given); returns its end state."""
    pipeline = beam.Pipeline(options=pipeline_options(RunnerSettings(prism_location=_prism(without), **settings)))
    build(pipeline)
    result = pipeline.run()
    state = result.wait_until_finish(duration=int(timeout_s * 1000))
    if state == "RUNNING":  # a job that hangs is cancelled, not left to run beside the next test's
        result.cancel()
    return state


def _append(path: Path, record) -> None:  # LOOPBACK: the worker runs in this process
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _records(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# -- 0003: a stateful stage's bundle is never split ----------------------------------------------------

ELEMENTS = 60


class _Count(beam.DoFn):
    COUNT = userstate.ReadModifyWriteStateSpec("count", VarIntCoder())

    def __init__(self, out: str) -> None:
        self._out = out

    def process(self, keyed, count=beam.DoFn.StateParam(COUNT)):
        total = (count.read() or 0) + 1
        # The bundle's first element (Prism orders a key's elements as its heap yields them) makes no
        # progress for a few ticks, so Prism asks to split the rest of the bundle; each later one takes a
        # little, so the split's leftover bundle is scheduled while this one still runs.
        time.sleep(0.5 if total == 1 else 0.02)
        count.write(total)
        _append(Path(self._out), total)


@pytest.mark.parametrize("without", [None, "0003"])
def test_a_slow_stateful_bundle_keeps_every_update_of_its_key(tmp_path, without):
    out = tmp_path / "counts.jsonl"

    def build(p):
        _ = (p | beam.Impulse() | beam.FlatMap(lambda _: range(ELEMENTS))
             | beam.Map(lambda i: ("key", i)) | beam.ParDo(_Count(str(out))))

    _run(build, without)
    final = max(_records(out))
    if without is None:
        assert final == ELEMENTS
    else:  # the split's leftover bundle ran without the key's state and overwrote it
        assert final < ELEMENTS


# -- upstream since 2.66: event-time timers wait for the watermark (0004 keeps the rest, below) --------

CALLS = 6
START = Timestamp(1_000_000)  # the source's watermark moves a second a call from here, far below an hour


class _Range(RestrictionProvider):
    def initial_restriction(self, element):
        return OffsetRange(0, CALLS)

    def create_tracker(self, restriction):
        return OffsetRestrictionTracker(restriction)

    def restriction_size(self, element, restriction):
        return restriction.size()


class _HeldWatermark(WatermarkEstimatorProvider):
    def initial_estimator_state(self, element, restriction):
        return START

    def create_watermark_estimator(self, state):
        return ManualWatermarkEstimator(state)


class _PacedSource(beam.DoFn):
    """An unbounded source of CALLS elements, one a call, a call every PACE_S: element(i) is stamped, and
    the watermark held, at START + i seconds, so event time moves only as fast as the source says."""

    PACE_S: float

    def element(self, position: int):
        raise NotImplementedError

    @beam.DoFn.unbounded_per_element()
    def process(self, _, tracker=beam.DoFn.RestrictionParam(_Range()),
                watermark=beam.DoFn.WatermarkEstimatorParam(_HeldWatermark())):
        position = tracker.current_restriction().start
        if not tracker.try_claim(position):
            return
        time.sleep(self.PACE_S)
        at = START + Duration(seconds=position)
        yield beam.window.TimestampedValue(self.element(position), at)
        watermark.set_watermark(at)
        tracker.defer_remainder(Duration.of(0))


class _SlowSource(_PacedSource):
    """("key", i) a call, a call every ~0.3 s."""

    PACE_S = 0.3

    def element(self, position: int):
        return ("key", position)


class _TimerAnHourAhead(beam.DoFn):
    SEEN = userstate.ReadModifyWriteStateSpec("seen", VarIntCoder())
    LATER = userstate.TimerSpec("later", TimeDomain.WATERMARK)

    def __init__(self, out: str) -> None:
        self._out = out

    def process(self, keyed, seen=beam.DoFn.StateParam(SEEN), later=beam.DoFn.TimerParam(LATER)):
        count = (seen.read() or 0) + 1
        seen.write(count)
        _append(Path(self._out), ["element", count, time.time()])
        if count == 1:
            later.set(START + Duration(seconds=3600))

    @userstate.on_timer(LATER)
    def fire(self, seen=beam.DoFn.StateParam(SEEN)):
        _append(Path(self._out), ["fired", seen.read(), time.time()])


@pytest.mark.parametrize("without", [None, "0004"])
def test_an_event_time_timer_fires_only_once_the_watermark_passes_it(tmp_path, without):
    """Prism 2.62 fired a key's event-time timer with the key's next bundle, an hour of event time early.
    Since 2.66 Prism compares the timer with the watermark itself: with 0004 or without it, the timer fires
    at the end of input (the watermark's jump to +inf), once every element was seen."""
    out = tmp_path / "fired.jsonl"

    def build(p):
        _ = (p | beam.Impulse() | beam.Map(lambda _: "go") | beam.ParDo(_SlowSource())
             | beam.ParDo(_TimerAnHourAhead(str(out))))

    _run(build, without)
    assert [seen for kind, seen, _ in _records(out) if kind == "fired"] == [CALLS]


# -- 0004: a key holding only timers not yet due is not in progress ---------------------------------------

SCHEDULE = [("b", "set-timer"), ("a", "slow"), ("b", "fast"), ("a", "tail"), ("a", "tail"), ("a", "tail")]
assert len(SCHEDULE) == CALLS  # _Range's
SLOW_S = 4.0


class _Scheduled(_PacedSource):
    """SCHEDULE's elements, one a call, a call every ~0.5 s, the watermark a second an element past START."""

    PACE_S = 0.5

    def element(self, position: int):
        return SCHEDULE[position]


class _KeysAndTimers(beam.DoFn):
    LATER = userstate.TimerSpec("later", TimeDomain.WATERMARK)

    def __init__(self, out: str) -> None:
        self._out = out

    def process(self, keyed, later=beam.DoFn.TimerParam(LATER)):
        key, what = keyed
        _append(Path(self._out), [key, what, "start", time.time()])
        if what == "set-timer":
            later.set(START + Duration(seconds=3600))
        elif what == "slow":
            time.sleep(SLOW_S)
        _append(Path(self._out), [key, what, "end", time.time()])

    @userstate.on_timer(LATER)
    def fire(self):
        pass


@pytest.mark.parametrize("without", [None, "0004"])
def test_a_key_waiting_on_a_future_timer_is_not_held_by_another_keys_bundle(tmp_path, without):
    """Key b holds only a timer an hour ahead when key a's slow element is bundled. Stock Prism 2.70 marks
    every key it looks at in progress, b too, though it takes nothing of b's (the timer is not due): b's
    next element then waits for a's slow bundle to end. With 0004 only keys something was taken from are
    in progress, and b's element runs beside a's."""
    out = tmp_path / "events.jsonl"

    def build(p):
        _ = (p | beam.Impulse() | beam.Map(lambda _: "go") | beam.ParDo(_Scheduled())
             | beam.ParDo(_KeysAndTimers(str(out))))

    _run(build, without)
    at = {(key, what, edge): t for key, what, edge, t in _records(out)}
    slow_end, fast_start = at[("a", "slow", "end")], at[("b", "fast", "start")]
    if without is None:
        assert fast_start < slow_end - 1.0
    else:
        assert fast_start >= slow_end


# -- 0005: a failed split request never commits the bundle ----------------------------------------------


class _UnsplittableTracker(OffsetRestrictionTracker):
    def try_split(self, fraction_of_remainder):
        raise RuntimeError("this restriction refuses to split")


class _Unsplittable(RestrictionProvider):
    def initial_restriction(self, element):
        return OffsetRange(0, 4)

    def create_tracker(self, restriction):
        return _UnsplittableTracker(restriction)

    def restriction_size(self, element, restriction):
        return restriction.size()


class _StallingReader(beam.DoFn):
    """Claims a position, then makes no progress for a second: Prism asks to split the bundle, and the
    SDK answers the split request with the tracker's error."""

    def process(self, element, tracker=beam.DoFn.RestrictionParam(_Unsplittable())):
        position = tracker.current_restriction().start
        while tracker.try_claim(position):
            time.sleep(1.0)
            yield position
            position += 1


@pytest.mark.parametrize("without", [None, "0005"])
def test_a_bundle_whose_split_request_fails_fails_the_job(without):
    """Stock Prism 2.70 handles a failed split request with an inverted test (it keeps the bundle's error
    only when there already is one) and returns nil: the bundle is then neither committed nor failed, and
    the job never ends."""

    def build(p):
        _ = p | beam.Impulse() | beam.ParDo(_StallingReader())

    if without is None:
        with pytest.raises(Exception, match="this restriction refuses to split"):
            _run(build, without, timeout_s=60)
    else:
        assert _run(build, without, timeout_s=20) == "RUNNING"  # 4 s of work, still running at 20 s


# -- upstream since 2.66: a failed progress request no longer commits the bundle ---------------------------


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once it is closed


@pytest.mark.parametrize("without", [None, "0005"])
def test_a_source_bundle_that_fails_fails_the_job(tmp_path, without):
    """The rollout pipeline's source fails its bundle (its only server never answers, past the
    limit). Stock Prism 2.62 asked the worker for progress meanwhile, took the error that answered it for
    the end of the bundle, committed the bundle with no response (its residual gone) and ended the job
    DONE: the failure, and the rest of the run, silently lost. Prism 2.70 stops asking for progress and
    waits for the bundle's response (upstream's fix; 0005 no longer touches this path): the job fails
    with the source's error, with the patch or without it."""
    config = config_from_dict({
        "run": {"dir": str(tmp_path)}, "envs": [{"name": "reverse_text", "group_size": 4, "limit": 8}],
        "batch": {"rollouts_per_step": 16},
        "inference": {"max_tokens": 8, "max_inflight": 16, "startup_timeout_s": 1.0},
    })

    def build(p):
        build_rollout_pipeline(p, source_spec(job_parts(config), [_dead_url()], RunDir(tmp_path), with_trainer=False))

    with pytest.raises(Exception, match="AllServersDownError"):
        _run(build, without)


# -- 0006: a worker in a process environment is refused, and a dead one leaves the job waiting ---------------


def _write_pids(p, out: Path) -> None:
    """Each element's worker pid into `out` (the lambda goes by value: the worker does not import this module)."""
    _ = (p | beam.Create([1, 2, 3])
         | beam.Map(lambda _, path=str(out): open(path, "a").write(f"{os.getpid()}\n")))


@pytest.mark.parametrize("without", [None, "0006"])
def test_a_process_environment_runs_the_stages_in_a_worker_prism_starts(tmp_path, without):
    """Stock Prism 2.70 starts a process worker with `--id='<id>'` through exec, so the quotes are part of the
    id; the worker pool refuses the worker at provisioning, and the job waits for it for good."""
    out = tmp_path / "pids.txt"
    if without is None:
        assert _run(lambda p: _write_pids(p, out), without, timeout_s=120, environment="process") == "DONE"
        pids = {int(line) for line in out.read_text().split()}
        assert len(pids) == 1 and os.getpid() not in pids  # one worker, and not this process
    else:
        assert _run(lambda p: _write_pids(p, out), without, timeout_s=20, environment="process") == "RUNNING"
        assert not out.exists()


def test_a_process_worker_that_exits_while_the_job_runs_fails_the_job(tmp_path):
    """Stock Prism only logs a worker process's exit, and its check for a worker that never connects passes
    once that worker is stopped: the job would wait forever. Patched, the job fails and says why."""
    boot = tmp_path / "boot.sh"
    boot.write_text("#!/bin/sh\nexit 3\n")
    boot.chmod(0o755)
    with pytest.raises(Exception, match="exited while the job was running"):
        _run(lambda p: _write_pids(p, tmp_path / "pids.txt"), None, timeout_s=60, environment="process",
             worker_command=str(boot))


# -- 0007: a worker pool that starts no worker ends Prism, and the client learns nothing -------------------


@pytest.fixture
def worker_pool(tmp_path):
    """A worker pool (`python -m runners.workers pool`) on a free loopback port; yields its address."""
    port = _dead_url().rsplit(":", 1)[1]
    pool = subprocess.Popen([sys.executable, "-m", "runners.workers", "pool", "--port", port],
                            env=dict(os.environ, BEAM_RL_WORKER_LOG_DIR=str(tmp_path / "workers")),
                            stdout=subprocess.PIPE, text=True)
    try:
        assert pool.stdout.readline().startswith("READY"), "the worker pool did not start"
        yield f"localhost:{port}"
    finally:
        pool.terminate()
        pool.wait(30)


def test_an_external_environment_runs_the_stages_in_a_worker_of_the_pool(tmp_path, worker_pool):
    out = tmp_path / "pids.txt"
    assert _run(lambda p: _write_pids(p, out), None, environment="external", worker_pool=worker_pool) == "DONE"
    pids = {int(line) for line in out.read_text().split()}
    assert len(pids) == 1 and os.getpid() not in pids


@pytest.mark.parametrize("without", [None, "0007"])
def test_a_worker_pool_that_starts_no_worker_fails_the_job_naming_the_pool(tmp_path, without):
    """Stock Prism 2.70 panics when the pool cannot start a worker (nothing listens there, or the pool says
    no): Prism exits with every job on it, and the client is told only that its connection broke."""
    pool = _dead_url().removeprefix("http://")
    with pytest.raises(Exception) as raised:
        _run(lambda p: _write_pids(p, tmp_path / "pids.txt"), without, timeout_s=60, environment="external",
             worker_pool=pool)
    named = f"the sdk worker pool at {pool} did not start a worker" in str(raised.value)
    assert named if without is None else not named, raised.value


# -- 0008: the job service, and every worker's FnAPI endpoints on its port, listen on every interface -------


@pytest.mark.parametrize("without", [None, "0008"])
def test_the_job_service_listens_on_loopback_unless_told_otherwise(without):
    """Stock Prism 2.70 listens on `:<job_port>`, every interface: whoever reaches the host can submit a job
    or have its workers run their code. Patched, it listens on `--job_host`, localhost unless told otherwise
    (the runs above pass runner.bind_host and run their workers through it)."""
    port = int(_dead_url().rsplit(":", 1)[1])
    prism = subprocess.Popen([_prism(without), f"--job_port={port}", "--serve_http=false"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        found = set()
        while not found and prism.poll() is None:
            found = listeners([prism.pid])
            time.sleep(0.1)
        assert {listener.port for listener in found} == {port}
        on_loopback = {listener.on_loopback for listener in found}
        assert on_loopback == ({True} if without is None else {False}), sorted(map(str, found))
    finally:
        prism.terminate()
        prism.wait(30)
