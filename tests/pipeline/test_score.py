"""The scoring stage on Prism: async rewards of a bundle's groups run together, reward errors are masked
and counted, and a whole run with a judge that fails one time in ten trains only what was scored."""

from __future__ import annotations

import asyncio
import collections
import json
from typing import Any, List, Tuple

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pytest

from beam_rl.config import config_from_dict
from beam_rl.envs.base import Environment, RewardUnavailable, Trajectory
from beam_rl.rundir import RunDir
from beam_rl.scoring.advantages import get_algorithm
from beam_rl.standin.server import EmbeddedServer, FaultConfig
from beam_rl.types import Rollout, Turn
from runners.options import pipeline_options
from beam_rl.job.rollouts import run_rollouts
from transforms.groups import CompleteGroups
from transforms.score import EVALUATION, ScoreGroups

SIZE = 4


class SlowRewards(Environment):
    """A plug-in whose async reward takes `info["sleep"]` seconds and is its completion's first token id;
    `info["fail"]` makes it unavailable. Counts the rewards running at once (the worker is this process)."""

    name = "slow"
    running = most_running = 0

    def load_rows(self, split: str = "train") -> list[dict[str, Any]]:
        return []

    def render_prompt(self, row: dict[str, Any]) -> list[int]:
        return [1]

    async def reward(self, row: dict[str, Any], trajectory: Trajectory) -> float:
        cls = type(self)
        cls.running += 1
        cls.most_running = max(cls.most_running, cls.running)
        try:
            await asyncio.sleep(trajectory.info["sleep"])
        finally:
            cls.running -= 1
        if trajectory.info.get("fail"):
            raise RewardUnavailable("judge answered garbage")
        return float(trajectory.turns[0].completion_ids[0])


def _group(index: int, sleeps: list[float], fails: tuple[int, ...] = (), **kw: Any) -> list[Rollout]:
    return [Rollout(f"e0-i{index}", "slow", a, SIZE, prompt_ids=[1], turns=[Turn([a * a + index], [0.0], "stop")],
                    info={"sleep": s, "fail": a in fails}, index=index, **kw) for a, s in enumerate(sleeps)]


def test_the_groups_of_a_bundle_are_rewarded_together_and_reward_errors_masked(tmp_path):
    SlowRewards.running = SlowRewards.most_running = 0
    config = config_from_dict({
        "envs": [{"name": "slow", "kind": "tests.pipeline.test_score:SlowRewards", "group_size": SIZE, "algorithm": "grpo",
                  "reward": {"timeout_s": 2.0}}],
        "batch": {"rollouts_per_step": SIZE}, "filters": {"zero_advantage": {"mode": "off"}},
    })
    groups = [_group(i, [0.5] * SIZE) for i in range(4)]
    groups.append(_group(4, [0.5] * SIZE, fails=(3,)))  # one unavailable reward
    groups.append(_group(5, [0.5, 60, 0.5, 0.5]))  # one reward past the timeout
    groups.append(_group(6, [0.5] * SIZE, fails=(0, 1, 3)))  # one scored rollout left: too few
    groups.append(_group(7, [0.5] * SIZE, is_eval=True, eval_round=3))
    out = tmp_path / "scored.jsonl"

    def record(kind: str):
        def write(item) -> None:
            rollouts = item.rollouts if kind == "train" else item[1]
            with open(out, "a") as f:  # LOOPBACK: the SDK worker runs in this process
                f.write(json.dumps([kind, rollouts[0].group_id, [
                    [r.status.value, r.reward, r.advantage, r.filtered, r.errors] for r in rollouts]]) + "\n")
        return write

    with beam.Pipeline(options=pipeline_options("direct")) as p:
        scored = (p | beam.Impulse()
                  | beam.FlatMap(lambda _: [(r.group_id, [r]) for g in groups for r in g])
                  .with_output_types(Tuple[str, List[Rollout]])
                  | CompleteGroups() | ScoreGroups(config))
        _ = scored.scored | "RecordTrain" >> beam.Map(record("train"))
        _ = scored[EVALUATION] | "RecordEval" >> beam.Map(record("eval"))

    lines = [json.loads(line) for line in out.read_text().splitlines()]
    by_group = {group_id: (kind, rows) for kind, group_id, rows in lines}
    assert len(lines) == len(groups) == len(by_group)
    # The elements reached the stage together: every group's rewards were in flight at once.
    assert SlowRewards.most_running > SIZE, SlowRewards.most_running
    grpo = get_algorithm("grpo")
    for index in range(4):
        kind, rows = by_group[f"e0-i{index}"]
        rewards = [a * a + index for a in range(SIZE)]
        assert kind == "train" and [r[1] for r in rows] == rewards
        np.testing.assert_allclose([r[2] for r in rows], grpo.group_advantages(rewards), rtol=1e-6)
    for index, lost, why in [(4, 3, "RewardUnavailable: judge answered garbage"),
                             (5, 1, "RewardUnavailable: the reward took longer than 2.0 s (reward.timeout_s)")]:
        _, rows = by_group[f"e0-i{index}"]
        assert rows[lost][:2] == ["reward_error", 0.0] and rows[lost][4] == [why]
        known = [a * a + index for a in range(SIZE) if a != lost]
        np.testing.assert_allclose([r[2] for a, r in enumerate(rows) if a != lost], grpo.group_advantages(known),
                                   rtol=1e-6)
    _, rows = by_group["e0-i6"]
    assert [r[0] for r in rows] == ["reward_error", "reward_error", "ok", "reward_error"]
    assert rows[2][3] == "too_few_scored" and rows[2][2] == 0.0
    kind, rows = by_group["e0-i7"]
    assert kind == "eval" and [r[1] for r in rows] == [a * a + 7 for a in range(SIZE)]


