"""The dispatcher's rules (permits, affinity, open groups first, versions, exactly-once) with fake clients."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from beam_rl.dispatch import (
    Dispatcher,
    DispatcherThread,
    Permits,
    PoolClient,
    Restore,
    Server,
    ServerPool,
    rollout_seed,
)
from beam_rl.envs.base import Completion, Environment, SamplingParams, Trajectory
from beam_rl.inference.client import (
    InferenceClient,
    InferenceConnectionError,
    InferenceHTTPError,
    ServerLoad,
)
from beam_rl.inference.inflight import UpdateTiming
from beam_rl.types import GroupRequest, Rollout, RolloutStatus, Turn, make_group_id

pytestmark = pytest.mark.timeout(60)

SAMPLING = {"math": SamplingParams(max_tokens=16, temperature=0.7), "chat": SamplingParams(max_tokens=8)}


@dataclass(eq=False)
class Call:
    server: str
    prompt_ids: list[int]
    sampling: SamplingParams
    n: int
    partial: list[Completion] | None = None  # what a failed server had streamed, passed on by a re-dispatch
    progress: Any = None  # the launch's Progress, which a real client updates as tokens arrive
    release: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: bool = False

    @property
    def group_index(self) -> int:
        return self.prompt_ids[0] - 100  # FakeEnv renders row q as [100 + q, 1]


Behaviour = Callable[[Call], Awaitable[list[Completion] | None]]


class Tracker:
    """Shared by all fake servers: every call in start order, and concurrency in rollouts."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.active = 0
        self.peak = 0


class FakeClient:
    """A PoolClient: an idle server that never restarts, whose calls `behave` decides."""

    def __init__(self, url: str, tracker: Tracker, behave: Behaviour | None = None) -> None:
        self.base_url = url
        self.tracker = tracker
        self.behave = behave
        self.healthy = True
        self.tokens_received = 0

    async def complete(self, prompt_ids: list[int], sampling: SamplingParams, n: int = 1, *,
                       partial: list[Completion] | None = None, progress: Any = None) -> list[Completion]:
        call = Call(self.base_url, list(prompt_ids), sampling, n, partial, progress)
        self.tracker.calls.append(call)
        self.tracker.active += n
        self.tracker.peak = max(self.tracker.peak, self.tracker.active)
        try:
            result = await self.behave(call) if self.behave else None
            if result is not None:
                return result
            return [Completion([7, 8, 2], [-0.1, -0.2, -0.3], "stop") for _ in range(n)]
        except asyncio.CancelledError:
            call.cancelled = True
            raise
        finally:
            self.tracker.active -= n

    async def health(self) -> bool:
        return self.healthy

    async def load(self) -> ServerLoad:
        return ServerLoad()

    async def restarted(self) -> bool:
        return False

    async def update_weights(self, path: Any, version: int, mode: str = "keep", *, drain_quiet_s: float = 0.0,
                             timeout_s: float | None = None) -> UpdateTiming:
        return UpdateTiming(self.base_url, mode, version, 0.0, 0.0)

    async def aclose(self) -> None:
        pass

    def retire(self) -> None:
        pass


def test_the_inference_client_and_the_fake_are_pool_clients():
    assert isinstance(InferenceClient("http://s0"), PoolClient)
    assert isinstance(FakeClient("http://s0", Tracker()), PoolClient)


class FakeEnv(Environment):
    name = "math"

    def __init__(self, name: str = "math", multi_turn: bool = False) -> None:
        super().__init__(tokenizer=None)
        self.name, self.multi_turn = name, multi_turn

    def load_rows(self, split: str = "train") -> list[dict[str, Any]]:
        return []

    def render_prompt(self, row: dict[str, Any]) -> list[int]:
        if row.get("bad"):
            raise KeyError("question")
        return [100 + row["q"], 1]

    def decode(self, token_ids: list[int]) -> str:
        return " ".join(map(str, token_ids))

    def reward(self, row: dict[str, Any], trajectory: Trajectory) -> float:
        return 1.0 if self.final_text(trajectory).startswith("7 ") else 0.0


class Outbox(list):
    """The dispatcher's `emit` in tests: collects every rollout it emits."""


async def completed(dispatcher: Dispatcher, timeout: float) -> list[Rollout]:
    """Rollouts emitted since the last call; waits up to `timeout` for one (or for a wake)."""
    outbox = dispatcher.outbox
    if not outbox:
        await dispatcher.wait_for_work(timeout)
    out = list(outbox)
    outbox.clear()
    return out


def groups(count: int, size: int, env: str = "math", start: int = 0) -> list[GroupRequest]:
    return [GroupRequest(make_group_id(0, i), 0, i, env, size, {"q": i}) for i in range(start, start + count)]


async def gated(call: Call) -> None:
    await call.release.wait()


def make(
    n_servers: int,
    max_inflight: int,
    requests: list[GroupRequest],
    behave: Behaviour | None = None,
    modes: dict[str, str] | None = None,
    version: list[int] | None = None,
    seed: int = 0,
    max_redispatches: int = 3,
    max_regenerations: int = 2,
    **dispatcher_kwargs: Any,
) -> tuple[Dispatcher, Tracker]:
    tracker = Tracker()
    clients = [FakeClient(f"http://s{i}", tracker, behave) for i in range(n_servers)]
    version = version if version is not None else [0]
    outbox = Outbox()
    dispatcher = Dispatcher(
        clients,
        {"math": FakeEnv()},
        modes or {"math": "rollout"},
        SAMPLING,
        max_inflight,
        lambda: version[0],
        outbox.append,
        seed=seed,
        max_redispatches=max_redispatches,
        max_regenerations=max_regenerations,
        **dispatcher_kwargs,
    )
    dispatcher.outbox = outbox
    dispatcher.add(requests)
    return dispatcher, tracker


async def collect(dispatcher: Dispatcher, expected: int, deadline_s: float = 20.0) -> list[Rollout]:
    """Drive fill/wait like the host loop until `expected` rollouts came out."""
    out: list[Rollout] = []
    deadline = time.monotonic() + deadline_s
    while len(out) < expected:
        assert time.monotonic() < deadline, f"only {len(out)} of {expected} rollouts came out"
        dispatcher.fill()
        await settle()
        out += await completed(dispatcher, 0.2)
    return out


