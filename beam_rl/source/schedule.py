"""The prompt schedule: a stable numbering of every group a run can admit.

A position names one (environment, epoch, row) triple, the same one on every restart, so what a source
has claimed is a few counters and a commit record's offsets say exactly what was consumed.

The positions come in streams, each drawn in order. By default there is one: epoch-major, environments
taking turns row by row. With target shares (`envs[].ratio`) each environment is a stream of its own, its
epochs one after another, and the source chooses which stream to draw from next (beam_rl/source/mixing.py),
so a small environment starts its next epoch while a large one is still in its first. Within an epoch an
environment's rows come in row order or, shuffled, in an order of the epoch's own drawn from the run's seed
(the same on every restart). Draw k of stream s is position k * streams + s.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

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
    def __init__(self, envs: Sequence[EnvSchedule], *, stream_per_env: bool = False) -> None:
        if not envs:
            raise ValueError("a prompt schedule needs at least one environment")
        self._envs = {e.name: e for e in envs}
        if stream_per_env:
            self._streams = [
                [(env.name, epoch, row) for epoch in range(env.epochs) for row in env.row_order(epoch)] for env in envs
            ]
            self.stream_envs: tuple[str | None, ...] = tuple(env.name for env in envs)
        else:
            self._streams = [_taking_turns(envs)]
            self.stream_envs = (None,)  # every environment
        self._position = {
            offset: self.position_of(s, k) for s, stream in enumerate(self._streams) for k, offset in enumerate(stream)
        }

    def __len__(self) -> int:
        return len(self._position)

    @property
    def stream_lengths(self) -> tuple[int, ...]:
        return tuple(map(len, self._streams))

    def position_of(self, stream: int, draw: int) -> int:
        return draw * len(self._streams) + stream

    def offset(self, position: int) -> Offset:
        draw, stream = divmod(position, len(self._streams))
        return self._streams[stream][draw]

    def position(self, offset: Offset) -> int:
        return self._position[tuple(offset)]  # type: ignore[index]

    def positions_of(self, offsets: Iterable[Offset]) -> set[int]:
        """The positions of those offsets this schedule has (a changed dataset may lack some)."""
        return {self._position[o] for o in map(tuple, offsets) if o in self._position}

    def group_size(self, position: int) -> int:
        return self._envs[self.offset(position)[0]].group_size

    def group(self, position: int, attempts: tuple[int, ...] | None = None) -> GroupRequest:
        """The group at `position`: all its attempts, or only `attempts` (a restored group's missing ones)."""
        name, epoch, index = self.offset(position)
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


def _taking_turns(envs: Sequence[EnvSchedule]) -> list[Offset]:
    """Epoch-major; within an epoch, the environments take turns row by row."""
    offsets = []
    for epoch in range(max(e.epochs for e in envs)):
        orders = [env.row_order(epoch) if epoch < env.epochs else () for env in envs]
        for turn in range(max(len(e.rows) for e in envs)):
            for env, order in zip(envs, orders, strict=True):
                if turn < len(order):
                    offsets.append((env.name, epoch, order[turn]))
    return offsets
