"""Goodput from a window's tokens by fate (the counting itself: tests/test_sink.py)."""

from __future__ import annotations

from beam_rl.goodput import goodput


def test_goodput_is_trained_over_generated_tokens_optionally_without_filtered_junk():
    fates = {"trained": 98, "stale": 1, "server_failure": 1, "filtered/zero_advantage": 50}
    assert goodput(fates) == 98 / 150
    assert goodput(fates, exclude_filtered=True) == 0.98
    assert goodput({}) is None and goodput({"filtered/gibberish": 3}, exclude_filtered=True) is None