def by_attempt(rollouts: list[Rollout]) -> dict[tuple[str, int], Rollout]:
    keys = [(r.group_id, r.attempt) for r in rollouts]
    assert len(keys) == len(set(keys)), f"a rollout was emitted twice: {sorted(keys)}"
    return dict(zip(keys, rollouts))


def started(tracker: Tracker, run_seed: int = 0) -> list[tuple[int, int]]:
    """(group index, first attempt) of every call, in start order, recovered from the seeds."""
    seeds = {rollout_seed(run_seed, make_group_id(0, g), a): (g, a) for g in range(50) for a in range(8)}
    return [seeds[c.sampling.seed] for c in tracker.calls]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


# -- permits --------------------------------------------------------------------------------------


def test_permits_refuse_more_than_capacity():
    permits = Permits(3)
    permits.take(2)
    assert permits.available == 1
    with pytest.raises(RuntimeError):
        permits.take(2)
    permits.give_back(2)
    with pytest.raises(RuntimeError):
        permits.give_back(1)
    with pytest.raises(ValueError):
        Permits(0)


def test_permit_cap_is_never_exceeded():
    async def varied(call: Call) -> None:
        await asyncio.sleep(0.001 * (len(call.prompt_ids) + call.sampling.seed % 7))

    async def main() -> None:
        dispatcher, tracker = make(3, 5, groups(12, 3), varied)
        rollouts = await collect(dispatcher, 36)
        assert tracker.peak == 5  # reached (plenty of work) and never exceeded
        assert len(by_attempt(rollouts)) == 36 and all(r.ok for r in rollouts)
        assert dispatcher.inflight == 0 and dispatcher.open_groups == []
        assert (dispatcher.counters.started, dispatcher.counters.ok) == (36, 36)

    asyncio.run(main())


# -- group affinity and server selection ------------------------------------------------------------


def test_all_attempts_of_a_group_hit_one_server():
    async def short(call: Call) -> None:
        await asyncio.sleep(0.002 * (call.sampling.seed % 3))

    async def main() -> None:
        dispatcher, tracker = make(3, 4, groups(6, 5), short)
        rollouts = await collect(dispatcher, 30)
        servers_by_group = collections.defaultdict(set)
        for call in tracker.calls:
            servers_by_group[call.group_index].add(call.server)
        for rollout in rollouts:
            servers_by_group[rollout.index].add(rollout.server)
        assert all(len(s) == 1 for s in servers_by_group.values()), servers_by_group
        assert len(set().union(*servers_by_group.values())) > 1  # groups are spread over servers

    asyncio.run(main())


def test_server_pool_selects_least_loaded_then_polled_queue_then_order():
    pool = ServerPool([FakeClient(f"http://s{i}", Tracker()) for i in range(3)])
    s0, s1, s2 = pool.servers
    assert pool.select() is s0  # all idle: pool order
    pool.started(s0, 2)
    pool.started(s1, 1)
    assert pool.select() is s2
    pool.started(s2, 1)
    assert pool.select() is s1  # s1 and s2 tie on in-flight: order
    s1.load = ServerLoad(running=4, waiting=2)
    assert pool.select() is s2  # same in-flight, but s1's polled queue is longer
    pool.finished(s0, 2)
    assert pool.select() is s0
    s0.healthy = False
    assert pool.select() is s2


def test_a_server_seen_full_is_sent_nothing_more_while_another_has_room():
    """Its slots are what it ran while requests waited at its /metrics (max_num_seqs, or fewer when its KV
    cache held them back); heterogeneous servers then fill each to its own size."""
    pool = ServerPool([FakeClient(f"http://s{i}", Tracker()) for i in range(2)])
    small, big = pool.servers
    small.observe(ServerLoad(running=8, waiting=3))
    assert small.slots == 8 and big.slots is None
    pool.started(small, 7)
    pool.started(big, 20)
    assert pool.select() is small  # one slot left: still the least loaded with room
    pool.started(small, 1)
    assert pool.select() is big  # full: what it is sent would only queue there
    big.observe(ServerLoad(running=20, waiting=1))
    assert pool.select() is small  # both full: the least loaded, as before
    small.observe(ServerLoad(running=12, waiting=0))  # it ran more without a queue: it has room again
    assert small.slots == 12 and pool.select() is small
    small.observe(ServerLoad(running=5, waiting=0))  # less running and nothing waiting says nothing of its size
    assert small.slots == 12


def test_placing_groups_on_a_thousand_servers_weighs_a_few_of_them_each_not_the_fleet(monkeypatch):
    """A fresh group goes to the least-loaded server. Found by a scan, that was two passes over the fleet a group:
    at 1,000 servers the shard's first fill() of 12,000 rollouts took 6.6 CPU seconds before any request left,
    0.8 with the pool keeping its servers on a heap by load."""
    weighed = collections.Counter()
    plain = Server.load_key

    def counted(server: Server) -> tuple[bool, float, float, int]:
        weighed[server.url] += 1
        return plain(server)

    monkeypatch.setattr(Server, "load_key", counted)

    async def main() -> None:
        dispatcher, tracker = make(1000, 4000, groups(1001, 4), gated)
        weighed.clear()
        assert dispatcher.fill() == 4000
        await settle()
        placed = collections.Counter(c.server for c in tracker.calls)
        assert len(placed) == 1000 and set(placed.values()) == {4}  # one group each: still the least loaded
        looks = sum(weighed.values())
        assert looks <= 10 * 1000  # a scan: 2 x 1,000 servers x 1,000 groups
        # A server whose rollouts finish is the least loaded again: the next group goes there.
        for call in tracker.calls:
            if call.server == "http://s567":
                call.release.set()
        assert len(await collect(dispatcher, 4)) == 4
        dispatcher.fill()
        await settle()
        assert {c.server for c in tracker.calls[4000:]} == {"http://s567"}
        await dispatcher.aclose()

    asyncio.run(main())


