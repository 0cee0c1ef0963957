"""The packer's Beam state, its only copy: read back for every element, it cuts the batches a packer
kept in memory cuts from the same elements (the groups of one element oldest token first); each pending
group is stored once, with its tokens, rather than rewritten with every element; a copy restored from an
older checkpoint skips what was committed since; the end of input waits for every shard; and a value
stored before the packer's state moved to the domain restores."""

from __future__ import annotations

import base64
import pickle

from beam_rl import wiring
from beam_rl.config import config_from_dict
from beam_rl.packing.batches import InputExhausted
from beam_rl.scoring.advantages import get_algorithm
from beam_rl.scoring.filters import ZeroAdvantageFilter
from beam_rl.scoring.group import score_group
from beam_rl.source import EndOfInput
from beam_rl.types import Rollout, Turn
from transforms.pack import _PackFn
from tests.support.fakes import StateBag, StateValue

GROUP_SIZE, GROUPS = 4, 9


def _scored(index: int, version: int):
    rollouts = [Rollout(f"g{index}", "reverse_text", a, GROUP_SIZE, prompt_ids=[1, 2],
                        turns=[Turn([10 + a] * (3 + a), [-0.5] * (3 + a), "stop")], reward=float(a == index % GROUP_SIZE),
                        policy_version_start=version) for a in range(GROUP_SIZE)]
    return score_group(rollouts, get_algorithm("grpo"), [], temperature=1.0)


def _elements():
    # Versions advance with the groups; g6 is far behind, so the stale filter flags it at packing,
    # after it waited in state for its batch partner.
    versions = [0, 0, 1, 1, 2, 2, 0, 3, 3]
    return [_scored(i, v) for i, v in enumerate(versions)] + [EndOfInput(shard=0, groups=GROUPS)]


def _packer(run_dir, shards: int = 1, **config) -> _PackFn:
    fn = _PackFn(config_from_dict({
        "run": {"dir": str(run_dir), "max_steps": 100},
        "envs": [{"name": "reverse_text", "group_size": GROUP_SIZE}],
        "batch": {"rollouts_per_step": 2 * GROUP_SIZE},
        "off_policy": {"max_async_level": 1, "max_off_policy_steps": 1},
        "dispatch": {"shards": shards},
        **config,
    }), 1, check_staleness=True, run_dir=str(run_dir))
    fn.setup()
    return fn


def _pack(tmp_path, chunks: tuple[int, ...] = (1,)):
    """Feed the groups in elements of `chunks[i % len(chunks)]` groups each, as the runner would."""
    fn, state, pending, out = _packer(tmp_path), StateValue(), StateBag(), []
    items, i = _elements(), 0
    while items:
        size = chunks[i % len(chunks)]
        element, items, i = items[:size], items[size:], i + 1
        out += fn.process(("packer", element), state=state, pending=pending)
    assert isinstance(out[-1], InputExhausted) and out[-1].last_step == len(out) - 1
    return out[:-1], state, pending


def _summary(batches):
    return [(b.step, b.group_ids, [(r.rollout_id, r.filtered) for r in b.rollouts],
             [[s.rollout_id for s in mb.samples] for rank in b.micro_batches for mb in rank]) for b in batches]


def _in_memory(run_dir, chunks: tuple[int, ...]):
    """What one BatchBuilder that never leaves memory cuts from the same elements."""
    builder = wiring.batch_builder(_packer(run_dir)._config, 1, True)
    groups, out, i = _elements()[:-1], [], 0
    while groups:
        size = chunks[i % len(chunks)]
        element, groups, i = groups[:size], groups[size:], i + 1
        out += builder.add_all(element)
    final = builder.flush()
    return out + ([final] if final is not None else [])


def test_a_packer_read_back_from_beam_state_cuts_what_one_kept_in_memory_cuts(tmp_path):
    for name, chunks in (("one", (1,)), ("chunked", (3, 1, 4))):
        from_state, _, _ = _pack(tmp_path / name, chunks=chunks)
        assert _summary(from_state) == _summary(_in_memory(tmp_path / f"{name}-memory", chunks))
    one_by_one, _, _ = _pack(tmp_path / "again")
    assert [b.step for b in one_by_one] == [1, 2, 3, 4, 5]
    stale = {rid for _, _, window, _ in _summary(one_by_one) for rid, why in window if why == "stale"}
    assert stale == {f"g6/{a}" for a in range(GROUP_SIZE)}  # the flag reached the window records


