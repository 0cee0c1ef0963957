"""The side-by-side's workloads: each one's simulated engine (cost model, lengths, KV bound), sampling and
prompts, the same for every system (the prompts from one seed), and how many groups keep a fleet busy."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

from beam_rl.envs.guess_number import GuessNumber
from beam_rl.model.tokenizer import load_tokenizer
from bench.common.engines import make_groups
from bench.peers.job import SLOTS_PER_SERVER

GROUP_SIZE = 4
STEP_GROUPS = 8  # the groups a run asks for are a multiple of this (beam-rl packs 8 groups per step)
MIN_STEPS = 4  # at least this many steps' groups: a steady window between two of them
# The engine's cost model (beam_rl/standin/simulated.py) as the dispatch benchmarks use it, each step 4x slower
# (as bench/scale/fleet.py): sixteen servers streaming to one orchestrator on a two-core machine would otherwise
# measure the machine.
DECODE_BASE_S, DECODE_S_PER_SEQ, PREFILL_S_PER_TOKEN, TIME_SCALE = 0.02, 1e-4, 2e-5, 4.0


@dataclass(frozen=True)
class Workload:
    name: str
    length_median: float  # completion tokens per turn: log-normal
    length_sigma: float
    max_tokens: int  # per turn
    kv_cache_tokens: int  # each server's KV cache: it preempts when full, as vLLM V1 does
    turns: int = 1  # model turns per rollout (multi_turn: the environment answers between them)

    def server_args(self) -> list[str]:
        """Each simulated server's flags (beam_rl/standin/fleet.py)."""
        return ["--max-num-seqs", str(SLOTS_PER_SERVER), "--served-model-name", "tiny",
                "--sim-decode-base-s", str(DECODE_BASE_S), "--sim-decode-s-per-seq", str(DECODE_S_PER_SEQ),
                "--sim-prefill-s-per-token", str(PREFILL_S_PER_TOKEN), "--sim-time-scale", str(TIME_SCALE),
                "--sim-length-median", str(self.length_median), "--sim-length-sigma", str(self.length_sigma),
                "--sim-kv-cache-tokens", str(self.kv_cache_tokens)]

    def fleet_rollouts_per_s(self, servers: int) -> float:
        """What the fleet finishes per second with every slot busy (decode only): what sizes a run."""
        mean_tokens = min(self.max_tokens, self.length_median * math.exp(self.length_sigma**2 / 2)) * self.turns
        step_s = TIME_SCALE * (DECODE_BASE_S + DECODE_S_PER_SEQ * SLOTS_PER_SERVER)
        return servers * SLOTS_PER_SERVER / (mean_tokens * step_s)

    def groups_for(self, servers: int, seconds: float) -> int:
        """Groups that keep the fleet busy for about `seconds`: MIN_STEPS steps' worth or more, whole steps."""
        groups = self.fleet_rollouts_per_s(servers) * seconds / GROUP_SIZE
        return max(MIN_STEPS, math.ceil(groups / STEP_GROUPS)) * STEP_GROUPS


WORKLOADS = {
    # Short uniform answers: slots are what runs out.
    "short": Workload("short", length_median=16, length_sigma=0.5, max_tokens=64, kv_cache_tokens=24_576),
    # A long tail (some answers 20x the median) on a KV cache that holds the slots' prompts and median answers,
    # not their tails: the tail preempts.
    "long_tail": Workload("long_tail", length_median=48, length_sigma=1.2, max_tokens=1024, kv_cache_tokens=8_192),
    # Four model turns, the environment answering between them (beam-rl: its guess_number game).
    "multi_turn": Workload("multi_turn", length_median=16, length_sigma=0.5, max_tokens=32, kv_cache_tokens=24_576,
                           turns=4),
}
MULTI_TURN_MAX_TURNS = WORKLOADS["multi_turn"].turns


@functools.cache
def multi_turn_rows() -> list[dict[str, Any]]:
    """`guess_number`'s own rows in its order, rendered: the multi-turn workload's prompts (row k % len). Read
    them; never change them (one list for every caller)."""
    env = GuessNumber(load_tokenizer("tiny"), MULTI_TURN_MAX_TURNS)
    rows = env.load_rows("train")
    return [{"prompt_ids": env.render_prompt(r), "prompt": env.PROMPT.format(**r)} for r in rows]


def multi_turn_epochs(groups: int) -> tuple[int, int]:
    """(epochs, rows a epoch) whose product is exactly `groups`, the fewest epochs: a job that offers more
    conversations than it asks for keeps the surplus in flight at its end, where the harness would count it as
    tokens thrown away."""
    rows = len(multi_turn_rows())
    epochs = next(e for e in range(1, groups + 1) if groups % e == 0 and groups // e <= rows)
    return epochs, groups // epochs


def prompts(workload: str, groups: int, seed: int) -> list[dict[str, Any]]:
    """The prompts file's lines: `groups` groups, the same for every system (one seed)."""
    if workload == "multi_turn":
        rows = multi_turn_rows()
        per_epoch = multi_turn_epochs(groups)[1]
        return [{"group_id": f"{workload}/{i}", **rows[i % per_epoch]} for i in range(groups)]
    tokenizer = load_tokenizer("tiny")
    ids = [g.row["prompt_ids"] for g in make_groups(groups, GROUP_SIZE, seed, workload)]
    return [{"group_id": f"{workload}/{i}", "prompt_ids": p, "prompt": tokenizer.decode(p)} for i, p in enumerate(ids)]
