"""How a run's records become the trackers' named figures: headline figures under explicit names, every
other numeric leaf under a stable flattened one, so new figures show up with no code change."""

from __future__ import annotations

import pytest

from beam_rl.observe.figures import eval_figures, numeric_leaves, step_figures, trainer_figures
from beam_rl.rundir import RunDir
from tests.support.observe_run import commit_step, window


def test_a_commit_record_gives_explicit_headline_names_and_flattened_rest(tmp_path):
    commit = commit_step(RunDir(tmp_path), 3)
    figures = step_figures(commit)
    w = window(3)
    assert figures["reward/mean"] == w["reward_mean"] and figures["lag/max"] == w["staleness_max"]
    assert figures["policy/version_min"] == 1 and figures["policy/version_max"] == 2
    assert (figures["rollouts/seen"], figures["rollouts/trained"], figures["rollouts/errored"]) == (67, 56, 4)
    assert figures["filtered/zero_advantage"] == 0 and figures["flagged/monitored/gibberish"] == 1
    assert figures["tokens_by_fate/trained"] == 803 and figures["rollouts/status/ok"] == 63
    fates = w["tokens_by_fate"]
    assert figures["goodput/trained_share"] == pytest.approx(803 / sum(fates.values())) and len(fates) > 1
    assert figures["rollouts/completion_tokens_mean"] == 10.5
    assert figures["batch/groups"] == 1 and figures["timings/write_s"] == commit["timings"]["write_s"]
    # Not figures: ids, lists, the step itself, absolute times (extra.last_rollout_finished_at).
    assert not [name for name in figures if "group_ids" in name or "micro_batches" in name or name.endswith("_at")]
    assert "rollouts/step" not in figures and not any(name.startswith("throughput/") for name in figures)


def test_a_figure_other_work_adds_to_the_window_is_picked_up_by_its_path(tmp_path):
    run = RunDir(tmp_path)
    commit = commit_step(run, 1)
    commit["window"]["goodput"] = {"tokens": {"trained": 10, "discarded": 2}, "share": 0.8}
    commit["window"]["reward_errors"] = 3
    commit["window"]["latency"] = {"p50_s": 0.5, "p99_s": 2.0}
    figures = step_figures(commit)
    assert figures["goodput/tokens/trained"] == 10 and figures["goodput/tokens/discarded"] == 2
    assert figures["goodput/share"] == 0.8 and figures["latency/p99_s"] == 2.0
    assert figures["rollouts/reward_errors"] == 3


def test_throughput_and_dispatcher_load_since_the_previous_commit():
    commit = {"step": 2, "committed_at": 110.0, "window": {"rollouts": 40}, "counts": {"tokens": 2000}}
    dispatch = [
        {"t": 101.0, "inflight": 32, "max_inflight": 64, "servers": [{"url": "http://a:1", "inflight": 30}]},
        {"t": 105.0, "inflight": 64, "max_inflight": 64, "servers": [{"url": "http://a:1", "inflight": 50}]},
    ]
    figures = step_figures(commit, previous_committed_at=100.0, dispatch=dispatch)
    assert figures["throughput/step_interval_s"] == 10.0
    assert figures["throughput/rollouts_per_s"] == 4.0 and figures["throughput/tokens_per_s"] == 200.0
    assert figures["dispatch/permits_in_use"] == 0.75 and figures["dispatch/rollouts_in_flight/a:1"] == 40.0


def test_trainer_and_eval_records():
    trainer = trainer_figures({"step": 4, "loss": 0.5, "grad_norm": 1.25, "reward_mean": None, "ratio": {"mean": 1.0}})
    assert trainer == {"trainer/loss": 0.5, "trainer/grad_norm": 1.25, "trainer/ratio/mean": 1.0}
    evals = eval_figures({"after_step": 5, "policy_version": 5,
                          "envs": {"arith": {"pass@1": 0.25, "mean_reward": None, "prompts": 20}}})
    assert evals == {"eval/policy_version": 5.0, "eval/arith/pass@1": 0.25, "eval/arith/prompts": 20.0}


@pytest.mark.parametrize("value", [True, 3, 2.5])
def test_numbers_and_flags_are_figures_strings_and_lists_are_not(value):
    record = {"a": value, "b": "text", "c": [1, 2], "d": None, "e": {"f": value}}
    assert dict(numeric_leaves(record)) == {("a",): float(value), ("e", "f"): float(value)}
