"""Which part of the run a dispatch shard owns: prompt offsets, inference servers and permits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count`. It owns every `count`-th draw of each stream of the prompt schedule (so all
    shards move through the epochs together), every `count`-th server, and its share of the permits."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"shard {self.index} of {self.count} does not exist")

    def size(self, positions: int) -> int:
        """How many of `positions` schedule positions this shard owns."""
        return len(range(self.index, positions, self.count))

    def draws(self, stream_lengths: Sequence[int]) -> tuple[int, ...]:
        """How many draws of each stream of the prompt schedule this shard owns."""
        return tuple(map(self.size, stream_lengths))

    def draw(self, local: int) -> int:
        """The stream's draw that is this shard's `local`-th of it."""
        return local * self.count + self.index

    def servers(self, servers: Sequence[T]) -> list[T]:
        return list(servers[self.index :: self.count])

    def permits(self, total: int) -> int:
        """An even share of `total` permits; the first shards take the remainder."""
        share, rest = divmod(total, self.count)
        return share + (1 if self.index < rest else 0)