def test_dispatcher_sends_a_fresh_group_to_the_least_loaded_server():
    async def main() -> None:
        source = groups(3, 1)
        dispatcher, tracker = make(3, 3, source, gated)
        dispatcher.fill()
        await settle()
        assert [c.server for c in tracker.calls] == ["http://s0", "http://s1", "http://s2"]
        tracker.calls[1].release.set()  # s1 frees up
        (done,) = await completed(dispatcher, 5)
        assert done.server == "http://s1"
        dispatcher.add(groups(1, 1, start=3))
        dispatcher.fill()
        await settle()
        assert tracker.calls[-1].server == "http://s1"
        await dispatcher.aclose()

    asyncio.run(main())


# -- open groups first --------------------------------------------------------------------------------


def test_open_groups_are_continued_before_fresh_ones():
    held = True

    async def hold(call: Call) -> None:
        if held:
            await call.release.wait()

    async def main() -> None:
        nonlocal held
        source = groups(3, 3)
        dispatcher, tracker = make(2, 2, source, hold)
        dispatcher.fill()
        await settle()
        assert started(tracker) == [(0, 0), (0, 1)] and dispatcher.counters.groups_admitted == 1
        tracker.calls[0].release.set()
        await completed(dispatcher, 5)
        dispatcher.fill()
        await settle()
        assert started(tracker)[2] == (0, 2) and dispatcher.counters.groups_admitted == 1  # group 0 continued first
        tracker.calls[1].release.set()
        await completed(dispatcher, 5)
        dispatcher.fill()
        await settle()
        assert started(tracker)[3] == (1, 0) and dispatcher.counters.groups_admitted == 2
        held = False
        for call in tracker.calls:
            call.release.set()
        rollouts = await collect(dispatcher, 7)  # 2 already collected above
        assert len(rollouts) == 7
        assert started(tracker) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]

    asyncio.run(main())


# -- exactly-once emission ------------------------------------------------------------------------


def test_every_started_rollout_leaves_exactly_once_with_its_status():
    async def scripted(call: Call) -> list[Completion] | None:
        g, a = started_of(call)
        if (g, a) == (1, 0):
            raise InferenceHTTPError("http://s0/v1/completions: HTTP 500: boom", "http://s0", 500)
        if (g, a) == (1, 1):
            raise ValueError("env parser broke")
        if (g, a) == (2, 0):
            return [Completion([], [], "stop")]
        if g == 3:
            await asyncio.sleep(60)
        return None

    seeds = {rollout_seed(0, make_group_id(0, g), a): (g, a) for g in range(4) for a in range(2)}

    def started_of(call: Call) -> tuple[int, int]:
        return seeds[call.sampling.seed]

    async def main() -> None:
        dispatcher, tracker = make(2, 8, groups(4, 2), scripted)
        rollouts = await collect(dispatcher, 6)
        assert dispatcher.open_groups == [make_group_id(0, 3)] and dispatcher.inflight == 2
        assert dispatcher.cancel_groups([make_group_id(0, 3), "e9-i9"]) == [make_group_id(0, 3)]
        rollouts += await collect(dispatcher, 2)
        assert await completed(dispatcher, 0.05) == []  # nothing leaves twice
        got = by_attempt(rollouts)
        status = {(int(g.split("-i")[1]), a): r.status for (g, a), r in got.items()}
        assert status == {
            (0, 0): RolloutStatus.OK,
            (0, 1): RolloutStatus.OK,
            (1, 0): RolloutStatus.ERROR,
            (1, 1): RolloutStatus.ERROR,
            (2, 0): RolloutStatus.ERROR,
            (2, 1): RolloutStatus.OK,
            (3, 0): RolloutStatus.CANCELLED,
            (3, 1): RolloutStatus.CANCELLED,
        }
        assert got[make_group_id(0, 1), 0].errors == [
            "InferenceHTTPError: http://s0/v1/completions: HTTP 500: boom"
        ]
        assert got[make_group_id(0, 1), 1].errors == ["ValueError: env parser broke"]
        assert got[make_group_id(0, 2), 0].errors[0].startswith("EmptyTrajectory")
        assert all(c.cancelled for c in tracker.calls if c.group_index == 3)
        counters = dispatcher.counters
        assert (counters.started, counters.ok, counters.errored, counters.cancelled) == (8, 3, 3, 2)
        assert dispatcher.inflight == 0 and dispatcher.open_groups == []

    asyncio.run(main())


def test_cancelling_emits_unstarted_attempts_too_and_returns_permits_after_unwinding():
    async def main() -> None:
        dispatcher, tracker = make(1, 2, groups(1, 4), gated)
        dispatcher.fill()
        await settle()
        assert len(tracker.calls) == 2
        dispatcher.cancel_groups([make_group_id(0, 0)])
        unstarted = await completed(dispatcher, 0)
        assert sorted(r.attempt for r in unstarted) == [2, 3]
        assert all(r.status is RolloutStatus.CANCELLED and r.prompt_ids == [100, 1] for r in unstarted)
        assert dispatcher.inflight == 2  # running calls keep their permits until they unwind
        running = await collect(dispatcher, 2)
        assert sorted(r.attempt for r in running) == [0, 1]
        assert all(r.status is RolloutStatus.CANCELLED for r in running)
        assert dispatcher.inflight == 0 and len(tracker.calls) == 2 and tracker.active == 0
        assert dispatcher.open_groups == []

    asyncio.run(main())


def test_cancel_stale_cancels_groups_started_on_an_old_policy():
    async def main() -> None:
        version = [0]
        source = groups(1, 2)
        dispatcher, tracker = make(2, 8, source, gated, version=version)
        dispatcher.fill()
        await settle()
        version[0] = 1
        dispatcher.add(groups(1, 2, start=1))
        dispatcher.fill()
        await settle()
        assert dispatcher.cancel_stale(1) == [make_group_id(0, 0)]
        for call in tracker.calls[2:]:
            call.release.set()
        got = by_attempt(await collect(dispatcher, 4))
        old, new = make_group_id(0, 0), make_group_id(0, 1)
        assert [got[old, a].status for a in (0, 1)] == [RolloutStatus.CANCELLED] * 2
        assert [(got[old, a].policy_version_start, got[old, a].policy_version_end) for a in (0, 1)] == [
            (0, 1)
        ] * 2
        assert [got[new, a].status for a in (0, 1)] == [RolloutStatus.OK] * 2
        assert [got[new, a].policy_version_start for a in (0, 1)] == [1, 1]

    asyncio.run(main())


