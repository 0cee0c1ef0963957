"""Simulated engines as the dispatch benchmarks use them: a synthetic environment whose prompts are token ids,
groups of distinct random prompts, the engines' own step traces, and what share of a span an engine ran full
or how many of its slots it kept occupied."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import numpy as np

from beam_rl.envs.base import CompletionClient, Environment, SamplingParams, Trajectory
from beam_rl.model.tokenizer import load_tokenizer
from beam_rl.types import GroupRequest, Turn

FULL = 0.95  # a server counts as full with >= 95% of max_num_seqs running


class SyntheticEnv(Environment):
    """Prompts are given token ids; the reward is a cheap function of the ids, so the benchmark
    measures dispatch, not text scoring."""

    name = "synthetic"

    def load_rows(self, split: str = "train") -> list[dict[str, Any]]:
        return []

    def render_prompt(self, row: dict[str, Any]) -> list[int]:
        return list(row["prompt_ids"])

    def reward(self, row: dict[str, Any], trajectory: Trajectory) -> float:
        return float(len(trajectory.turns[0].completion_ids) % 7)

    async def run(self, client: CompletionClient, row: dict[str, Any], prompt_ids: list[int],
                  sampling: SamplingParams) -> Trajectory:
        (c,) = await client.complete(prompt_ids, sampling, n=1)
        return Trajectory([Turn(c.token_ids, c.logprobs, c.finish_reason)])


def make_groups(count: int, group_size: int, seed: int, tag: str) -> list[GroupRequest]:
    """Distinct random prompts of 64..256 tokens (no two groups share a prefix block)."""
    tokenizer = load_tokenizer("tiny")
    allowed = np.setdiff1d(np.arange(len(tokenizer)), np.array(sorted(tokenizer.all_special_ids)))
    rng = np.random.default_rng(seed)
    return [
        GroupRequest(group_id=f"{tag}/{i}", epoch=0, index=i, env_name="synthetic", group_size=group_size,
                     row={"prompt_ids": rng.choice(allowed, size=int(rng.integers(64, 257))).tolist()})
        for i in range(count)
    ]


async def step_traces(urls: list[str], since: float, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Each simulated server's own step trace since `since` (`GET /simulated/trace`); `timeout_s` also bounds the
    wait for one of the client's connections (a thousand servers queue behind a hundred)."""
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        responses = await asyncio.gather(*(client.get(f"{u}/simulated/trace", params={"since": since}) for u in urls))
    return [r.json() for r in responses]


def full_share(trace: dict[str, Any], start: float, end: float) -> float:
    """Share of [start, end) during which the engine ran >= FULL * max_num_seqs sequences.

    A step covers [t, min(next step's t, t + 2 * its planned duration)): an idle engine takes no
    steps, and a step that ran more than twice late counts as not full beyond its planned span x2.
    """
    t = np.asarray(trace["t"], dtype=float)
    if t.size == 0 or end <= start:
        return 0.0
    planned = np.asarray(trace["duration"], dtype=float)
    running = np.asarray(trace["running"], dtype=float)
    stop = np.minimum(np.append(t[1:], np.inf), t + 2 * planned)
    full = running >= FULL * trace["max_num_seqs"]
    covered = np.clip(np.minimum(stop, end) - np.maximum(t, start), 0, None)
    return float(covered[full].sum() / (end - start))


def occupied_share(trace: dict[str, Any], start: float, end: float) -> float:
    """Time-weighted mean of running / max_num_seqs over [start, end), from the engine's own step trace."""
    t = np.asarray(trace["t"], dtype=float)
    if t.size == 0 or end <= start:
        return 0.0
    stop = np.append(t[1:], end)
    covered = np.clip(np.minimum(stop, end) - np.maximum(t, start), 0, None)
    running = np.asarray(trace["running"], dtype=float) / trace["max_num_seqs"]
    return float((covered * running).sum() / (end - start))
