"""The in-flight cap chosen as the run goes (beam_rl/dispatch/concurrency.py): goodput hill-climbing on a
modelled fleet whose trained rate peaks at some cap and moves, KV AIMD, and the dispatcher holding the cap
(the controller against simulated engines and the benchmark's workloads: tests/integration/test_goodput.py)."""

from __future__ import annotations

import asyncio

import pytest

from beam_rl.config import config_from_dict
from beam_rl.dispatch.concurrency import GoodputController, KvController, concurrency_controller


class Fleet:
    """A fleet whose trained tokens/s under cap c rise linearly until `knee` (the engines saturate), then
    fall (each rollout slower: more of its tokens too stale to train). Rollouts of 100 tokens finish at
    rate(c) / 100 a second."""

    def __init__(self, knee: int, peak: float = 10_000.0) -> None:
        self.knee, self.peak, self.now = knee, peak, 0.0

    def rate(self, cap: int) -> float:
        if cap <= self.knee:
            return self.peak * cap / self.knee
        return self.peak * max(0.1, 1 - 0.6 * (cap - self.knee) / self.knee)

    def run(self, controller: GoodputController, rollouts: int) -> list[int]:
        caps = []
        for _ in range(rollouts):
            self.now += 100 / self.rate(controller.cap)
            controller.finished(100, self.now)
            caps.append(controller.cap)
        return caps


