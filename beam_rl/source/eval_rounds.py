"""When a shard sends its part of the held-out split through the dispatcher, and as which groups."""

from __future__ import annotations

import dataclasses

from beam_rl.config import EvalSection
from beam_rl.source.schedule import PromptSchedule
from beam_rl.source.shard import Shard
from beam_rl.types import GroupRequest

EVAL_PREFIX = "eval"


def first_eval_after(step: int, every: int) -> int | None:
    """The first step after `step` that `every` divides (None: no evaluation)."""
    return (step // every + 1) * every if every else None


class EvalRounds:
    """Every eval.every_steps committed steps, one round: this shard's held-out prompts, each
    `samples_per_prompt` times, under group ids no training group can have. The scoring side collects a
    round by its `eval_round` (the step it follows) until every prompt of the split has come back."""

    def __init__(
        self, settings: EvalSection, schedule: PromptSchedule | None, shard: Shard, last_committed: int
    ) -> None:
        self._settings = settings
        self._schedule = schedule
        self._shard = shard
        self._next = first_eval_after(last_committed, settings.every_steps) if schedule is not None else None

    def due(self, last_committed: int) -> list[GroupRequest]:
        """The groups of the round due once `last_committed` is committed (none if no round is due)."""
        if self._next is None or last_committed < self._next:
            return []
        after_step, self._next = self._next, first_eval_after(last_committed, self._settings.every_steps)
        assert self._schedule is not None
        groups = []
        for position in range(self._shard.index, len(self._schedule), self._shard.count):
            request = self._schedule.group(position)
            groups.append(
                dataclasses.replace(
                    request,
                    group_id=f"{EVAL_PREFIX}@{after_step}/{request.group_id}",
                    is_eval=True,
                    eval_round=after_step,
                )
            )
        return groups
