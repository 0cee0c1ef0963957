"""The train sink: scoring complete groups and cutting them, whole, into numbered train batches."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from beam_rl.packing.batches import BatchBuilder
from beam_rl.packing.packer import BatchCutter
from beam_rl.scoring.advantages import get_algorithm
from beam_rl.scoring.filters import OverlongFilter, StaleFilter, ZeroAdvantageFilter
from beam_rl.scoring.group import TOO_FEW_SCORED, score_group
from beam_rl.scoring.rewards import mark_reward_error
from beam_rl.types import Rollout, RolloutStatus, Turn

DR_GRPO = get_algorithm("dr_grpo")


def _rollout(group: str, attempt: int, reward: float, completion: int = 3, version: int = 0, **kw) -> Rollout:
    finish = kw.pop("finish_reason", "stop")
    turn = Turn(list(range(10, 10 + completion)), [-0.5] * completion, finish_reason=finish)
    return Rollout(group, "echo", attempt, 4, prompt_ids=[1, 2], turns=[turn], reward=reward,
                   policy_version_start=version, **kw)


def _group(group: str, rewards: list[float], **kw) -> list[Rollout]:
    return [_rollout(group, i, r, **kw) for i, r in enumerate(rewards)]


def test_score_group_drops_errored_and_cancelled_then_scores_survivors():
    rollouts = _group("e0-i0", [1.0, 0.0, 5.0, 5.0])
    rollouts[2].capture_error("TimeoutError: server 0")
    rollouts[3].status = RolloutStatus.CANCELLED
    scored = score_group(rollouts, DR_GRPO, [], temperature=0.7)
    # survivors [1, 0]: mean 0.5 -> advantages [0.5, -0.5]; the errored rewards play no part
    assert [r.advantage for r in rollouts] == [0.5, -0.5, 0.0, 0.0]
    assert [r.temperature for r in rollouts[:2]] == [0.7, 0.7]
    # Past scoring the group is records, shared between `rollouts` and `clean` so a later filter flag
    # shows in both.
    assert scored.group_id == "e0-i0" and scored.rollouts == [r.record() for r in rollouts]
    assert scored.clean == [r.record() for r in rollouts[:2]] and scored.clean[1] is scored.rollouts[1]
    assert [s.rollout_id for s in scored.samples] == ["e0-i0/0", "e0-i0/1"]
    np.testing.assert_allclose(scored.samples[1].advantages, [0, 0, -0.5, -0.5, -0.5])
    np.testing.assert_allclose(scored.samples[0].temperatures, [0.7] * 5, rtol=1e-6)


def test_filtered_rollouts_keep_their_reward_in_the_baseline():
    rollouts = _group("e0-i0", [1.0, 0.0, 0.0])
    rollouts[0].turns[0].finish_reason = "length"
    scored = score_group(rollouts, DR_GRPO, [OverlongFilter(mode="enforce")], temperature=1.0)
    # mean over all three survivors = 1/3 -> [2/3, -1/3, -1/3]; the truncated one is not trained on
    assert rollouts[0].filtered == "overlong" and scored.counts.enforced == {"overlong": 1}
    assert scored.clean == [r.record() for r in rollouts[1:]]
    for sample in scored.samples:
        np.testing.assert_allclose(sample.advantages[sample.loss_mask], [-1 / 3] * 3, rtol=1e-6)


def test_a_reward_error_is_left_out_of_its_groups_baseline_and_the_rest_trains():
    rollouts = _group("e0-i0", [1.0, 0.0, 0.5, 0.0])
    mark_reward_error(rollouts[3], "judge timed out")
    scored = score_group(rollouts, get_algorithm("grpo"), [], temperature=1.0, min_scored=2)
    # GRPO over the known rewards [1, 0, 0.5]: mean 0.5, Bessel std sqrt((0.25 + 0.25 + 0) / 2) = 0.5,
    # so A = (r - 0.5) / (0.5 + 1e-6) = [0.999998, -0.999998, 0]. Scoring the failure as 0 would have
    # given mean 0.375, std 0.4787 and A = [1.3055, -0.7833, 0.2611, -0.7833].
    assert [r.advantage for r in rollouts] == pytest.approx([0.999998, -0.999998, 0.0, 0.0], abs=1e-6)
    assert [r.rollout_id for r in scored.clean] == ["e0-i0/0", "e0-i0/1", "e0-i0/2"]
    assert scored.rollouts[3].status is RolloutStatus.REWARD_ERROR and scored.counts.enforced == {}
    np.testing.assert_allclose(scored.samples[0].advantages[scored.samples[0].loss_mask], [0.999998] * 3, rtol=1e-6)


def test_a_group_with_fewer_scored_rollouts_than_min_scored_is_not_trained_and_is_counted():
    rollouts = _group("e0-i0", [1.0, 0.0, 0.5, 0.0])
    for r in rollouts[1:]:
        mark_reward_error(r, "judge down")
    scored = score_group(rollouts, get_algorithm("grpo"), [ZeroAdvantageFilter(mode="enforce")], 1.0, min_scored=2)
    assert scored.clean == [] and scored.samples == []
    assert rollouts[0].filtered == TOO_FEW_SCORED and rollouts[0].advantage == 0.0
    assert scored.counts.enforced == {TOO_FEW_SCORED: 1}  # the zero-advantage filter did not run
    builder = _builder(cutter=BatchCutter(rollouts_per_step=2))
    assert builder.add(scored) == []
    (batch,) = builder.add(_scored("e0-i1", [1.0, 0.0]))
    assert batch.group_ids == ["e0-i1"] and batch.window["filtered"] == {TOO_FEW_SCORED: 1}
    assert batch.window["status"]["reward_error"] == 3 and batch.window["errored"] == 3
    # The same group with two known rewards is trained.
    rollouts = _group("e0-i2", [1.0, 0.0, 0.5, 0.0])
    for r in rollouts[2:]:
        mark_reward_error(r, "judge down")
    assert len(score_group(rollouts, DR_GRPO, [], 1.0, min_scored=2).clean) == 2


def test_score_group_rejects_mixed_or_empty_groups():
    with pytest.raises(ValueError, match="several groups"):
        score_group(_group("a", [1.0]) + _group("b", [0.0]), DR_GRPO, [], 1.0)
    with pytest.raises(ValueError, match="at least one rollout"):
        score_group([], DR_GRPO, [], 1.0)


def _builder(**kw) -> BatchBuilder:
    kw.setdefault("cutter", BatchCutter(rollouts_per_step=4))
    kw.setdefault("seq_len", 16)
    kw.setdefault("ranks", 2)
    return BatchBuilder(**kw)


def _scored(group: str, rewards: list[float], pre_filters=(), algorithm=DR_GRPO, **kw):
    return score_group(_group(group, rewards, **kw), algorithm, list(pre_filters), temperature=1.0)


def test_batches_are_cut_on_whole_groups_and_numbered():
    builder = _builder(cutter=BatchCutter(rollouts_per_step=4), next_step=7)
    assert builder.add(_scored("g0", [1, 0, 1])) == []
    (batch,) = builder.add(_scored("g1", [0, 1, 1]))  # 6 >= 4: both groups, whole
    assert batch.step == 7 and batch.group_ids == ["g0", "g1"]
    assert len(batch.micro_batches) == 2
    trained = sorted(s.rollout_id for rank in batch.micro_batches for mb in rank for s in mb.samples)
    assert trained == [f"g{g}/{i}" for g in range(2) for i in range(3)]
    assert all(mb.num_tokens <= 16 for rank in batch.micro_batches for mb in rank)
    assert builder.add(_scored("g2", [1, 0])) == [] and builder.next_step == 8
    assert builder.pending_rollouts == 2


def test_window_counts_every_rollout_since_the_last_batch():
    builder = _builder(cutter=BatchCutter(rollouts_per_step=3))
    errored = _group("g-err", [0.0, 0.0])
    errored[0].capture_error("HTTPError: 500")
    mark_reward_error(errored[1], "judge down")
    assert builder.add(score_group(errored, DR_GRPO, [], 1.0)) == []
    flat = _scored("g-flat", [1.0, 1.0], pre_filters=[ZeroAdvantageFilter(mode="enforce")], version=2)
    assert builder.add(flat) == []
    monitored = _scored("g-mon", [1.0, 1.0], pre_filters=[ZeroAdvantageFilter(mode="monitor")], version=3)
    assert builder.add(monitored) == []  # 2 clean rollouts pending
    (batch,) = builder.add(_scored("g-ok", [1.0, 0.0], completion=5, version=4))
    w = batch.window
    assert batch.step == 1 and batch.group_ids == ["g-mon", "g-ok"]
    assert w["group_ids"] == ["g-err", "g-flat", "g-mon", "g-ok"]
    assert w["rollouts"] == 8 and w["status"] == {"ok": 6, "error": 1, "cancelled": 0, "reward_error": 1}
    assert w["errored"] == 2  # generation and reward errors alike
    assert w["filtered"] == {"zero_advantage": 2}
    assert w["flagged"] == {"monitored": {"zero_advantage": 2}, "enforced": {"zero_advantage": 2}}
    assert w["trained_rollouts"] == 4 and w["samples"] == 4
    # ok rewards [1, 1, 1, 1, 1, 0] -> 5/6; completion tokens [3, 3, 3, 3, 5, 5] -> 22/6
    assert w["reward_mean"] == pytest.approx(5 / 6) and w["completion_tokens_mean"] == pytest.approx(22 / 6)
    # versions [0, 0, 2, 2, 3, 3, 4, 4]; step 1 trains policy 0, the oldest started at 0
    assert (w["policy_version_min"], w["policy_version_max"], w["staleness_max"]) == (0, 4, 0)
    assert w["tokens"] == 2 * 5 + 2 * 7  # prompt 2 + completion 3 or 5
    # the next batch starts a fresh window
    (nxt,) = builder.add(_scored("g-next", [0.0, 1.0, 0.5]))
    assert nxt.window["rollouts"] == 3 and nxt.window["group_ids"] == ["g-next"] and nxt.step == 2


def test_post_filters_get_the_step_and_a_fully_filtered_batch_takes_no_step():
    builder = _builder(cutter=BatchCutter(rollouts_per_step=2), post_filters=[StaleFilter(max_off_policy_steps=0)],
                       next_step=3)
    # step 3 trains policy 2; with no off-policy slack the oldest allowed start version is 2
    assert builder.add(_scored("old", [1.0, 0.0], version=1)) == []
    assert builder.next_step == 3
    (batch,) = builder.add(_scored("fresh", [1.0, 0.0], version=2))
    assert batch.step == 3 and batch.group_ids == ["fresh"]
    assert batch.window["filtered"] == {"stale": 2}
    assert batch.window["flagged"]["enforced"] == {"stale": 2}
    assert batch.window["group_ids"] == ["old", "fresh"] and batch.window["staleness_max"] == 1


def test_groups_arriving_together_train_the_one_that_would_go_stale_first():
    def steps(add) -> list[tuple[int, list[str], dict]]:
        builder = _builder(cutter=BatchCutter(rollouts_per_step=2), next_step=3,
                           post_filters=[StaleFilter(max_off_policy_steps=1)])
        batches = add(builder, [_scored("fresh", [1.0, 0.0], version=2), _scored("old", [1.0, 0.0], version=1)])
        batches.append(builder.flush())
        return [(b.step, b.group_ids, b.window["filtered"]) for b in batches if b is not None]

    # Step 3 trains policy 2 and takes tokens of version 1 or later; step 4 only of version 2 or later.
    assert steps(lambda builder, groups: builder.add_all(groups)) == [(3, ["old"], {}), (4, ["fresh"], {})]
    # One at a time in arrival order, "old" waits for step 4 and is dropped there as stale.
    assert steps(lambda builder, groups: [b for g in groups for b in builder.add(g)]) == [
        (3, ["fresh"], {}), (4, [], {"stale": 2})]


def test_reinforce_pp_is_whitened_over_the_batch():
    algorithm = get_algorithm("reinforce_plus_plus_baseline")
    builder = _builder(cutter=BatchCutter(rollouts_per_step=4))
    builder.add(_scored("a", [1.0, 0.0], algorithm=algorithm, completion=1))
    (batch,) = builder.add(_scored("b", [3.0, 1.0], algorithm=algorithm, completion=1))
    # group step: a -> [0.5, -0.5], b -> [1, -1]; one trainable token each: [0.5, -0.5, 1, -1]
    # mean 0; Bessel var = (0.25 + 0.25 + 1 + 1) / 3 = 5/6; sqrt(5/6) = 0.9128709
    by_id = {s.rollout_id: s.advantages[s.loss_mask][0] for rank in batch.micro_batches for mb in rank
             for s in mb.samples}
    expected = {"a/0": 0.5477226, "a/1": -0.5477226, "b/0": 1.0954451, "b/1": -1.0954451}
    assert by_id == pytest.approx(expected, rel=1e-6)


def test_flush_returns_the_partial_batch_once():
    builder = _builder(cutter=BatchCutter(rollouts_per_step=100))
    assert builder.flush() is None
    builder.add(_scored("g0", [1.0, 0.0]))
    batch = builder.flush()
    assert batch is not None and batch.step == 1 and batch.group_ids == ["g0"]
    assert builder.flush() is None and builder.next_step == 2


def test_builder_and_scored_groups_pickle():
    builder = _builder()
    builder.add(_scored("g0", [1.0, 0.0]))
    restored = pickle.loads(pickle.dumps(builder))
    (batch,) = restored.add(_scored("g1", [1.0, 0.0]))
    assert batch.group_ids == ["g0", "g1"]


def test_flush_commits_a_tail_of_untrainable_groups_as_a_step_without_samples():
    builder = BatchBuilder(BatchCutter(rollouts_per_step=8), seq_len=64, ranks=2, next_step=3)
    assert builder.flush() is None  # nothing seen since the last batch: no step
    rollouts = _group("e0-i7", [1.0, 0.0, 1.0, 0.0])
    for r in rollouts:
        r.capture_error("InferenceTimeout: server 1")
    assert builder.add(score_group(rollouts, DR_GRPO, [], temperature=1.0)) == []
    batch = builder.flush()
    # The errored group must still be committed (its offsets consumed), as a step with no samples.
    assert batch.step == 3 and batch.group_ids == [] and batch.micro_batches == [[], []]
    assert [r.rollout_id for r in batch.rollouts] == [r.rollout_id for r in rollouts]
    assert batch.window["errored"] == 4 and batch.window["group_ids"] == ["e0-i7"]
    assert builder.next_step == 4 and builder.flush() is None


def test_a_clean_rollouts_record_holds_its_samples_token_arrays_and_a_scored_group_pickles_them_once():
    rollouts = _group("e0-i0", [1.0, 0.0, 0.5, 0.5], completion=40)
    rollouts[3].capture_error("HTTPError: 500")
    scored = score_group(rollouts, DR_GRPO, [], temperature=1.0)
    for record, sample in zip(scored.clean, scored.samples, strict=True):
        assert record.tokens.input_ids is sample.input_ids and record.tokens.logprobs is sample.logprobs
        assert record.tokens.policy_versions is sample.policy_versions
    back = pickle.loads(pickle.dumps(scored))
    assert back.rollouts == scored.rollouts and back.clean[1] is back.rollouts[1]
    for record, sample in zip(back.clean, back.samples, strict=True):
        assert record.tokens.input_ids is sample.input_ids
    # Each clean rollout's 42 tokens once: int32 id, uint8 mask, 4 x float32/int32 = 21 bytes a token.
    token_bytes = 3 * 42 * 21
    assert len(pickle.dumps(scored)) < token_bytes + 4 * 1200


def test_the_window_records_when_its_batch_was_cut():
    clock = iter([100.0, 200.0])
    builder = _builder(cutter=BatchCutter(rollouts_per_step=2), clock=lambda: next(clock))
    errored = _group("g-err", [0.0])
    errored[0].capture_error("HTTPError: 500")
    builder.add(score_group(errored, DR_GRPO, [], 1.0))
    (first,) = builder.add(_scored("g0", [1.0, 0.0]))
    (second,) = builder.add(_scored("g1", [1.0, 0.0]))
    assert [r.t_packed for r in first.rollouts] == [100.0] * 3 and [r.t_packed for r in second.rollouts] == [200.0] * 2


def test_a_batchs_window_and_its_samples_hold_one_copy_of_each_token_array():
    builder = _builder(cutter=BatchCutter(rollouts_per_step=4), seq_len=256)
    builder.add(_scored("g0", [1.0, 0.0], completion=50))
    flat = _scored("g-flat", [1.0, 1.0], pre_filters=[ZeroAdvantageFilter(mode="enforce")], completion=50)
    builder.add(pickle.loads(pickle.dumps(flat)))  # as it arrives from the scoring stage
    (batch,) = builder.add(pickle.loads(pickle.dumps(_scored("g1", [1.0, 0.0], completion=50))))
    samples = {s.rollout_id: s for rank in batch.micro_batches for mb in rank for s in mb.samples}
    for record in batch.rollouts:
        if record.rollout_id in samples:
            assert record.tokens.input_ids is samples[record.rollout_id].input_ids
        else:  # filtered: no sample, the record holds its own
            assert record.filtered == "zero_advantage" and record.tokens.num_tokens == 52
    # Pickled (to the writer), each array once: 4 samples and 2 filtered records' ids, logprobs, versions.
    sample_bytes = 4 * 52 * 21
    filtered_bytes = 2 * 52 * 12
    assert len(pickle.dumps(batch)) < sample_bytes + filtered_bytes + 6 * 1500


def test_split_pending_stores_each_token_once_with_its_group_and_restore_gives_them_back():
    builder = _builder(cutter=BatchCutter(rollouts_per_step=4), seq_len=256, next_step=3,
                       post_filters=[StaleFilter(max_off_policy_steps=0)])
    builder.add(_scored("g0", [1.0, 0.0], completion=100))
    builder.add(_scored("g-flat", [1.0, 1.0], pre_filters=[ZeroAdvantageFilter(mode="enforce")], completion=100))
    rest, pending = builder.split_pending()
    # Nothing to train in g-flat, but it is held like g0 so that its tokens are stored once, with it:
    # the value (rewritten with every element) holds the four window records without any token array.
    assert [g.group_id for g in pending] == ["g0", "g-flat"]
    value, bag = pickle.dumps(rest), [pickle.dumps(g) for g in pending]
    # (One record keeping its three arrays would add 102 * 12 bytes to the records' own fields.)
    assert len(value) < 4 * 102 * 6 and all(len(b) > 2 * 102 * 12 for b in bag)
    assert all(r.tokens.input_ids is not None for r in builder._window)  # the builder itself keeps them
    restored = pickle.loads(value)
    restored.restore_pending([pickle.loads(b) for b in bag])
    g0, flat = restored.pending
    window = {r.rollout_id: r for r in restored._window}
    for record, sample in zip(g0.clean, g0.samples, strict=True):
        assert window[record.rollout_id] is record and record.tokens.input_ids is sample.input_ids
    assert all(window[r.rollout_id] is r and r.tokens.input_ids.shape == (102,) for r in flat.rollouts)
    (batch,) = restored.add(_scored("g1", [1.0, 0.0], version=2, completion=100))  # g0 is stale at step 3
    assert batch.group_ids == ["g1"] and {r.rollout_id: r.filtered for r in batch.rollouts}["g0/0"] == "stale"
    assert [r.tokens.num_tokens for r in batch.rollouts] == [102] * 6
    assert restored.pending == []  # all three were the cohort: g1 trained, g0 flagged, g-flat only observed


def test_a_builder_pickled_whole_restores_its_window_and_pending_groups_as_one():
    builder = _builder(cutter=BatchCutter(rollouts_per_step=8))
    builder.add(_scored("g0", [1.0, 0.0]))
    restored = pickle.loads(pickle.dumps(builder))
    (group,) = restored.pending
    assert group.clean[0] is restored._window[0] and group.clean[0].tokens.input_ids is group.samples[0].input_ids


def test_every_generated_token_is_counted_once_by_its_fate():
    builder = _builder(cutter=BatchCutter(rollouts_per_step=4), seq_len=256, next_step=3,
                       post_filters=[StaleFilter(max_off_policy_steps=0)])
    trained = _group("g-ok", [1.0, 0.0], completion=5, version=2)
    trained[1].discarded_tokens["stale"] = 7  # regenerated once in dispatch before these turns
    flat = _group("g-flat", [1.0, 1.0], completion=4, version=2)
    broken = _group("g-broken", [1.0, 0.0, 0.0, 1.0], completion=3, version=2)
    broken[0].capture_error("InferenceConnectionError: server died")
    broken[0].turns, broken[0].discarded_tokens["server_failure"] = [], 6
    broken[1].status, broken[1].turns = RolloutStatus.CANCELLED, []
    broken[1].discarded_tokens["cancelled"] = 2
    mark_reward_error(broken[2], "judge timed out")
    stale = _group("g-stale", [1.0, 0.0], completion=9, version=1)  # step 3 trains from version 2 only
    assert builder.add(score_group(flat, DR_GRPO, [ZeroAdvantageFilter(mode="enforce")], 1.0)) == []
    assert builder.add(score_group(broken, DR_GRPO, [], 1.0)) == []
    assert builder.add(score_group(stale, DR_GRPO, [], 1.0)) == []
    (batch,) = builder.add(score_group(trained, DR_GRPO, [], 1.0))
    assert batch.group_ids == ["g-broken", "g-ok"]
    assert batch.window["tokens_by_fate"] == {
        "trained": 2 * 5 + 3,  # g-ok and the one clean g-broken rollout
        "stale": 7 + 2 * 9,  # regenerated in dispatch, and g-stale flagged at packing
        "filtered/zero_advantage": 2 * 4,
        "server_failure": 6,
        "cancelled": 2,
        "reward_error": 3,
    }
    generated = sum(r.completion_tokens + sum(r.discarded_tokens.values())
                    for r in flat + broken + stale + trained)
    assert sum(batch.window["tokens_by_fate"].values()) == generated
    assert batch.window["tokens"] == sum(len(s) for rank in batch.micro_batches for mb in rank for s in mb.samples)


def test_tokens_of_a_batch_the_post_filters_rejected_whole_are_counted_with_the_next_one():
    builder = _builder(cutter=BatchCutter(rollouts_per_step=2), seq_len=256, next_step=5,
                       post_filters=[StaleFilter(max_off_policy_steps=0)])
    assert builder.add(_scored("g-old", [1.0, 0.0], completion=4, version=1)) == []  # all stale: no step
    (batch,) = builder.add(_scored("g-new", [1.0, 0.0], completion=3, version=4))
    assert batch.step == 5 and batch.window["tokens_by_fate"] == {"stale": 8, "trained": 6}
    assert pickle.loads(pickle.dumps(builder))._cut_fates == {}  # counted once, then forgotten
