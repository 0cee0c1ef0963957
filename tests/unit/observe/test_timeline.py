"""Rollout timelines: each stage's latency (p50/p99) over a range of steps, each server's requests stacked by
concurrency, the PNG of both, and `beam-rl report --steps A:B`."""

from __future__ import annotations

import re

import matplotlib.image
import numpy as np
import pytest

from beam_rl.observe.timeline import (
    StepRangeError,
    latency_breakdown,
    parse_steps,
    read_timelines,
    server_lanes,
    write_timeline,
)
from beam_rl.rundir import RunDir
from beam_rl.types import Rollout, RolloutStatus, TrainBatch
from tests.support.cli import RED, coloured, run_cli

_STYLE = re.compile(r"\x1b\[[0-9;]*m")
A, B = "http://127.0.0.1:8001", "http://127.0.0.1:8002"


def _rollout(attempt: int, server: str | None, sent: float, finished: float, admitted: float | None = None,
             first_token: float | None = None, scored: float | None = None, status=RolloutStatus.OK) -> Rollout:
    return Rollout("e0-i0", "arithmetic", attempt, 8, server=server, status=status, t_admitted=admitted,
                   t_sent=sent, t_first_token=first_token, t_finished=finished, t_scored=scored)


def _write(run: RunDir, step: int, rollouts: list[Rollout], packed: float) -> None:
    records = [r.record() for r in rollouts]
    for record in records:
        record.t_packed = packed
    run.write_step(TrainBatch(step=step, micro_batches=[[]], group_ids=[], window={}), window=records)


@pytest.fixture
def run(tmp_path) -> RunDir:
    """Step 1: three rollouts on A (two at once, then one), queued 1, 2 and 3 s, generating 10, 20 and 30 s;
    one never sent. Step 2: one on B, errored."""
    run = RunDir(tmp_path)
    _write(run, 1, [
        _rollout(0, A, sent=100, finished=110, admitted=99, first_token=101, scored=111),
        _rollout(1, A, sent=101, finished=121, admitted=99, scored=122),
        _rollout(2, A, sent=125, finished=155, admitted=122, first_token=127, scored=157),
        _rollout(3, None, sent=130, finished=130, status=RolloutStatus.CANCELLED),
    ], packed=160)
    _write(run, 2, [_rollout(0, B, sent=200, finished=204, admitted=199.5, scored=205,
                             status=RolloutStatus.ERROR)], packed=206)
    return run


def test_latency_of_each_stage_over_the_rollouts_that_went_through_it(run):
    stages = {s.phase: s for s in latency_breakdown(read_timelines(run, [1]))}
    queueing = stages["queueing"]
    assert (queueing.rollouts, queueing.p50_s, queueing.max_s) == (3, 2.0, 3.0)
    assert queueing.p99_s == pytest.approx(2.98)  # 2 + 0.98 * (3 - 2): linear between the ranks
    generation = stages["generation"]  # the cancelled rollout was never sent: not a generation
    assert (generation.rollouts, generation.p50_s, generation.max_s) == (3, 20.0, 30.0)
    first_token = stages["time to first token"]  # only where the server streamed it
    assert (first_token.rollouts, first_token.p50_s) == (2, 1.5)
    scoring = stages["scoring"]
    assert (scoring.rollouts, scoring.p50_s, scoring.max_s) == (3, 1.0, 2.0)
    packing = stages["packing"]
    assert (packing.rollouts, packing.p50_s, packing.max_s) == (3, 38.0, 49.0)
    commit = stages["commit"]  # t_committed is the real write time, long after these made-up stamps
    assert commit.rollouts == 4 and commit.p50_s > 0


def test_parse_steps_names_committed_steps_both_ends_included():
    committed = [1, 2, 3, 4, 5]
    assert parse_steps(None, committed) == committed
    assert parse_steps("2:4", committed) == [2, 3, 4]
    assert parse_steps("4:", committed) == [4, 5]
    assert parse_steps(":2", committed) == [1, 2]
    assert parse_steps("3", committed) == [3]
    with pytest.raises(StepRangeError, match="no committed step in 7..9"):
        parse_steps("7:9", committed)
    with pytest.raises(StepRangeError, match="expected A:B"):
        parse_steps("a:b", committed)


def test_each_server_lane_stacks_requests_by_concurrency(run):
    lanes = server_lanes(read_timelines(run, [1, 2]))
    assert list(lanes) == [A, B]  # the never-sent rollout has no lane
    # 0 (100-110) and 1 (101-121) overlap: two rows; 2 starts at 125, after both: back on row 0.
    assert [(r.start, r.end, r.level) for r in lanes[A]] == [(100, 110, 0), (101, 121, 1), (125, 155, 0)]
    assert [(r.status, r.level) for r in lanes[B]] == [("error", 0)]


def test_the_timeline_png_is_drawn(run, tmp_path):
    path = write_timeline(run, [1, 2])
    assert path == run.path / "timeline.png"
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 400 and image.shape[1] > 800
    # The error bar on B's lane is drawn in the error colour (#c62828).
    pixels = (image[..., :3] * 255).round().astype(int).reshape(-1, 3)
    assert (np.abs(pixels - [0xc6, 0x28, 0x28]).sum(axis=1) < 8).any()


def test_report_prints_the_latency_of_the_chosen_steps_and_writes_the_timeline(run, monkeypatch):
    status, lines = run_cli(monkeypatch, "report", str(run.path), "--steps", "2:2")
    assert status == 0
    plain = [_STYLE.sub("", line) for line in lines]
    assert any("rollout latency, step 2" in line for line in plain)
    generation = next(line for line in plain if "│ generation" in line)
    assert [c.strip() for c in generation.split("│")[1:-1]] == ["generation", "1", "4.00 s", "4.00 s", "4.00 s"]
    assert plain[-1] == f"timeline: {run.path / 'timeline.png'}"
    assert (run.path / "timeline.png").is_file() and (run.path / "report.png").is_file()


def test_report_with_a_range_of_no_committed_step_is_one_red_line(run, monkeypatch):
    status, lines = run_cli(monkeypatch, "report", str(run.path), "--steps", "5:9")
    assert status == 2 and coloured(lines, RED) == ["--steps '5:9': no committed step in 5..9 (committed: 1..2)"]
    assert len(lines) == 1 and not (run.path / "timeline.png").exists()