def test_groups_of_one_element_are_packed_oldest_token_first(tmp_path):
    fn, state, pending = _packer(tmp_path), StateValue(), StateBag()
    for element in ([_scored(0, 0), _scored(1, 0)], [_scored(2, 1), _scored(3, 1)]):
        list(fn.process(("packer", element), state=state, pending=pending))  # steps 1 and 2
    # Step 3 takes tokens of version 1 or later, step 4 of version 2 or later. g6 (version 1) arrives
    # behind g4 and g5 (version 2): packed first, it trains in step 3, where in arrival order it would
    # have waited for step 4 and gone stale there.
    (batch,) = fn.process(("packer", [_scored(4, 2), _scored(5, 2), _scored(6, 1)]), state=state, pending=pending)
    assert batch.step == 3 and batch.group_ids == ["g6", "g4"]
    (batch, _) = fn.process(("packer", [EndOfInput(shard=0, groups=7)]), state=state, pending=pending)
    assert batch.step == 4 and batch.group_ids == ["g5"]
    assert not any(r.filtered == "stale" for r in batch.rollouts)


def test_each_pending_group_is_stored_once_and_the_value_holds_none_of_its_tokens(tmp_path):
    _, state, pending = _pack(tmp_path)
    # Two groups make a batch: every other group waits for its partner, stored once meanwhile.
    assert pending.added == 5 and not pending.items  # g0, g2, g4, g6, g8 waited; all cut by the end
    group_bytes = len(pickle.dumps(_scored(0, 0)))
    # The window's records of a pending group are in the value without the token arrays its samples hold.
    assert max(state.writes) < group_bytes


def test_a_group_with_nothing_to_train_is_stored_once_and_its_tokens_reach_the_window(tmp_path):
    fn, state, pending = _packer(tmp_path), StateValue(), StateBag()
    same = [Rollout("flat", "reverse_text", a, GROUP_SIZE, prompt_ids=[1, 2], reward=1.0,
                    turns=[Turn([7] * 200, [-0.5] * 200, "stop")]) for a in range(GROUP_SIZE)]
    flat = score_group(same, get_algorithm("grpo"), [ZeroAdvantageFilter(mode="enforce")], temperature=1.0)
    assert list(fn.process(("packer", [_scored(0, 0), flat]), state=state, pending=pending)) == []
    # Its 4 x 202 tokens went to the bag with it (12 bytes each in a record), not to the value.
    assert pending.added == 2 and max(state.writes) < 4 * 202 * 12
    (batch,) = fn.process(("packer", [_scored(1, 0)]), state=state, pending=pending)
    window = {r.rollout_id: r for r in batch.rollouts}
    assert window["flat/0"].filtered == "zero_advantage"
    assert window["flat/0"].tokens.input_ids.tolist() == [1, 2] + [7] * 200
    assert pending.items == []  # cut, and the flat group left with the window


def test_a_packer_restored_from_an_older_checkpoint_skips_what_was_committed_since(tmp_path):
    """Flink restores Beam's copy from a checkpoint, and the run directory keeps the steps committed
    since: the groups those steps hold are dropped and their step numbers are not given out again."""
    import copy

    from beam_rl.rundir import RunDir
    from tests.support.step_writer import InProcessWriter

    config = config_from_dict({
        "run": {"dir": str(tmp_path), "max_steps": 100},
        "envs": [{"name": "reverse_text", "group_size": GROUP_SIZE}],
        "batch": {"rollouts_per_step": 2 * GROUP_SIZE},
        "runner": {"name": "flink-local"},
    })
    groups = [_scored(i, 0) for i in range(8)]
    for i, group in enumerate(groups):  # each group its own prompt offset
        for record in group.rollouts:
            record.index = i
    writer = InProcessWriter(str(tmp_path))
    fn, state, pending = _PackFn(config, 1, False, str(tmp_path)), StateValue(), StateBag()
    fn.setup()

    def feed(group):
        return [step for batch in fn.process(("packer", [group]), state=state, pending=pending)
                for step in writer.process(batch)]

    assert feed(groups[0]) + feed(groups[1]) + feed(groups[2]) == [1]
    checkpoint = copy.deepcopy((state, pending))  # g2 pending, next step 2
    assert feed(groups[3]) == [2]  # g2 + g3, committed after the checkpoint
    state, pending = checkpoint  # the restore
    assert feed(groups[4]) == [] and feed(groups[5]) == [3]  # g2 dropped, step 2 not reused
    run_dir = RunDir(tmp_path)
    assert run_dir.committed_steps() == [1, 2, 3]
    assert [run_dir.read_commit(s).group_ids for s in (1, 2, 3)] == [["g0", "g1"], ["g2", "g3"], ["g4", "g5"]]


