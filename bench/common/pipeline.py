"""The pipeline benchmarks' shared set-up: the sizes of the whole benchmark (`bench.throughput.run`), the
simulated engines' settings, the config of figure 3's pipeline (instant servers, `arithmetic`) and one group
of instant rollouts made in-process, for the plain loop and the sink."""

from __future__ import annotations

import time
from typing import Any

from beam_rl.config import RunConfig, config_from_dict
from beam_rl.envs.base import Trajectory
from beam_rl.standin.generator import GenerationParams, InstantGenerator
from beam_rl.types import Rollout, Turn

# Simulated engine settings of figures 1-2 (see beam_rl/standin/simulated.py for the cost model).
SIM_FULL = ("--sim-length-median", "64", "--sim-length-sigma", "1.0", "--sim-decode-base-s", "0.02",
            "--sim-decode-s-per-seq", "1e-4", "--sim-prefill-s-per-token", "2e-5")
SIM_SMALL = ("--sim-length-median", "24", "--sim-length-sigma", "1.0", "--sim-decode-base-s", "0.01",
             "--sim-decode-s-per-seq", "1e-4", "--sim-prefill-s-per-token", "2e-5")

SIZES: dict[str, dict[str, Any]] = {
    "full": {"servers": 4, "max_num_seqs": 256, "rollouts": 20_000, "group_size": 8, "max_tokens": 256,
             "sim_args": SIM_FULL, "tokens": 256, "rollouts_per_step": 256, "pipeline_rollouts": 20_000,
             "pipeline_permits": 512, "pipeline_servers": 2, "rss_warm_rollouts": 2_000, "sink_rollouts": 4_096},
    "small": {"servers": 2, "max_num_seqs": 32, "rollouts": 640, "group_size": 8, "max_tokens": 128,
              "sim_args": SIM_SMALL, "tokens": 256, "rollouts_per_step": 128, "pipeline_rollouts": 1_024,
              "pipeline_permits": 256, "pipeline_servers": 2, "rss_warm_rollouts": 256, "sink_rollouts": 512},
}

ENV = "arithmetic"


def bench_config(run_dir: str, urls: list[str], size: dict[str, Any], runner: str) -> RunConfig:
    per_step, group = size["rollouts_per_step"], size["group_size"]
    steps = size["pipeline_rollouts"] // per_step
    groups = steps * per_step // group
    return config_from_dict({
        "run": {"dir": run_dir, "max_steps": steps},
        "envs": [{"name": ENV, "group_size": group, "epochs": -(-groups // 200), "mode": "group"}],
        "batch": {"rollouts_per_step": per_step},
        "inference": {"urls": urls, "max_tokens": size["tokens"], "max_inflight": size["pipeline_permits"]},
        # Instant completions are random ids: every group would be zero-advantage and dropped.
        "filters": {"zero_advantage": {"mode": "monitor"}},
        "runner": {"name": runner},
    })


def instant_rollouts(config: RunConfig, env: Any, generator: InstantGenerator, position: int,
                     schedule: Any) -> list[Rollout]:
    """One group's rollouts as an instant server would have produced them, scored by the environment."""
    request = schedule.group(position)
    prompt = env.render_prompt(request.row)
    n = request.group_size
    state = generator.start(GenerationParams(tuple(prompt), n=n, max_tokens=config.inference.max_tokens, seed=position))
    now = time.time()
    rollouts = []
    for i, c in enumerate(state.choices):
        turns = [Turn(c.token_ids, c.logprobs, c.finish_reason)]
        rollouts.append(Rollout(
            group_id=request.group_id, env_name=request.env_name, attempt=i, group_size=n, prompt_ids=list(prompt),
            turns=turns, reward=env.reward(request.row, Trajectory(turns)), t_sent=now, t_finished=now,
            epoch=request.epoch, index=request.index))
    return rollouts
