"""The prompt schedule: a stable numbering of every group a run can admit.

Offset o names one (environment, epoch, row) triple, the same one on every restart, so the source's
restriction is a plain offset range and a commit record's offsets say exactly what was consumed.
Epoch-major; within an epoch, environments take turns row by row, each in row order or, shuffled, in an
order of the epoch's own drawn from the run's seed (the same on every restart).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from beam_rl.types import GroupRequest, make_group_id

Offset = tuple[str, int, int]  # (env name, epoch, row index)


@dataclass(frozen=True)
class EnvSchedule:
    name: str
    rows: Sequence[dict[str, Any]]
    group_size: int
    epochs: int
    shuffle_seed: int | None = None  # set: each epoch visits the rows in its own order, drawn from it

    def row_order(self, epoch: int) -> Sequence[int]:
        if self.shuffle_seed is None:
            return range(len(self.rows))
        rng = np.random.default_rng([self.shuffle_seed, zlib.crc32(self.name.encode()), epoch])
        return rng.permutation(len(self.rows)).tolist()


class PromptSchedule:
    def __init__(self, envs: Sequence[EnvSchedule]) -> None:
        if not envs:
            raise ValueError("a prompt schedule needs at least one environment")
        self._envs = {e.name: e for e in envs}
        self._offsets: list[Offset] = []
        for epoch in range(max(e.epochs for e in envs)):
            orders = [env.row_order(epoch) if epoch < env.epochs else () for env in envs]
            for turn in range(max(len(e.rows) for e in envs)):
                for env, order in zip(envs, orders, strict=True):
                    if turn < len(order):
                        self._offsets.append((env.name, epoch, order[turn]))
        self._position = {offset: i for i, offset in enumerate(self._offsets)}

    def __len__(self) -> int:
        return len(self._offsets)

    def offset(self, position: int) -> Offset:
        return self._offsets[position]

    def position(self, offset: Offset) -> int:
        return self._position[tuple(offset)]  # type: ignore[index]

    def positions_of(self, offsets) -> set[int]:
        """The positions of those offsets this schedule has (a changed dataset may lack some)."""
        return {self._position[tuple(o)] for o in offsets if tuple(o) in self._position}

    def group_size(self, position: int) -> int:
        return self._envs[self._offsets[position][0]].group_size

    def group(self, position: int, attempts: tuple[int, ...] | None = None) -> GroupRequest:
        """The group at `position`: all its attempts, or only `attempts` (a restored group's missing ones)."""
        name, epoch, index = self._offsets[position]
        env = self._envs[name]
        return GroupRequest(
            group_id=f"{name}/{make_group_id(epoch, index)}",
            epoch=epoch,
            index=index,
            env_name=name,
            group_size=env.group_size,
            row=dict(env.rows[index]),
            attempts=attempts,
        )