# -- version stamps, seeds and rollout fields ------------------------------------------------------


def test_rollouts_are_stamped_with_start_and_end_policy_versions():
    async def main() -> None:
        version = [3]
        dispatcher, tracker = make(1, 4, groups(2, 1), gated, version=version)
        dispatcher.fill()
        await settle()
        tracker.calls[0].release.set()
        (steady,) = await collect(dispatcher, 1)
        version[0] = 5
        tracker.calls[1].release.set()
        (updated,) = await collect(dispatcher, 1)
        assert (steady.policy_version_start, steady.policy_version_end) == (3, 3)
        assert (updated.policy_version_start, updated.policy_version_end) == (3, 5)
        # A client that reports no version per token: exact only when no update happened during the launch.
        assert [t.policy_versions for t in steady.turns] == [[3, 3, 3]]
        assert [t.policy_versions for t in updated.turns] == [[-1, -1, -1]]

    asyncio.run(main())


def test_token_versions_the_client_reports_reach_turns_an_environment_built_itself():
    class TwoTurns(FakeEnv):
        """Builds its turns from copies of the completions' tokens and never passes their versions on,
        as a plug-in environment may."""

        async def run(self, client, row, prompt_ids, sampling):
            turns = []
            for _ in range(2):
                (c,) = await client.complete(prompt_ids, sampling)
                turns.append(Turn(list(c.token_ids), list(c.logprobs), c.finish_reason))
            return Trajectory(turns)

    replies = iter([[4, 5], [6, 7, 8]])

    async def versioned(call: Call) -> list[Completion]:
        ids = next(replies)
        return [Completion(ids, [-0.5] * len(ids), "stop", [2] * (len(ids) - 1) + [3])]

    async def main() -> None:
        dispatcher, _ = make(1, 1, groups(1, 1), versioned, version=[2])
        dispatcher.envs["math"] = TwoTurns()
        (rollout,) = await collect(dispatcher, 1)
        assert [t.policy_versions for t in rollout.turns] == [[2, 3], [2, 2, 3]]
        assert (rollout.token_version_min, rollout.token_version_max) == (2, 3)

    asyncio.run(main())


def test_token_versions_a_trajectory_reports_are_kept():
    class Reporting(FakeEnv):
        async def run(self, client, row, prompt_ids, sampling):
            trajectory = await super().run(client, row, prompt_ids, sampling)
            trajectory.turns[0].policy_versions = [1, 2, 2]
            return trajectory

    async def main() -> None:
        dispatcher, _ = make(1, 1, groups(1, 1), version=[2])
        dispatcher.envs["math"] = Reporting()
        (rollout,) = await collect(dispatcher, 1)
        assert rollout.turns[0].policy_versions == [1, 2, 2] and rollout.token_version_min == 1

    asyncio.run(main())


def test_the_timeline_admitted_sent_finished():
    async def main() -> None:
        # One permit: the second group is admitted only once the first one's rollout finished.
        dispatcher, _ = make(1, 1, groups(2, 1))
        first, second = sorted(await collect(dispatcher, 2), key=lambda r: r.index)
        for r in (first, second):
            assert 0 < r.t_admitted <= r.t_sent <= r.t_finished
            assert r.t_first_token is None and r.t_scored is None  # not reported yet; stamped by scoring
        assert second.t_admitted >= first.t_finished
        dispatcher.add(groups(1, 2, start=5))
        assert dispatcher.cancel_waiting({make_group_id(0, 5)}) == [make_group_id(0, 5)]
        never = await collect(dispatcher, 2)
        assert [r.t_admitted for r in never] == [None, None]  # cancelled before the dispatcher opened the group

    asyncio.run(main())


def test_each_attempt_gets_a_distinct_seed_derived_from_run_seed_group_and_attempt():
    assert rollout_seed(7, "e0-i1", 2) == rollout_seed(7, "e0-i1", 2)
    assert rollout_seed(7, "e0-i1", 2) != rollout_seed(8, "e0-i1", 2)
    assert 0 <= rollout_seed(7, "e0-i1", 2) < 2**31

    async def main() -> None:
        dispatcher, tracker = make(2, 16, groups(3, 4), seed=7)
        await collect(dispatcher, 12)
        seeds = [c.sampling.seed for c in tracker.calls]
        assert len(set(seeds)) == 12
        assert set(seeds) == {rollout_seed(7, make_group_id(0, g), a) for g in range(3) for a in range(4)}
        assert {c.sampling.max_tokens for c in tracker.calls} == {16}  # the env's params, only the seed set

    asyncio.run(main())


def test_rollout_carries_group_prompt_trajectory_and_provenance():
    async def main() -> None:
        request = GroupRequest(make_group_id(2, 5), 2, 5, "math", 1, {"q": 5})
        dispatcher, _ = make(1, 1, [request])
        (r,) = await collect(dispatcher, 1)
        assert (r.group_id, r.env_name, r.attempt, r.group_size, r.epoch, r.index) == (
            "e2-i5",
            "math",
            0,
            1,
            2,
            5,
        )
        assert r.prompt_ids == [105, 1]
        assert [(t.completion_ids, t.logprobs, t.finish_reason) for t in r.turns] == [
            ([7, 8, 2], [-0.1, -0.2, -0.3], "stop")
        ]
        # Generation only: the row travels with the rollout, and the scoring stage rewards it.
        assert r.row == {"q": 5} and r.reward == 0.0 and r.ok and r.errors == []
        assert r.server == "http://s0" and r.temperature == 0.7
        assert 0 < r.t_admitted <= r.t_sent <= r.t_finished

    asyncio.run(main())


# -- group mode -------------------------------------------------------------------------------------


