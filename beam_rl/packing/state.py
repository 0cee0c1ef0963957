"""The packer's state between elements, with one load from what a runner stored and one save of what it
must store.

- A runner stores it in two parts: a small value (`PackerState`: the builder without its pending groups,
  and what the packer knows of the end of input), rewritten with every element, and the pending groups,
  a list it appends to, so that each group (and its tokens) is written once, not with every element.
- `Packer.load` takes both parts as read; `Packer.save` returns what to write (`PackerWrites`): the
  value, and the groups to append, after clearing the stored ones when a cut (or a restore) changed them.
- Steps are never rolled back in the run directory: a state whose next step is committed already (a
  checkpoint older than the run directory, or none) drops the groups those steps hold and does not give
  their step numbers out again.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from beam_rl.packing.batches import BatchBuilder, InputExhausted
from beam_rl.scoring.group import ScoredGroup
from beam_rl.types import TrainBatch

if TYPE_CHECKING:
    from beam_rl.rundir.steps import StepStore
    from beam_rl.source.source import EndOfInput

_LOG = logging.getLogger(__name__)


@dataclass
class PackerState:
    """What the packer keeps between elements. Runners record this class's name in their savepoints
    (pickled), as they did `transforms.pack._PackerState` before it moved here: keep both names."""

    builder: BatchBuilder  # stored without its pending groups
    groups_seen: int = 0
    ended: dict[int, int] = field(default_factory=dict)  # shard -> groups it announced in its EndOfInput
    flushed: bool = False  # the final, partial batch was cut

    def input_exhausted(self, shards: int) -> bool:
        return len(self.ended) == shards and self.groups_seen >= sum(self.ended.values())


@dataclass(frozen=True)
class PackerWrites:
    """What a runner must store after an element."""

    value: PackerState
    pending: list[ScoredGroup]  # groups to append to the stored pending groups
    clear_first: bool  # the stored pending groups are no longer the first of the packer's (a cut, a restore)


class Packer:
    """The packer between a load and a save: takes an element's groups and ends of input, and says what
    to emit."""

    def __init__(self, state: PackerState) -> None:
        self.state = state
        self.dropped = 0  # groups a committed step holds, dropped at load
        self._stored = state.builder.pending  # the pending groups as the runner holds them

    @classmethod
    def load(
        cls,
        value: PackerState | None,
        pending: Iterable[ScoredGroup],
        *,
        new_builder: Callable[[], BatchBuilder],
        steps: StepStore,
    ) -> Packer:
        """The packer a runner stored (`value` and its `pending` groups, in packing order), or a new one
        when it stored none; behind the run directory `steps`, it skips what was committed since."""
        if value is None:
            state = PackerState(new_builder())
        else:
            state = value
            state.builder.restore_pending(list(pending))
        packer = cls(state)
        if steps.is_committed(state.builder.next_step):
            packer._skip_committed(steps)
        return packer

    def _skip_committed(self, steps: StepStore) -> None:
        builder = self.state.builder
        self.dropped = builder.drop_committed(steps.consumed_offsets(), steps.next_step())
        _LOG.warning(
            "packer behind the run directory: now at step %d, dropped %d groups a committed step holds",
            builder.next_step,
            self.dropped,
        )

    def add(
        self, items: Sequence[ScoredGroup | EndOfInput], *, shards: int, max_steps: int
    ) -> list[TrainBatch | InputExhausted]:
        """Take the groups and ends of input of one element: the batches they completed (up to step
        `max_steps`), then, once every one of the `shards` ended and every group it announced came,
        the final partial batch and the `InputExhausted` marker."""
        state, builder = self.state, self.state.builder
        groups = [item for item in items if isinstance(item, ScoredGroup)]
        for end in (item for item in items if not isinstance(item, ScoredGroup)):
            state.ended[end.shard] = end.groups
        state.groups_seen += len(groups)
        batches = builder.add_all(groups)
        exhausted = state.input_exhausted(shards) and not state.flushed
        if exhausted:
            final = builder.flush()
            batches += [final] if final is not None else []
            state.flushed = True
        out: list[TrainBatch | InputExhausted] = [batch for batch in batches if batch.step <= max_steps]
        return out + [InputExhausted(last_step=builder.next_step - 1)] if exhausted else out

    def save(self) -> PackerWrites:
        """What to store: the value, and the pending groups the stored ones lack. While the stored
        groups are the first pending ones (nothing was cut or dropped), the new ones are appended, so
        that an element's writes grow with its new groups only."""
        rest, pending = self.state.builder.split_pending()
        stored, self._stored = self._stored, pending
        prefix = len(stored) <= len(pending) and all(a is b for a, b in zip(stored, pending))
        return PackerWrites(
            dataclasses.replace(self.state, builder=rest),
            pending[len(stored) :] if prefix else pending,
            clear_first=not prefix,
        )
