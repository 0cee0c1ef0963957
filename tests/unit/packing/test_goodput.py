"""Goodput from a window's tokens by fate (the counting itself: tests/unit/packing/test_batches.py)."""

from __future__ import annotations

from beam_rl.packing.goodput import describe, goodput
from beam_rl.rundir import RunDir
from beam_rl.types import TrainBatch


def test_goodput_is_trained_over_generated_tokens_optionally_without_filtered_junk():
    fates = {"trained": 98, "stale": 1, "server_failure": 1, "filtered/zero_advantage": 50}
    assert goodput(fates) == 98 / 150
    assert goodput(fates, exclude_filtered=True) == 0.98
    assert goodput({}) is None and goodput({"filtered/gibberish": 3}, exclude_filtered=True) is None


def test_describe_lists_trained_first_then_the_other_fates_and_the_goodput():
    assert describe({"stale": 5, "trained": 90, "filtered/gibberish": 5}) == (
        "tokens by fate: trained 90, filtered/gibberish 5, stale 5; goodput 0.900 of 100 generated")
    assert describe({}) == "tokens by fate: none counted"


def test_each_steps_metrics_line_carries_its_tokens_by_fate_and_goodput(tmp_path):
    from tests.support.step_writer import InProcessWriter

    writer = InProcessWriter(str(tmp_path))
    fates = {"trained": 60, "server_failure": 20, "filtered/zero_advantage": 20}
    for step, window in ((1, {"tokens_by_fate": fates}), (2, {})):
        assert list(writer.process(TrainBatch(step=step, micro_batches=[], group_ids=[], window=window))) == [step]
    lines = [m for m in RunDir(tmp_path).read_metrics() if "step" in m]
    assert [(m["step"], m.get("tokens_by_fate"), m["goodput"]) for m in lines] == [(1, fates, 0.6), (2, None, None)]