def test_group_mode_runs_one_call_holding_group_size_permits():
    async def main() -> None:
        source = groups(2, 4)
        dispatcher, tracker = make(2, 6, source, gated, modes={"math": "group"})
        dispatcher.fill()
        await settle()
        assert [c.n for c in tracker.calls] == [4] and dispatcher.inflight == 4
        assert dispatcher.counters.groups_admitted == 2 and dispatcher.open_groups == [make_group_id(0, 0), make_group_id(0, 1)]
        tracker.calls[0].release.set()
        first = await completed(dispatcher, 5)
        assert sorted(r.attempt for r in first) == [0, 1, 2, 3] and all(r.ok for r in first)
        assert {r.policy_version_start for r in first} == {0}
        dispatcher.fill()
        await settle()
        assert [c.n for c in tracker.calls] == [4, 4] and dispatcher.inflight == 4
        assert tracker.calls[1].sampling.seed == rollout_seed(0, make_group_id(0, 1), 0)
        tracker.calls[1].release.set()
        assert len(await collect(dispatcher, 4)) == 4

    asyncio.run(main())


def test_a_group_calls_finished_choices_give_their_permits_back_while_its_longest_generates():
    """A slot whose rollout the server finished takes other work (the next group's call) while the group's
    longest rollout still generates; the call's last permit comes back when the call ends."""

    async def main() -> None:
        dispatcher, tracker = make(1, 6, groups(2, 4), gated, modes={"math": "group"})
        dispatcher.fill()
        await settle()
        first = tracker.calls[0]
        assert [c.n for c in tracker.calls] == [4] and dispatcher.inflight == 4  # 2 free: group 1 waits
        for choice in (0, 1, 2, 1):  # three of its four end (one of them told twice); the fourth generates on
            first.progress.choice_ended(choice)
        assert dispatcher.inflight == 1 and dispatcher.pool.servers[0].inflight == 1
        dispatcher.fill()
        await settle()
        assert [c.n for c in tracker.calls] == [4, 4] and dispatcher.inflight == 5
        first.progress.choice_ended(3)  # its last: it comes back with the call
        assert dispatcher.inflight == 5
        first.release.set()
        assert sorted(r.attempt for r in await completed(dispatcher, 5)) == [0, 1, 2, 3]
        assert dispatcher.inflight == 4 and dispatcher.pool.servers[0].inflight == 4
        tracker.calls[1].release.set()
        assert len(await collect(dispatcher, 4)) == 4
        assert dispatcher.inflight == 0 and dispatcher.pool.servers[0].inflight == 0

    asyncio.run(main())


def test_a_group_call_of_an_environment_that_calls_again_keeps_its_permits_to_the_end():
    class TwoCalls(FakeEnv):
        async def run_group(self, client, row, prompt_ids, sampling, n):  # type: ignore[override]
            await client.complete(prompt_ids, sampling, n=n)  # a first pass, then the answers
            return [self._single_turn(row, c) for c in await client.complete(prompt_ids, sampling, n=n)]

    async def main() -> None:
        dispatcher, tracker = make(1, 6, groups(2, 4), gated, modes={"math": "group"})
        dispatcher.envs["math"] = TwoCalls()
        dispatcher.fill()
        await settle()
        for choice in range(3):
            tracker.calls[0].progress.choice_ended(choice)
        dispatcher.fill()
        await settle()
        assert len(tracker.calls) == 1 and dispatcher.inflight == 4

    asyncio.run(main())


def test_group_mode_failure_emits_one_errored_placeholder_per_permit():
    async def fail(call: Call) -> None:
        raise InferenceConnectionError("http://s0/v1/completions: connection failed", "http://s0")

    async def main() -> None:
        dispatcher, _ = make(1, 4, groups(1, 3), fail, modes={"math": "group"}, max_redispatches=0)
        rollouts = await collect(dispatcher, 3)
        assert sorted(r.attempt for r in rollouts) == [0, 1, 2]
        assert all(r.status is RolloutStatus.ERROR and "connection failed" in r.errors[0] for r in rollouts)

    asyncio.run(main())


def test_group_mode_rejects_multi_turn_envs_and_groups_larger_than_the_cap():
    with pytest.raises(ValueError, match="multi-turn"):
        Dispatcher(
            [FakeClient("http://s0", Tracker())],
            {"chat": FakeEnv("chat", multi_turn=True)},
            {"chat": "group"},
            SAMPLING,
            4,
            lambda: 0,
            Outbox().append,
        )

    async def main() -> None:
        dispatcher, tracker = make(1, 2, groups(1, 3), modes={"math": "group"})
        rollouts = await collect(dispatcher, 3)
        assert all("GroupTooLarge" in r.errors[0] for r in rollouts) and tracker.calls == []

    asyncio.run(main())


# -- bad input and sick servers ---------------------------------------------------------------------


def test_a_group_that_cannot_start_leaves_as_errors_and_the_run_continues():
    async def main() -> None:
        bad = GroupRequest(make_group_id(0, 1), 0, 1, "math", 2, {"bad": True})
        unknown = GroupRequest(make_group_id(0, 2), 0, 2, "nope", 1, {"q": 2})
        dispatcher, _ = make(1, 4, [bad, unknown, *groups(1, 2, start=3)])
        got = by_attempt(await collect(dispatcher, 5))
        assert [got[bad.group_id, a].errors[0][:37] for a in (0, 1)] == [
            "PromptRenderError: env 'math' row 1 ("
        ] * 2
        assert got[unknown.group_id, 0].errors[0].startswith("UnknownEnvironment: 'nope'")
        rejected = got[unknown.group_id, 0]  # admitted and given up at once, never sent
        assert rejected.t_admitted == rejected.t_sent == rejected.t_finished and rejected.t_admitted > 0
        assert [got[make_group_id(0, 3), a].ok for a in (0, 1)] == [True, True]

    asyncio.run(main())


