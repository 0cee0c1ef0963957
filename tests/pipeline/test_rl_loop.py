"""The whole RL loop on Prism: embedded servers, the rollout pipeline, the reference trainer, and
WeightSync between them (the main job, `beam-rl run`)."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pytest
import torch
from rich.console import Console

from beam_rl.config import LoraSection, ZeroAdvantageFilter, load_config
from beam_rl.observe.report import step_rows
from beam_rl.rundir import RunDir
from beam_rl.model.tiny import write_llama_model
from beam_rl.job.run import run_job

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


def test_the_tiny_run_learns_with_a_lora_adapter_that_the_servers_sample_with_exactly(tmp_path):
    """The main job's config training a LoRA adapter, on policy (max_async_level 0): each step publishes the
    adapter alone, the embedded servers (--enable-lora) load it without a pause, and each step's rollouts were
    sampled with exactly the adapter the trainer then trains (importance ratio 1, no mismatch), so the tokens
    are the policy's own."""
    lora = LoraSection(rank=8, alpha=16,
                       target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    config, run_dir = _run(tmp_path, trainer={"lr": 2e-2, "lora": lora},
                           off_policy={"max_async_level": 0, "max_off_policy_steps": 0})
    trained = [m["trainer"] for m in run_dir.read_metrics() if "trainer" in m]
    assert [m["step"] for m in trained] == list(range(1, config.run.max_steps + 1))
    for m in trained:
        assert m["staleness_max"] == 0 and m["mismatch_kl"] < 1e-4 and abs(m["ratio_mean"] - 1) < 1e-3, m
    published = [run_dir.weights_path(step) for step in run_dir.stable_weight_steps()]
    assert len(published) == config.run.max_steps
    assert all((p / "adapter_model.safetensors").is_file() and not (p / "model.safetensors").exists()
               for p in published)
    updates = [m["weight_update"] for m in run_dir.read_metrics() if "weight_update" in m]
    assert updates and all(s["mode"] == "keep" and s["paused_s"] == 0.0 for u in updates for s in u["servers"])
    # How much it learns is not asserted: an adapter over the tiny model's layers (its embedding, which a digit
    # answer needs most, is not adapted) moves the reward far less in 20 steps than training every weight
    # does (docs/lora.md has the figures).
    rewards = [row.reward_mean for row in step_rows(run_dir)]
    print(f"reward, first 5 steps {np.mean(rewards[:5]):.3f}, last 10 {np.mean(rewards[-10:]):.3f}")


def test_a_llama_shaped_model_directory_goes_through_the_run(tmp_path):
    """model.name = a local Hugging Face directory of another architecture: the embedded servers serve it, the
    trainer trains it, and each step's published weights are that model, changed."""
    from transformers import AutoModelForCausalLM

    model_dir = write_llama_model(tmp_path / "llama")
    config, run_dir = _run(tmp_path / "run", run={"max_steps": 3}, model={"name": str(model_dir)},
                           eval={"every_steps": 0},
                           filters={"zero_advantage": ZeroAdvantageFilter(mode="monitor")})
    assert run_dir.committed_steps() == [1, 2, 3] and run_dir.stable_weight_steps() == [1, 2, 3]
    published = AutoModelForCausalLM.from_pretrained(str(run_dir.weights_path(3)), local_files_only=True)
    initial = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True)
    assert type(published).__name__ == "LlamaForCausalLM"
    assert any(not torch.equal(a, b) for a, b in zip(published.state_dict().values(), initial.state_dict().values()))
    for step in run_dir.committed_steps():
        versions = _trained_policy_versions(run_dir, step)
        assert len(versions) and versions.max() <= step - 1 and versions.min() >= step - 1 - 2  # inside the bound


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