def test_the_last_batch_waits_for_every_shards_end_of_input_and_every_group_it_announced(tmp_path):
    fn, state, pending = _packer(tmp_path, shards=2), StateValue(), StateBag()
    groups = [_scored(i, 0) for i in range(3)]

    def feed(*items):
        return list(fn.process(("packer", list(items)), state=state, pending=pending))

    assert [b.step for b in feed(groups[0], groups[1])] == [1]
    # Shard 0 is done after 2 groups; shard 1 announced 1 group that has not arrived yet.
    assert feed(EndOfInput(shard=0, groups=2), EndOfInput(shard=1, groups=1)) == []
    last = feed(groups[2])
    assert [type(x) for x in last] == [type(last[0]), InputExhausted] and last[0].step == 2
    assert last[0].group_ids == ["g2"] and last[1].last_step == 2


# A value today's packer state was stored as before it moved to beam_rl/packing/state.py (pickled at
# 09b3e29 as `transforms.pack._PackerState`): a builder at step 4, no groups pending, 3 groups seen, and
# shard 0 ended after 5. Flink savepoints hold such values.
_SAVED_BEFORE_THE_MOVE = base64.b64decode(
    "gASVBgIAAAAAAACMD3RyYW5zZm9ybXMucGFja5SMDF9QYWNrZXJTdGF0ZZSTlCmBlH2UKIwHYnVpbGRlcpSMF2JlYW1fcmwucGFja2lu"
    "Zy5iYXRjaGVzlIwMQmF0Y2hCdWlsZGVylJOUKYGUfZQojAZjdXR0ZXKUjBZiZWFtX3JsLnBhY2tpbmcucGFja2VylIwLQmF0Y2hDdXR0"
    "ZXKUk5QpgZR9lCiMEXJvbGxvdXRzX3Blcl9zdGVwlEsIjAx0b2tlbl9idWRnZXSUTnVijAdzZXFfbGVulE0ABIwFcmFua3OUSwGMDHBv"
    "c3RfZmlsdGVyc5RdlIwJbmV4dF9zdGVwlEsEjAZfY2xvY2uUjAR0aW1llIwEdGltZZSTlIwIX3BlbmRpbmeUXZSMB193aW5kb3eUXZSM"
    "Dl93aW5kb3dfZ3JvdXBzlF2UjA5fd2luZG93X2NvdW50c5SMF2JlYW1fcmwuc2NvcmluZy5maWx0ZXJzlIwMRmlsdGVyQ291bnRzlJOU"
    "KYGUfZQojAltb25pdG9yZWSUjAtjb2xsZWN0aW9uc5SMB0NvdW50ZXKUk5R9lIWUUpSMCGVuZm9yY2VklGgrfZSFlFKUdWKMCl9jdXRf"
    "ZmF0ZXOUaCt9lIWUUpR1YowLZ3JvdXBzX3NlZW6USwOMBWVuZGVklH2USwBLBXOMB2ZsdXNoZWSUiXViLg==")


def test_a_packer_state_stored_before_the_domain_owned_it_restores(tmp_path):
    fn, state, pending = _packer(tmp_path), StateValue(), StateBag()
    state.raw = _SAVED_BEFORE_THE_MOVE
    assert list(fn.process(("packer", [_scored(0, 0)]), state=state, pending=pending)) == []
    assert pending.items and state.read().groups_seen == 4
    batch, end = fn.process(("packer", [_scored(1, 0)]), state=state, pending=pending)
    assert batch.step == 4 and batch.group_ids == ["g0", "g1"] and end == InputExhausted(last_step=4)
