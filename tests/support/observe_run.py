"""A synthetic run directory for the observer's tests: steps committed with RunDir.write_step and the
metrics lines the pipeline and the trainer append, shaped as they write them."""

from __future__ import annotations

import time
from typing import Any

from beam_rl.config import RunConfig, config_from_dict
from beam_rl.rundir import RunDir
from beam_rl.types import TrainBatch

SERVERS = ("http://127.0.0.1:8001", "http://127.0.0.1:8002")


def observe_config(**logging: Any) -> RunConfig:
    return config_from_dict({"envs": [{"name": "arithmetic"}], "logging": logging})


def window(step: int) -> dict[str, Any]:
    """A step's window stats as the packer computes them (beam_rl/packing/batches.py), with figures other work adds."""
    return {
        "step": step, "rollouts": 64 + step, "status": {"ok": 60 + step, "error": 4, "cancelled": 0},
        "errored": 4, "filtered": {"zero_advantage": step % 3}, "flagged": {"monitored": {"gibberish": 1}, "enforced": {}},
        "trained_rollouts": 56, "reward_mean": step / 10, "completion_tokens_mean": 7.5 + step,
        "policy_version_min": step - 2, "policy_version_max": step - 1, "staleness_max": 1,
        "samples": 56, "tokens": 900 + step, "micro_batches": [2], "group_ids": [f"g{step}"],
        "tokens_by_fate": {"trained": 800 + step, "filtered": 60, "errored": 40},
    }


def commit_step(run: RunDir, step: int) -> dict[str, Any]:
    """Commit `step` as transforms/write.py does, and return its commit record."""
    run.write_step(TrainBatch(step=step, micro_batches=[], group_ids=[f"g{step}"], window=window(step)),
                   extra={"last_rollout_finished_at": time.time()})
    run.append_metrics({"step": step, "committed_at": time.time(), **window(step)})
    return run.read_commit(step).model_dump(mode="json")


def dispatch_sample(run: RunDir, inflight: int) -> None:
    servers = [{"url": url, "inflight": inflight - i, "healthy": True} for i, url in enumerate(SERVERS)]
    run.append_metrics({"dispatch": {"t": time.time(), "inflight": inflight, "max_inflight": 64, "servers": servers}})


def trainer_record(run: RunDir, step: int) -> dict[str, Any]:
    record = {"step": step, "policy_version": step, "loss": 1 / step, "grad_norm": 0.5 + step, "lr": 1e-3,
              "clip_fraction": 0.01 * step, "reward_mean": step / 10, "staleness_max": 1, "wait_s": 0.25}
    run.append_metrics({"trainer": record})
    return record


def eval_record(run: RunDir, after_step: int) -> dict[str, Any]:
    record = {"after_step": after_step, "policy_version": after_step,
              "envs": {"arithmetic": {"prompts": 20, "rollouts": 80, "errored": 0,
                                      "mean_reward": after_step / 20, "pass@1": after_step / 40}}}
    run.append_metrics({"eval": record})
    return record


def status(run: RunDir, policy_version: int, **extra: Any) -> dict[str, Any]:
    record = {
        "updated_at": time.time(), "policy_version": policy_version, "waiting_for_trainer": False,
        "waited_for_trainer_s": 1.5, "waited_for_sink_s": 0.25, "groups_admitted": 40, "rollouts_emitted": 300,
        "cancelled_stale_groups": 1, "skipped_consumed_groups": 0,
        "weight_reloads": [{"version": 1, "seconds": 0.125}, {"version": 2, "seconds": 0.5}],
        "all_servers_down_for_s": None, "max_inflight": 64,
        "servers": [
            {"url": SERVERS[0], "healthy": True, "inflight": 20, "running": 18.0, "waiting": 2.0, "kv_cache_usage": 0.25},
            {"url": SERVERS[1], "healthy": False, "inflight": 0, "running": None, "waiting": None, "kv_cache_usage": None},
        ],
        "started": 320, "ok": 290, "errored": 6, "cancelled": 4, "inflight": 20, "healthy_servers": 1, **extra,
    }
    run.write_status(record)
    return record


def grow(run: RunDir, steps: range, *, trainer_lag: int = 1, eval_every: int = 3) -> None:
    """Commit `steps` in order; the trainer's record of a step comes `trainer_lag` steps later (it trains
    step s while the pipeline packs s+1), an eval round every `eval_every` steps."""
    for step in steps:
        dispatch_sample(run, 10 + step)
        commit_step(run, step)
        if step - trainer_lag >= 1:
            trainer_record(run, step - trainer_lag)
        if step % eval_every == 0:
            eval_record(run, step)