# -- a whole run with a judge that fails one time in ten -----------------------------------------

PROMPTS, GROUP_SIZE = 32, 8
VERDICTS = [f"Reversed well enough. SCORE: {n}" for n in range(1, 10)] + ["I cannot grade this."]


@pytest.fixture(scope="module")
def judged_run(tmp_path_factory):
    generators = [EmbeddedServer(mode="instant", max_num_seqs=64) for _ in range(2)]
    judge = EmbeddedServer(mode="instant", faults=FaultConfig(replies=VERDICTS))
    urls = [s.start() for s in generators]
    judge.start()
    run_dir = tmp_path_factory.mktemp("judged-run")
    config = config_from_dict({
        "run": {"dir": str(run_dir), "max_steps": 10},
        "envs": [{"name": "reverse_text", "group_size": GROUP_SIZE, "limit": PROMPTS, "reward": {
            "timeout_s": 30.0, "judge": {
                "url": judge.url, "model": "judge", "prompt": "Reverse of {text!r}: {completion!r}. Grade it.",
                "verdict": {"pattern": r"SCORE:\s*(\d+)"}}}}],
        "batch": {"rollouts_per_step": 64},
        "inference": {"max_tokens": 8, "max_inflight": 32},
    })
    try:
        run_rollouts(config, urls, with_trainer=False)
        yield RunDir(run_dir), judge.requests_total
    finally:
        for s in [*generators, judge]:
            s.stop()


def _window_rows(run_dir: RunDir) -> list[dict[str, Any]]:
    return [row for step in run_dir.committed_steps() for row in run_dir.read_window(step).to_pylist()]


def _trained_ids(run_dir: RunDir) -> list[str]:
    ids = []
    for step in run_dir.committed_steps():
        table = pa.ipc.open_file(pa.memory_map(str(run_dir.rank_path(step, 0)))).read_all()
        ids += table.column("rollout_id").to_pylist()
    return ids


def test_a_run_with_a_failing_judge_completes_and_counts_its_reward_errors(judged_run):
    run_dir, judge_requests = judged_run
    rows = _window_rows(run_dir)
    assert len(rows) == PROMPTS * GROUP_SIZE and len({r["rollout_id"] for r in rows}) == len(rows)
    assert judge_requests == PROMPTS * GROUP_SIZE  # one grade per rollout; a bad verdict is not asked again
    failed = [r for r in rows if r["status"] == "reward_error"]
    assert len(failed) == PROMPTS * GROUP_SIZE // len(VERDICTS)  # every tenth answer of the cycle
    assert all(r["errors"] == ["RewardUnavailable: judge answer has no verdict matching 'SCORE:\\\\s*(\\\\d+)': "
                               "'I cannot grade this.'"] for r in failed)
    records = [run_dir.read_commit(step) for step in run_dir.committed_steps()]
    assert sum(c.window.status.get("reward_error", 0) for c in records) == len(failed)
    assert sum(c.window.errored for c in records) == len(failed)  # the generators never failed
    assert {r["reward"] for r in rows if r["status"] == "ok"} <= set(range(1, 10))


def test_no_rollout_without_a_reward_is_trained_and_the_rest_of_its_group_is(judged_run):
    run_dir, _ = judged_run
    rows = _window_rows(run_dir)
    trained = _trained_ids(run_dir)
    assert len(trained) == len(set(trained))
    assert set(trained) == {r["rollout_id"] for r in rows if r["status"] == "ok" and not r["filtered"]}
    by_group = collections.defaultdict(list)
    for r in rows:
        by_group[r["group_id"]].append(r)
    grpo = get_algorithm("grpo")
    masked = 0
    for group in by_group.values():
        ok = [r for r in group if r["status"] == "ok"]
        if len(ok) < len(group):
            masked += 1
            assert {r["rollout_id"] for r in ok if not r["filtered"]} <= set(trained)
        # The baseline is over the known rewards only.
        np.testing.assert_allclose([r["advantage"] for r in ok], grpo.group_advantages([r["reward"] for r in ok]),
                                   rtol=1e-5, atol=1e-6)
    assert masked >= 10  # 25 failures over 32 groups of 8