def test_failing_server_is_marked_unhealthy_skipped_and_reprobed():
    async def s0_down(call: Call) -> None:
        if call.server == "http://s0":
            raise InferenceConnectionError("http://s0: connection refused", "http://s0")

    async def main() -> None:
        source = groups(5, 1)
        dispatcher, _ = make(2, 1, source, s0_down, unhealthy_after=2, reprobe_s=0.0, max_redispatches=0)
        rollouts = await collect(dispatcher, 5)
        assert [(r.server, r.status) for r in rollouts] == [
            ("http://s0", RolloutStatus.ERROR),
            ("http://s0", RolloutStatus.ERROR),
            ("http://s1", RolloutStatus.OK),
            ("http://s1", RolloutStatus.OK),
            ("http://s1", RolloutStatus.OK),
        ]
        s0 = dispatcher.pool.servers[0]
        assert not s0.healthy
        s0.client.healthy = False
        await dispatcher.pool.refresh()
        assert not s0.healthy
        s0.client.behave = None
        s0.client.healthy = True
        await dispatcher.pool.refresh()
        assert s0.healthy and s0.consecutive_failures == 0
        dispatcher.add(groups(1, 1, start=5))
        (back,) = await collect(dispatcher, 1)
        assert back.server == "http://s0" and back.ok

    asyncio.run(main())


def test_a_refused_connection_takes_a_server_out_at_once():
    # Nothing listening is not a slow or sick server: it is down, whatever unhealthy_after says.
    async def s0_gone(call: Call) -> None:
        if call.server == "http://s0":
            raise InferenceConnectionError("http://s0: cannot connect", "http://s0", refused=True)

    async def main() -> None:
        dispatcher, _ = make(2, 1, groups(4, 1), s0_gone, unhealthy_after=3, reprobe_s=60.0, max_redispatches=0)
        rollouts = await collect(dispatcher, 4)
        assert [(r.server, r.ok) for r in rollouts] == [
            ("http://s0", False), ("http://s1", True), ("http://s1", True), ("http://s1", True)]
        assert not dispatcher.pool.servers[0].healthy

    asyncio.run(main())


def test_group_moves_off_its_pinned_server_when_that_server_turns_unhealthy():
    async def s0_down(call: Call) -> None:
        if call.server == "http://s0":
            raise InferenceConnectionError("http://s0: connection refused", "http://s0")

    async def main() -> None:
        dispatcher, _ = make(2, 1, groups(1, 3), s0_down, unhealthy_after=1, max_redispatches=0)
        rollouts = await collect(dispatcher, 3)
        assert [(r.attempt, r.server, r.ok) for r in rollouts] == [
            (0, "http://s0", False),
            (1, "http://s1", True),
            (2, "http://s1", True),
        ]

    asyncio.run(main())


def test_request_errors_do_not_count_against_a_servers_health():
    async def bad_request(call: Call) -> None:
        raise InferenceHTTPError("http://s0/v1/completions: HTTP 400: prompt too long", "http://s0", 400)

    async def main() -> None:
        dispatcher, _ = make(1, 1, groups(3, 1), bad_request, unhealthy_after=1)
        rollouts = await collect(dispatcher, 3)
        assert all(r.status is RolloutStatus.ERROR for r in rollouts)
        assert dispatcher.pool.servers[0].healthy

    asyncio.run(main())


# -- re-dispatch on a failed server ------------------------------------------------------------------


def _streamed_then_failed(ids: list[int], version: int) -> InferenceConnectionError:
    """What InferenceClient raises when its server dies mid-stream: the error with the tokens it had."""
    error = InferenceConnectionError("http://s0/v1/completions: connection failed mid-stream", "http://s0")
    error.partial = [Completion(list(ids), [-0.1] * len(ids), None, [version] * len(ids))]
    return error


def test_a_rollout_whose_server_dies_continues_on_another_from_the_tokens_it_streamed():
    async def s0_dies(call: Call) -> list[Completion] | None:
        if call.server == "http://s0":
            call.progress.received(0, 2, 0)
            raise _streamed_then_failed([7, 8], version=0)
        if call.partial:  # continued from the dead server's tokens, as a real client does
            (before,) = call.partial
            return [Completion(before.token_ids + [9, 2], before.logprobs + [-0.3, -0.4], "stop",
                               before.policy_versions + [0, 0])]
        return None

    async def main() -> None:
        dispatcher, tracker = make(2, 1, groups(1, 3), s0_dies, unhealthy_after=1)
        got = by_attempt(await collect(dispatcher, 3))
        first = got[make_group_id(0, 0), 0]
        assert first.ok and first.server == "http://s1" and first.errors == []
        assert first.turns[0].completion_ids == [7, 8, 9, 2] and first.turns[0].policy_versions == [0, 0, 0, 0]
        assert first.discarded_tokens["server_failure"] == 0  # nothing streamed was thrown away
        # The group's affinity moved with it: the later attempts went straight to s1.
        assert [c.server for c in tracker.calls] == ["http://s0", "http://s1", "http://s1", "http://s1"]
        assert tracker.calls[1].partial[0].token_ids == [7, 8]
        assert all(r.ok and r.server == "http://s1" for r in got.values())
        assert dispatcher.counters.redispatched == 1 and dispatcher.pool.servers[0].inflight == 0
        assert dispatcher.pool.servers[1].inflight == 0 and dispatcher.inflight == 0

    asyncio.run(main())


def test_re_dispatch_is_bounded_then_the_rollout_is_an_error_counting_the_tokens_lost():
    async def always_dies(call: Call) -> None:
        call.progress.received(0, 1, 0)
        raise _streamed_then_failed([7] * (len(call.partial[0].token_ids) + 1 if call.partial else 1), 0)

    async def main() -> None:
        dispatcher, tracker = make(3, 1, groups(1, 1), always_dies, max_redispatches=2)
        (rollout,) = await collect(dispatcher, 1)
        assert rollout.status is RolloutStatus.ERROR and "connection failed mid-stream" in rollout.errors[0]
        assert len(tracker.calls) == 3  # the first server and two re-dispatches
        servers = [c.server for c in tracker.calls]
        assert all(a != b for a, b in zip(servers, servers[1:]))  # each time off the server that failed
        assert rollout.discarded_tokens == {"stale": 0, "server_failure": 3, "cancelled": 0, "errored": 0}
        assert dispatcher.counters.redispatched == 2

    asyncio.run(main())


