"""The curriculum: whether a prompt is worth another epoch, from the rewards its groups got in committed steps.

A prompt's outcome in an epoch is its group's: `solved` when every attempt was scored at or above
`easy_threshold`, `unsolved` when every attempt was scored at or below `hard_threshold`, `mixed` otherwise
(errored attempts make it mixed: nothing is concluded from them). A mixed group is what GRPO learns from;
the other two train nothing under the zero-advantage filter and cost a full generation. So a prompt whose
newest outcome is solved is retired (`solved_every = 0`) or sent again only every `solved_every`-th epoch,
and an unsolved one only every `unsolved_every`-th (revisited: the policy may have learned it since).

Everything it knows is read from the committed windows, in step order: a resumed run rebuilds it from
exactly what its committed steps say, so a retired prompt stays retired across restarts and nothing of it
lives only in a worker's memory. It decides on what is committed when a group is admitted: a prompt whose
previous epoch's group is still on its way is admitted.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import pyarrow as pa

if TYPE_CHECKING:
    from beam_rl.config import CurriculumSection, RunConfig
    from beam_rl.rundir import RunDir

Outcome = Literal["solved", "unsolved", "mixed"]


@dataclass
class PromptHistory:
    epoch: int  # the newest epoch of a committed group of the prompt
    outcome: Outcome  # that group's
    pass_rates: list[float] = field(default_factory=list)  # each committed group's share at or above easy


class Curriculum:
    """Per prompt (environment, row), its committed groups' outcomes, and what they decide."""

    def __init__(self, rules: dict[str, CurriculumSection]) -> None:
        self.rules = rules
        self.prompts: dict[tuple[str, int], PromptHistory] = {}
        self.last_step = 0

    @classmethod
    def for_run(cls, config: RunConfig) -> Curriculum | None:
        """The run's curriculum, or None when no environment has one."""
        rules = {e.name: e.curriculum for e in config.envs if e.curriculum is not None}
        return cls(rules) if rules else None

    def follow(self, run_dir: RunDir, last_step: int) -> None:
        """Read the windows of the steps committed since the last call, up to `last_step`."""
        for step in range(self.last_step + 1, last_step + 1):
            self.observe(run_dir.read_window(step))
            self.last_step = step

    def observe(self, window: pa.Table) -> None:
        """A committed window's groups, outcome by outcome."""
        groups: dict[str, list[dict]] = collections.defaultdict(list)
        for rollout in window.select(["group_id", "env", "epoch", "index", "is_eval", "status", "reward"]).to_pylist():
            if not rollout["is_eval"] and rollout["env"] in self.rules:
                groups[rollout["group_id"]].append(rollout)
        for attempts in groups.values():
            first = attempts[0]
            rule = self.rules[first["env"]]
            scored = [a["reward"] for a in attempts if a["status"] == "ok"]
            all_scored = len(scored) == len(attempts)
            outcome: Outcome = "mixed"
            if all_scored and min(scored) >= rule.easy_threshold:
                outcome = "solved"
            elif all_scored and max(scored) <= rule.hard_threshold:
                outcome = "unsolved"
            key = (first["env"], first["index"])
            history = self.prompts.setdefault(key, PromptHistory(first["epoch"], outcome))
            if first["epoch"] >= history.epoch:
                history.epoch, history.outcome = first["epoch"], outcome
            history.pass_rates.append(sum(r >= rule.easy_threshold for r in scored) / len(attempts))

    def skip_reason(self, env: str, epoch: int, index: int) -> Outcome | None:
        """Why the prompt's group of `epoch` is not sent ("solved" or "unsolved"), or None to send it."""
        rule = self.rules.get(env)
        history = self.prompts.get((env, index))
        if rule is None or history is None or history.epoch >= epoch:
            return None
        since = epoch - history.epoch
        if history.outcome == "solved" and (rule.solved_every == 0 or since < rule.solved_every):
            return "solved"
        if history.outcome == "unsolved" and since < rule.unsolved_every:
            return "unsolved"
        return None

    def summary(self) -> dict[str, dict[str, int]]:
        """Per environment, how many prompts' newest outcome is each outcome."""
        counts: dict[str, dict[str, int]] = {env: {"solved": 0, "unsolved": 0, "mixed": 0} for env in self.rules}
        for (env, _), history in self.prompts.items():
            counts[env][history.outcome] += 1
        return counts


def describe(run_dir: RunDir, config: RunConfig, steps: list[int]) -> list[str]:
    """For `beam-rl inspect`, a line per environment with a curriculum: its prompts' newest outcomes in the
    committed `steps`, and the groups it kept back (the sources' `curriculum_skip` metrics records; one
    decided again after a restore counts once)."""
    curriculum = Curriculum.for_run(config)
    if curriculum is None:
        return []
    for step in steps:
        curriculum.observe(run_dir.read_window(step))
    kept_back: dict[str, dict[tuple[int, int], str]] = collections.defaultdict(dict)
    for record in run_dir.read_metrics():
        skip = record.get("curriculum_skip")
        if isinstance(skip, dict):
            kept_back[skip["env"]][(skip["epoch"], skip["index"])] = skip["reason"]
    lines = []
    for env, outcomes in curriculum.summary().items():
        reasons = collections.Counter(kept_back[env].values())
        lines.append(
            f"curriculum of {env}: {sum(outcomes.values())} prompts trained, newest outcome "
            f"{outcomes['solved']} solved, {outcomes['unsolved']} unsolved, {outcomes['mixed']} mixed; "
            f"groups kept back: {reasons['solved']} solved, {reasons['unsolved']} unsolved"
        )
    return lines
