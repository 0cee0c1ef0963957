"""The packer's state, Beam-free: one load from what a runner stored, one save of what it must store. The
stored pending groups are appended to while nothing is cut (each group written once), rewritten after a
cut or a restore; a state behind the run directory drops what committed steps hold."""

from __future__ import annotations

import pickle

from beam_rl.packing.batches import BatchBuilder, InputExhausted
from beam_rl.packing.packer import BatchCutter
from beam_rl.packing.state import Packer, PackerWrites
from beam_rl.scoring.advantages import get_algorithm
from beam_rl.scoring.group import score_group
from beam_rl.source import EndOfInput
from beam_rl.types import Rollout, Turn

GROUP_SIZE = 4


def _scored(index: int):
    rollouts = [Rollout(f"g{index}", "reverse_text", a, GROUP_SIZE, prompt_ids=[1, 2], index=index,
                        turns=[Turn([10 + a] * 3, [-0.5] * 3, "stop")], reward=float(a == 0))
                for a in range(GROUP_SIZE)]
    return score_group(rollouts, get_algorithm("grpo"), [], temperature=1.0)


class _Steps:
    """The run directory's committed steps, as the packer asks about them."""

    def __init__(self, committed: dict[int, set] | None = None) -> None:
        self.committed = committed or {}  # step -> the prompt offsets it consumed

    def is_committed(self, step: int) -> bool:
        return step in self.committed

    def consumed_offsets(self) -> set:
        return set().union(*self.committed.values())

    def next_step(self) -> int:
        return max(self.committed, default=0) + 1


class _Stored:
    """What a runner keeps, pickled: the value, and the pending groups as a list it appends to."""

    def __init__(self) -> None:
        self.value: bytes | None = None
        self.pending: list[bytes] = []
        self.appended = 0

    def load(self, steps: _Steps = _Steps()) -> Packer:
        value = None if self.value is None else pickle.loads(self.value)
        return Packer.load(value, [pickle.loads(g) for g in self.pending], steps=steps,
                           new_builder=lambda: BatchBuilder(BatchCutter(rollouts_per_step=3 * GROUP_SIZE), 1024, 1))

    def write(self, writes: PackerWrites) -> None:
        self.value = pickle.dumps(writes.value)
        if writes.clear_first:
            self.pending = []
        self.pending += [pickle.dumps(g) for g in writes.pending]
        self.appended += len(writes.pending)


def _element(stored: _Stored, items: list) -> tuple[list, PackerWrites]:
    packer = stored.load()
    out = packer.add(items, shards=1, max_steps=100)
    writes = packer.save()
    stored.write(writes)
    return out, writes


def _ids(writes: PackerWrites) -> tuple[list[str], bool]:
    return [g.group_id for g in writes.pending], writes.clear_first


def test_a_save_appends_the_new_pending_groups_until_a_cut_and_then_rewrites_what_is_left():
    stored = _Stored()  # three groups make a batch
    assert _ids(_element(stored, [_scored(0)])[1]) == (["g0"], False)
    assert _ids(_element(stored, [_scored(1)])[1]) == (["g1"], False)  # g0 is stored already
    out, writes = _element(stored, [_scored(2), _scored(3)])
    assert [b.group_ids for b in out] == [["g0", "g1", "g2"]] and _ids(writes) == (["g3"], True)
    out, writes = _element(stored, [EndOfInput(shard=0, groups=4)])
    assert [b.step for b in out[:-1]] == [2] and out[-1] == InputExhausted(last_step=2)
    # Each group that waited was written once; g2, cut in the element it came in, never.
    assert _ids(writes) == ([], True) and stored.pending == [] and stored.appended == 3
    assert _element(stored, [])[0] == []  # the end is announced once


def test_a_packer_kept_between_saves_appends_only_what_came_since_the_last():
    packer = _Stored().load()
    packer.add([_scored(0)], shards=1, max_steps=100)
    assert _ids(packer.save()) == (["g0"], False)
    assert _ids(packer.save()) == ([], False)
    packer.add([_scored(1)], shards=1, max_steps=100)
    assert _ids(packer.save()) == (["g1"], False)


def test_a_state_behind_the_run_directory_drops_what_committed_steps_hold_and_rewrites_the_stored_groups():
    stored, groups = _Stored(), [_scored(i) for i in range(4)]
    _element(stored, groups[:2])
    # Step 1 was committed (with g0, g1 and g9) after this state was saved: a restore of an older checkpoint.
    steps = _Steps({1: {r.prompt_offset for g in groups[:2] for r in g.rollouts} | {("reverse_text", 0, 9)}})
    packer = stored.load(steps)
    assert packer.dropped == 2 and packer.state.builder.next_step == 2
    (batch,) = packer.add(groups[2:] + [_scored(4)], shards=1, max_steps=100)
    assert batch.step == 2 and batch.group_ids == ["g2", "g3", "g4"]
    assert _ids(packer.save()) == ([], True)  # g0 and g1 leave the stored groups