def test_a_bad_request_is_not_re_dispatched():
    async def bad_request(call: Call) -> None:
        raise InferenceHTTPError("http://s0/v1/completions: HTTP 400: prompt too long", "http://s0", 400)

    async def main() -> None:
        dispatcher, tracker = make(2, 1, groups(1, 1), bad_request)
        (rollout,) = await collect(dispatcher, 1)
        assert rollout.status is RolloutStatus.ERROR and len(tracker.calls) == 1
        assert dispatcher.counters.redispatched == 0

    asyncio.run(main())


def test_with_every_server_down_a_re_dispatch_waits_for_one_to_come_back():
    down = {"http://s0", "http://s1"}

    async def while_down(call: Call) -> None:
        if call.server in down:
            raise InferenceConnectionError(f"{call.server}: cannot connect", call.server, refused=True)

    async def main() -> None:
        dispatcher, tracker = make(2, 2, groups(1, 1), while_down, reprobe_s=0.0)
        dispatcher.fill()
        await asyncio.sleep(0.1)
        assert [c.server for c in tracker.calls] == ["http://s0", "http://s1"] and dispatcher.inflight == 1
        assert not any(s.healthy for s in dispatcher.pool.servers)  # the launch waits, holding its permit
        down.discard("http://s1")
        dispatcher.pool.servers[0].client.healthy = False  # what s0's /health still says
        await dispatcher.pool.refresh()  # the thread host's re-probe
        (rollout,) = await collect(dispatcher, 1)
        assert rollout.ok and rollout.server == "http://s1" and dispatcher.counters.redispatched == 2

    asyncio.run(main())


# -- regeneration of too-stale rollouts ---------------------------------------------------------------


def test_a_rollout_made_too_stale_by_new_weights_is_generated_again_and_its_group_still_trains():
    async def streams_three_then_waits(call: Call) -> None:
        call.progress.received(0, 3, version[0])  # tokens of the policy serving now
        await call.release.wait()

    version = [0]

    async def main() -> None:
        dispatcher, tracker = make(1, 4, groups(1, 2), streams_three_then_waits, version=version)
        dispatcher.fill()
        await settle()
        tracker.calls[0].release.set()
        (finished,) = await completed(dispatcher, 5)  # attempt 0 is done before the update
        version[0] = 3  # new weights: with max_off_policy_steps 1, tokens older than version 2 cannot train
        assert dispatcher.regenerate_stale(3 - 1) == (1, 0)
        await settle()
        assert [c.cancelled for c in tracker.calls] == [False, True]
        assert dispatcher.open_groups == [make_group_id(0, 0)] and dispatcher.counters.regenerated == 1
        dispatcher.fill()
        await settle()
        again = tracker.calls[2]
        assert again.sampling.seed == tracker.calls[1].sampling.seed  # the same attempt, started again
        again.release.set()
        (regenerated,) = await collect(dispatcher, 1)
        assert (finished.attempt, regenerated.attempt) == (0, 1) and finished.ok and regenerated.ok
        assert regenerated.policy_version_start == 3 and regenerated.discarded_tokens["stale"] == 3
        assert finished.discarded_tokens["stale"] == 0 and dispatcher.open_groups == []
        assert dispatcher.counters.cancelled == 0

    asyncio.run(main())


def test_a_rollout_still_too_stale_after_its_regenerations_is_cancelled_and_counted():
    version = [0]

    async def streams_then_waits(call: Call) -> None:
        call.progress.received(0, 2, version[0])
        await call.release.wait()

    async def main() -> None:
        dispatcher, tracker = make(1, 1, groups(1, 1), streams_then_waits, version=version, max_regenerations=1)
        dispatcher.fill()
        await settle()
        version[0] = 2
        assert dispatcher.regenerate_stale(2) == (1, 0)
        await settle()
        dispatcher.fill()
        await settle()
        assert len(tracker.calls) == 2
        assert dispatcher.regenerate_stale(2) == (0, 0)  # its new tokens are version 2's: inside the bound
        version[0] = 4
        assert dispatcher.regenerate_stale(4) == (0, 1)
        (rollout,) = await collect(dispatcher, 1)
        assert rollout.status is RolloutStatus.CANCELLED and len(tracker.calls) == 2
        assert rollout.discarded_tokens == {"stale": 4, "server_failure": 0, "cancelled": 0, "errored": 0}
        assert dispatcher.counters.cancelled_stale == 1 and dispatcher.counters.regenerated == 1

    asyncio.run(main())


@pytest.mark.parametrize("rule, handled, counted", [
    ("regenerate", (2, 0), {"regenerated": 2, "cancelled_stale": 0}),
    ("cancel_group", (0, 2), {"regenerated": 0, "cancelled_stale": 2}),
])
def test_the_stale_rule_says_whether_new_weights_regenerate_rollouts_or_cancel_their_group(rule, handled, counted):
    version = [0]

    async def streams_then_waits(call: Call) -> None:
        call.progress.received(0, 2, version[0])
        await call.release.wait()

    async def main() -> None:
        dispatcher, tracker = make(1, 4, groups(1, 2), streams_then_waits, version=version, stale_rule=rule)
        dispatcher.fill()
        await settle()
        version[0] = 2
        assert dispatcher.handle_stale(2) == handled
        await settle()
        assert {k: getattr(dispatcher.counters, k) for k in counted} == counted
        assert [c.cancelled for c in tracker.calls] == [True, True]
        if rule == "cancel_group":  # the whole group leaves, cancelled
            assert dispatcher.open_groups == []
            assert [r.status for r in await collect(dispatcher, 2)] == [RolloutStatus.CANCELLED] * 2
        else:  # the group stays open and both attempts start again
            assert dispatcher.open_groups == [make_group_id(0, 0)]
            assert dispatcher.fill() == 2

    asyncio.run(main())


def test_an_unknown_stale_rule_is_refused():
    with pytest.raises(ValueError, match="stale_rule"):
        make(1, 1, [], stale_rule="drop")


