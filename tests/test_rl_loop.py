"""The whole RL loop on Prism: embedded servers, the rollout pipeline, the reference trainer, and
WeightSync between them (the main job, `beam-rl run`)."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pytest
from rich.console import Console

from beam_rl.config import load_config
from beam_rl.observe.report import step_rows
from beam_rl.rundir import RunDir
from runners.job import run_job

TINY = "configs/tiny.toml"


def _trained_policy_versions(run_dir: RunDir, step: int) -> np.ndarray:
    table = pa.ipc.open_file(pa.memory_map(str(run_dir.rank_path(step, 0)))).read_all()
    return table.column("policy_version").to_numpy()


def _run(tmp_path, **overrides):
    config = load_config(TINY)
    config = config.model_copy(update={
        "run": config.run.model_copy(update={"dir": tmp_path, **overrides.pop("run", {})}),
        **{k: getattr(config, k).model_copy(update=v) for k, v in overrides.items()},
    })
    return config, run_job(config, Console(file=io.StringIO(), width=120))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("tiny-run"))


def test_the_tiny_run_learns(tiny_run):
    # Reward of the first and last quarter of the run. A random-init policy gets ~0.03 here (it
    # rarely writes a digit); within 20 steps it learns to answer with one (partial credit 0.1,
    # right one time in ten at first). Over five steps of 64 rollouts the mean's noise is ~0.01, so
    # a margin of 0.03 is several standard errors above chance yet far below the gain we measure.
    config, run_dir = tiny_run
    rewards = [row.reward_mean for row in step_rows(run_dir)]
    assert len(rewards) == config.run.max_steps
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    assert last > first + 0.03, rewards


def test_the_tiny_run_learns_on_two_data_parallel_ranks(tmp_path):
    """The main job's config with the trainer as two gloo ranks, each reading its own rank file."""
    config, run_dir = _run(tmp_path, batch={"trainer_ranks": 2}, trainer={"nproc": 2})
    rewards = [row.reward_mean for row in step_rows(run_dir)]
    assert len(rewards) == config.run.max_steps
    first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
    print(f"reward, first 5 steps {first:.3f}, last 5 {last:.3f}")
    assert last > first + 0.03, rewards
    trained = [m["trainer"] for m in run_dir.read_metrics() if "trainer" in m]
    assert [m["step"] for m in trained] == list(range(1, config.run.max_steps + 1))
    assert {m["ranks"] for m in trained} == {2} and {m["processes"] for m in trained} == {2}


def test_rollouts_see_the_policy_version_advance(tiny_run):
    config, run_dir = tiny_run
    last = run_dir.last_committed_step()
    assert _trained_policy_versions(run_dir, last).max() >= last - 1 - config.off_policy.max_off_policy_steps
    assert run_dir.latest_stable_weights()[0] == config.run.max_steps  # the trainer trained every step


def _oldest_token_versions(run_dir: RunDir, step: int) -> np.ndarray:
    """Per trained sample, the policy version of its oldest generated token; where a token's version is
    unknown (-1), the version its request was sent under, which no token is older than."""
    table = pa.ipc.open_file(pa.memory_map(str(run_dir.rank_path(step, 0)))).read_all()
    oldest = []
    for started, versions, mask in zip(table.column("policy_version").to_pylist(),
                                       table.column("policy_versions").to_pylist(),
                                       table.column("loss_mask").to_pylist()):
        generated = [v for v, m in zip(versions, mask) if m]
        oldest.append(started if not generated or min(generated) < 0 else min(generated))
    return np.array(oldest)


def test_no_trained_rollout_exceeds_the_off_policy_bound(tiny_run):
    # The bound holds by the oldest token: a request that waited through an update, or continued under
    # new weights, is younger than the version it was sent under.
    config, run_dir = tiny_run
    for step in run_dir.committed_steps():
        staleness = (step - 1) - _oldest_token_versions(run_dir, step)
        assert staleness.max() <= config.off_policy.max_off_policy_steps, (step, staleness.max())


def test_the_job_writes_metrics_and_a_plot(tiny_run):
    config, run_dir = tiny_run
    trainer_steps = [m["trainer"]["step"] for m in run_dir.read_metrics() if "trainer" in m]
    assert trainer_steps == list(range(1, config.run.max_steps + 1))
    assert (run_dir.path / "report.png").stat().st_size > 0
    # The dispatcher's load history: in flight never past the cap, and the sum of the servers' own.
    history = [m["dispatch"] for m in run_dir.read_metrics() if "dispatch" in m]
    assert history, "no dispatch load in metrics.jsonl"
    for d in history:
        assert 0 <= d["inflight"] <= d["max_inflight"] == config.inference.max_inflight
        assert d["inflight"] == sum(s["inflight"] for s in d["servers"])
        assert len(d["servers"]) == config.inference.embedded_servers
    rows = step_rows(run_dir)
    assert all(r.permits_in_use is not None and 0.0 <= r.permits_in_use <= 1.0 for r in rows)
    assert max(r.permits_in_use for r in rows) > 0.0


def test_held_out_eval_runs_every_k_steps_and_is_never_trained(tiny_run):
    config, run_dir = tiny_run
    evals = [m["eval"] for m in run_dir.read_metrics() if "eval" in m]
    every = config.eval.every_steps
    assert [e["after_step"] for e in evals] == list(range(every, config.run.max_steps, every))
    for e in evals:
        figures = e["envs"]["arithmetic_easy"]
        assert figures["prompts"] == config.eval.limit
        assert figures["rollouts"] == config.eval.limit * config.eval.samples_per_prompt
        # Rewards lie in [0, 1] and pass@1 counts the full-reward ones, so it cannot exceed the mean.
        assert 0.0 <= figures["pass@1"] <= figures["mean_reward"] + 1e-9 <= 1.0 + 1e-9
    for step in run_dir.committed_steps():
        window = run_dir.read_window(step)
        assert not any(g.startswith("eval@") for g in window.column("group_id").to_pylist())
        assert not any(window.column("is_eval").to_pylist())


def test_max_async_level_zero_is_on_policy(tmp_path):
    config, run_dir = _run(tmp_path, run={"max_steps": 4},
                           off_policy={"max_async_level": 0, "max_off_policy_steps": 0})
    assert run_dir.committed_steps() == [1, 2, 3, 4]
    for step in run_dir.committed_steps():
        assert set(_trained_policy_versions(run_dir, step).tolist()) == {step - 1}


def test_report_command_plots_a_finished_run(tiny_run, tmp_path):
    from beam_rl.cli import main

    _, run_dir = tiny_run
    (run_dir.path / "report.png").unlink()
    assert main(["report", str(run_dir.path)]) == 0
    assert (run_dir.path / "report.png").stat().st_size > 0
    assert main(["report", str(tmp_path)]) == 2  # no committed step there