@pytest.mark.parametrize("start", [None, 8], ids=["default-above-the-knee", "below-the-knee"])
def test_goodput_finds_the_knee_and_stays_near_it(start):
    """From the default start (a quarter of the ceiling, past this fleet's knee: it comes down to it) and from a
    start below the knee (slow start grows up to it)."""
    fleet = Fleet(knee=48)
    controller = GoodputController(ceiling=256, start=start)
    assert controller.cap == (64 if start is None else start)  # by default, a quarter of the ceiling
    caps = fleet.run(controller, 20_000)
    settled = caps[len(caps) // 2:]
    assert controller.phase == "probing"
    # Probes go an eighth of the accepted cap either way and come back when they measure worse.
    assert 40 <= min(settled) and max(settled) <= 60, (min(settled), max(settled))
    mean_rate = sum(fleet.rate(c) for c in settled) / len(settled)
    assert mean_rate >= 0.95 * fleet.peak, mean_rate
    # Against a fixed cap at the ceiling, the default of fixed mode: the fleet past its knee.
    assert mean_rate > 2 * fleet.rate(256)


def test_a_probe_is_kept_only_when_it_wins_twice_in_a_row():
    """Near a full KV cache one measurement varies by up to a fifth: a probe whose first measurement comes out
    high by chance, and its second does not, leaves the accepted cap where it was."""
    fleet = Fleet(knee=64)
    controller = GoodputController(ceiling=256, start=64)
    first_measured: set[int] = set()
    lucky = fleet.rate
    fleet.rate = lambda cap: lucky(cap) * (1.3 if cap not in first_measured and cap != 64 else 1)
    accepted = []
    for _ in range(20_000):
        decided = len(controller.history)
        fleet.run(controller, 1)
        if len(controller.history) > decided:
            first_measured.add(controller.history[-1][1])
        if controller.phase == "probing":
            accepted.append(controller.accepted_cap)
    lucky_wins = [(cap, rate) for _, cap, rate in controller.history if cap != 64 and rate > 1.1 * fleet.peak]
    assert len(lucky_wins) >= 4, list(controller.history)  # probes up and down won once
    assert set(accepted) == {64}, sorted(set(accepted))


def test_a_peak_far_below_the_start_is_reached_by_steps_of_slow_starts_factor():
    """A KV cache that holds a small share of the slots' sequences: the knee lies far below the start. Once a step
    up loses, the cap steps down by slow start's factor while the rate is no worse, in a handful of
    measurements (probes of an eighth would take dozens), and probing starts near the knee."""
    fleet = Fleet(knee=12)
    controller = GoodputController(ceiling=256)
    assert controller.cap == 64  # 5x the knee: the rate is at its floor there
    phases = []
    while controller.phase != "probing":
        fleet.run(controller, 1)
        phases.append(controller.phase)
    assert "descent" in phases
    assert 8 <= controller.accepted_cap <= 18, list(controller.history)
    assert len(controller.history) <= 10, list(controller.history)


def test_a_measurement_under_a_cap_far_past_the_peak_waits_a_few_policy_steps_not_a_pool_of_rollouts():
    """Past the peak rollouts finish slowly: the pool has turned over after `max_span_steps` policy steps, and a
    measurement that long decides with `min_rollouts`, not a cap's worth of rollouts (1,024 at a few a second)."""
    controller = GoodputController(ceiling=1024, start=1024)
    for i in range(200):  # a new policy every 10 rollouts: 20 steps, far fewer rollouts than the cap
        controller.finished(100, float(i), version=i // 10)
    assert controller.history, "no decision in 20 policy steps"
    assert controller.history[0][1] == 1024


def test_goodput_follows_the_knee_when_it_moves():
    fleet = Fleet(knee=24)
    controller = GoodputController(ceiling=256, start=8)
    fleet.run(controller, 10_000)
    assert 16 <= controller.accepted_cap <= 40, list(controller.history)[-5:]
    fleet.knee = 96  # shorter rollouts, or a faster step: the engines take more before they saturate
    caps = fleet.run(controller, 40_000)
    settled = caps[-10_000:]
    assert sum(settled) / len(settled) >= 64, list(controller.history)[-5:]


def test_goodput_backs_off_when_the_knee_falls_and_settles_there():
    """Longer rollouts, or a KV cache that fills sooner: the knee falls far below the cap held. The rate
    collapses, the cap halves and slow-starts again, and it settles near the new knee, where it stays:
    once probes lose both ways it probes closer and less often."""
    fleet = Fleet(knee=128)
    controller = GoodputController(ceiling=512, start=16)
    fleet.run(controller, 20_000)
    assert 96 <= controller.accepted_cap <= 192, list(controller.history)[-5:]
    fleet.knee = 32
    caps = fleet.run(controller, 40_000)
    settled = caps[-15_000:]
    held = max(set(settled), key=settled.count)
    assert 24 <= held <= 48, list(controller.history)[-5:]
    assert settled.count(held) >= 0.7 * len(settled), sorted(set(settled))  # mostly at one cap
    assert sum(fleet.rate(c) for c in settled) / len(settled) >= 0.9 * fleet.peak


def test_a_goodput_measurement_spans_whole_policy_steps():
    """Work goes stale at policy steps: a measurement starts and ends at a rollout of a new policy version,
    so each counts the stale rollouts of whole steps."""
    controller = GoodputController(ceiling=64, start=8)
    boundaries = []
    for i in range(5_000):
        version = i // 37  # a new policy every 37 rollouts, unrelated to the caps
        controller.finished(100, float(i), version)
        if i % 37 == 0:
            boundaries.append(float(i))
    decided = [t for t, _, _ in controller.history]
    assert len(decided) >= 10
    assert set(decided) <= set(boundaries), sorted(set(decided) - set(boundaries))[:5]


def test_a_collapse_halves_the_cap_and_slow_starts_again():
    fleet = Fleet(knee=64)
    controller = GoodputController(ceiling=256, start=8)
    fleet.run(controller, 10_000)
    before = controller.accepted_cap
    fleet.peak /= 4  # the trainer's step time tripled, or half the fleet went away
    for _ in range(2000):
        fleet.run(controller, 1)
        if controller.phase == "slow_start":
            break
    assert controller.phase == "slow_start" and controller.cap <= before // 2 + 1


def test_kv_mode_backs_off_above_the_soft_cap_and_grows_below_it():
    controller = KvController(ceiling=64, start=16, soft_cap=0.9, step=4)
    controller.loads([0.5, 0.2], False, 0.0)
    assert controller.cap == 20
    controller.loads([0.95, 0.1], False, 1.0)  # the fullest server decides
    assert controller.cap == 15
    controller.loads([0.85], False, 2.0)  # inside the headroom: hold
    assert controller.cap == 15
    controller.loads([], False, 3.0)  # nobody reports a cache: hold
    assert controller.cap == 15
    controller.loads([0.5], True, 3.5)  # preemptions since the last poll: the cache ran out between polls
    assert controller.cap == 11
    for t in range(100):
        controller.loads([0.1], False, 4.0 + t)
    assert controller.cap == 64


def test_bad_concurrency_settings_are_named():
    with pytest.raises(ValueError, match="floor"):
        GoodputController(ceiling=4, floor=8)
    with pytest.raises(ValueError, match="mode must be one of"):
        concurrency_controller("adaptive", 8)
    with pytest.raises(Exception, match="dispatch.concurrency.mode"):
        config_from_dict({"dispatch": {"concurrency": {"mode": "adaptive"}}})
    with pytest.raises(Exception, match="kv_soft_cap"):
        config_from_dict({"dispatch": {"concurrency": {"mode": "kv", "kv_soft_cap": 1.5}}})


class Scripted:
    """A controller that holds 8 in flight until 16 rollouts have finished, then 2."""

    counts_trained_tokens = True

    def __init__(self) -> None:
        self.cap, self.seen = 8, 0

    def finished(self, trained_tokens: int, now: float, version: int | None = None) -> None:
        self.seen += 1
        if self.seen == 16:
            self.cap = 2

    def loads(self, kv_usages, preempted, now) -> None:
        pass

    def describe(self) -> dict:
        return {"mode": "scripted", "cap": self.cap}


def test_the_dispatcher_holds_the_cap_its_controller_sets(tok, start_embedded):
    """The cap lowered mid-run: the rollouts running finish, and no new one starts until fewer than the
    new cap are in flight."""
    from beam_rl.dispatch import Dispatcher
    from beam_rl.envs import make_env
    from beam_rl.inference.client import InferenceClient
    from beam_rl.inference.types import SamplingParams
    from beam_rl.standin.faults import FaultConfig
    from tests.support.dispatching import group_requests

    server = start_embedded(None, mode="instant", max_num_seqs=64, faults=FaultConfig(latency_s=0.05))
    env = make_env("reverse_text", tok)
    seen: list[tuple[int, int]] = []  # (rollouts emitted, in flight) after each fill

    async def main() -> None:
        emitted: list = []
        d = Dispatcher([InferenceClient(server.url, model="tiny")], {env.name: env}, {env.name: "rollout"},
                       {env.name: SamplingParams(max_tokens=8)}, 8, lambda: 0, emitted.append,
                       concurrency=Scripted())
        d.add(group_requests(env, 12, 4))
        while len(emitted) < 48:
            d.fill()
            seen.append((len(emitted), d.inflight))
            await d.wait_for_work(0.05)
        await d.aclose()
        assert all(r.ok for r in emitted)

    asyncio.run(main())
    assert max(n for _, n in seen) == 8
    # After the 16th finished, the 8 started before drain; past 24 emitted, never more than 2 run.
    assert max(n for done, n in seen if done >= 24) <= 2


def test_a_restarted_controller_starts_where_the_committed_windows_show_the_cap_was():
    """committed_concurrency: the most rollouts in flight at once on the shard's servers, from the committed
    windows' t_sent and t_finished (a finish and a start at one instant do not overlap)."""
    import pyarrow as pa

    from beam_rl.dispatch.concurrency import committed_concurrency

    a, b = "http://127.0.0.1:1", "http://127.0.0.1:2"
    first = pa.table({"server": [a, a, a, b, None], "t_sent": [0.0, 1.0, 2.0, 0.0, 0.5],
                      "t_finished": [3.0, 4.0, 2.5, 9.0, 0.5]})
    second = pa.table({"server": [a, a], "t_sent": [4.0, 3.5], "t_finished": [6.0, 5.0]})
    assert committed_concurrency([first], {a}) == 3  # 0-3, 1-4 and 2-2.5 overlap at 2.0
    assert committed_concurrency([first, second], {a}) == 3
    assert committed_concurrency([first], {a, b}) == 4
    assert committed_concurrency([second], {b}) is None
    controller = concurrency_controller("goodput", 64, start=committed_concurrency([first], {a}))
    assert controller.cap == 3