def test_cancelled_rollouts_count_their_streamed_tokens_as_cancelled():
    async def streams_then_waits(call: Call) -> None:
        call.progress.received(0, 5, 0)
        await call.release.wait()

    async def main() -> None:
        dispatcher, _ = make(1, 2, groups(1, 3), streams_then_waits)
        dispatcher.fill()
        await settle()
        dispatcher.cancel_groups([make_group_id(0, 0)])
        got = by_attempt(await collect(dispatcher, 3))
        assert [got[make_group_id(0, 0), a].discarded_tokens["cancelled"] for a in range(3)] == [5, 5, 0]
        assert all(r.status is RolloutStatus.CANCELLED for r in got.values())

    asyncio.run(main())


# -- the thread host ---------------------------------------------------------------------------------


def host(
    max_inflight: int, behave: Behaviour | None = None, n_servers: int = 2
) -> tuple[DispatcherThread, Tracker]:
    tracker = Tracker()

    def build(emit: Callable[[Rollout], None], restore: Restore) -> Dispatcher:
        clients = [FakeClient(f"http://s{i}", tracker, behave) for i in range(n_servers)]
        return Dispatcher(
            clients,
            {"math": FakeEnv()},
            {"math": "rollout"},
            SAMPLING,
            max_inflight,
            lambda: 0,
            emit,
            restore=restore,
        )

    return DispatcherThread(build, tick_s=0.05), tracker


def poll_until(thread: DispatcherThread, expected: int, deadline_s: float = 20.0) -> list[Rollout]:
    out: list[Rollout] = []
    deadline = time.monotonic() + deadline_s
    while len(out) < expected:
        assert time.monotonic() < deadline, f"only {len(out)} of {expected} rollouts came out"
        out += thread.poll(0.2)
    return out


def test_thread_host_runs_the_dispatcher_for_synchronous_callers():
    async def hang_group_9(call: Call) -> None:
        await asyncio.sleep(60 if call.group_index == 9 else 0.001)

    thread, tracker = host(4, hang_group_9)
    with thread:
        assert thread.poll(0) == []
        thread.add_groups(groups(5, 3))
        with pytest.raises(ValueError, match="e0-i0"):
            thread.add_groups(groups(1, 3))
        ok = poll_until(thread, 15)
        assert len(by_attempt(ok)) == 15 and all(r.ok for r in ok)
        assert thread.inflight_groups() == []

        thread.add_groups(groups(1, 4, start=9))  # takes every permit and hangs
        thread.add_groups(groups(1, 2, start=10))  # waits for permits, never admitted
        deadline = time.monotonic() + 10
        while len([c for c in tracker.calls if c.group_index == 9]) < 4:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert thread.pending_groups() == 1
        assert sorted(thread.inflight_groups()) == [make_group_id(0, 10), make_group_id(0, 9)]
        assert sorted(thread.cancel_groups([make_group_id(0, 10), make_group_id(0, 9)])) == [
            make_group_id(0, 10),
            make_group_id(0, 9),
        ]
        cancelled = poll_until(thread, 6)
        assert len(by_attempt(cancelled)) == 6 and all(r.status is RolloutStatus.CANCELLED for r in cancelled)
        assert thread.inflight_groups() == [] and thread.pending_groups() == 0
        assert thread.counters() == {
            "started": 19,
            "ok": 15,
            "errored": 0,
            "cancelled": 6,
            "groups_admitted": 6,
            "redispatched": 0,
            "regenerated": 0,
            "cancelled_stale": 0,
            "redone_on_restart": 0,
            "resumed": 0,
            "resumed_tokens": 0,
            "inflight": 0,
            "inflight_cap": 4,
            "healthy_servers": 2,
        }
    with pytest.raises(RuntimeError, match="closed"):
        thread.poll(0)


def test_thread_host_surfaces_a_failed_build():
    def build(emit: Callable[[Rollout], None], restore: Restore) -> Dispatcher:
        raise OSError("no servers configured")

    with pytest.raises(RuntimeError, match="no servers configured"):
        DispatcherThread(build)


def test_hundreds_of_slow_calls_overlap():
    calls, call_s = 400, 0.2

    async def slow(call: Call) -> None:
        await asyncio.sleep(call_s)

    thread, tracker = host(calls, slow, n_servers=4)
    with thread:
        begin = time.monotonic()
        thread.add_groups(groups(calls // 4, 4))
        rollouts = poll_until(thread, calls, deadline_s=60)
        elapsed = time.monotonic() - begin
    assert len(by_attempt(rollouts)) == calls and all(r.ok for r in rollouts)
    assert tracker.peak == calls  # every call was in flight at once
    assert elapsed < calls * call_s / 20  # serial would take calls * call_s


def test_thread_host_with_real_clients_against_a_stub_server():
    import threading

    from aiohttp import web

    seen: list[dict[str, Any]] = []

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        await asyncio.sleep(0.01)
        choice = {
            "index": 0,
            "token_ids": [7, body["prompt"][0]],
            "logprobs": {"token_logprobs": [-0.5, -0.25]},
            "finish_reason": "stop",
        }
        return web.json_response({"choices": [choice]})

    loop = asyncio.new_event_loop()
    runner = web.AppRunner(web.Application(), shutdown_timeout=0.1)
    runner.app.router.add_post("/v1/completions", completions)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    server_thread = threading.Thread(target=loop.run_forever, daemon=True)
    server_thread.start()

    def build(emit: Callable[[Rollout], None], restore: Restore) -> Dispatcher:
        clients = [InferenceClient(url, timeout_s=10)]  # made on the dispatcher's own loop
        return Dispatcher(
            clients, {"math": FakeEnv()}, {"math": "rollout"}, SAMPLING, 8, lambda: 0, emit, seed=1,
            restore=restore,
        )

    try:
        with DispatcherThread(build, tick_s=0.05) as thread:
            thread.add_groups(groups(4, 2))
            got = by_attempt(poll_until(thread, 8))
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        server_thread.join(10)
        loop.close()
    r = got[make_group_id(0, 2), 1]
    assert r.ok and r.server == url and r.prompt_ids == [102, 1] and r.row == {"q": 2}
    assert [(t.completion_ids, t.logprobs) for t in r.turns] == [([7, 102], [-0.5, -0.25])]
    assert sorted(b["seed"] for b in seen) == sorted(
        rollout_seed(1, make_group_id(0, g), a) for g in range(4) for a in range(2)
    )
