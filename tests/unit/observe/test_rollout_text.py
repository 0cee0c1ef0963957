"""A step's rollouts as text (`beam-rl inspect --step N --samples K`) and as plain rows for W&B: every token
shown (special ones visibly, undecodable ones as <id:N>), the environment's tokens between turns marked,
policy-version changes inside a turn, errors and filters."""

from __future__ import annotations

import re

import pytest

from beam_rl.model.location import tokenizer_for
from beam_rl.config import config_from_dict
from beam_rl.observe.rollout_text import TokenText, step_sample_rows, tracker_sample_rows, window_rows
from beam_rl.rundir import RunDir
from beam_rl.types import Rollout, TrainBatch, Turn
from tests.support.cli import RED, coloured, run_cli

_STYLE = re.compile(r"\x1b\[[0-9;]*m")
DIM = "\x1b[2m"
TOKENIZER = tokenizer_for("tiny")
IM_START, IM_END = 1, 2  # the tiny tokenizer's special ids


def _ids(text: str) -> list[int]:
    return TOKENIZER.encode(text)


def _rollouts() -> list[Rollout]:
    """Group g0: a two-turn rollout whose second turn changes policy version, and a failed one; group g1:
    a flagged rollout whose completion holds an id the tokenizer has no token for."""
    prompt = [IM_START, *_ids("user\nGuess my number."), IM_END, IM_START, *_ids("assistant\n")]
    two_turns = Rollout(
        "guess/e0-i0", "guess", 0, 2, prompt_ids=prompt, reward=1.0, advantage=0.5, server="http://127.0.0.1:1",
        dispatch_worker="host:1", score_worker="host:2", policy_version_start=1, policy_version_end=2,
        turns=[Turn(_ids("5") + [IM_END], [-0.5, -0.25], "stop", policy_versions=[1, 1]),
               Turn(_ids(" 7 was it") + [IM_END], [-0.5] * 6, "stop",  # " 7" sampled by v1, the rest by v2
                    env_ids=[IM_START, *_ids("user\nhigher"), IM_END], policy_versions=[1, 1, 2, 2, 2, 2])])
    failed = Rollout("guess/e0-i0", "guess", 1, 2, prompt_ids=prompt, server="http://127.0.0.1:1",
                     policy_version_start=1, policy_version_end=1)
    failed.capture_error("TimeoutError: server 0 did not answer in 60 s")
    odd = Rollout("guess/e0-i1", "guess", 0, 2, prompt_ids=prompt, filtered="zero_advantage",
                  turns=[Turn([*_ids("héllo"), 600, IM_END], [-1.0] * 7, "length", policy_versions=[3] * 7)])
    return [two_turns, failed, odd]


@pytest.fixture
def run(tmp_path) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.write_config(config_from_dict({"envs": [{"name": "arithmetic"}]}).model_dump(mode="json"))
    run.write_step(TrainBatch(step=1, micro_batches=[[]], group_ids=[],
                              window={"rollouts": 3, "group_ids": ["guess/e0-i0", "guess/e0-i1"],
                                      "tokens_by_fate": {"trained": 8, "server_failure": 5,
                                                         "filtered/zero_advantage": 7}}),
                   window=_rollouts())
    return run


def test_every_token_is_shown_once_in_order():
    text = TokenText(TOKENIZER)
    chars = _ids("héllo 中")  # é and 中 are split over byte-level tokens
    ids = [IM_START, *chars, 600, -3, chars[1], *_ids("\x16ok"), IM_END]
    pieces = text.pieces(ids)
    assert [i for piece in pieces for i in piece.ids] == ids  # none lost, none twice, in order
    assert [(p.kind, p.text) for p in pieces] == [
        ("special", "<|im_start|>"), ("text", "héllo 中"), ("unknown", "<id:600>"), ("unknown", "<id:-3>"),
        ("unknown", f"<id:{chars[1]}>"),  # a lone first byte of é is not text
        ("text", "\\x16ok"), ("special", "<|im_end|>")]


def test_inspect_shows_a_steps_first_rollouts_as_text(run, monkeypatch):
    status, lines = run_cli(monkeypatch, "inspect", str(run.path), "--step", "1", "--samples", "2")
    assert status == 0
    plain = [_STYLE.sub("", line).strip("│ ") for line in lines]
    assert plain[0] == f"step 1: 2 of the 3 rollouts in its window ({run.window_path(1)})"
    assert plain[1] == ("tokens by fate: trained 8, filtered/zero_advantage 7, server_failure 5; "
                        "goodput 0.400 of 20 generated")
    assert sum("guess/e0-i" in line and "(guess)" in line for line in plain) == 2  # two panels, by title
    for expected in (
        "status ok  reward 1  advantage 0.5  clean",
        "policy versions: sent v1, finished v2; tokens v1..v2; turn 1: v1->v2 at token 2",
        "server http://127.0.0.1:1  dispatch worker host:1  score worker host:2",
        "prompt (14 tokens)", "<|im_start|>user", "Guess my number.<|im_end|><|im_start|>assistant",
        "turn 0: completion (2 tokens, finish stop)", "5<|im_end|>",
        "turn 1: environment (6 tokens, context)", "<|im_start|>user", "higher<|im_end|>",
        "turn 1: completion (6 tokens, finish stop)", "⟨v1⟩ 7⟨v2⟩ was it<|im_end|>",
        "status error  reward 0  advantage 0  left out of its group's scoring",
        "error: TimeoutError: server 0 did not answer in 60 s",
    ):
        assert expected in plain, expected
    assert "guess/e0-i1/0" not in "".join(plain)  # only the first two
    assert any(f"{DIM}<|im_end|>" in line for line in lines)  # special tokens dim
    assert any(f"{RED}error: TimeoutError: server 0" in line for line in lines)  # errors red


def test_a_rollout_or_group_is_chosen_by_id_and_its_step_found(run, monkeypatch):
    status, lines = run_cli(monkeypatch, "inspect", str(run.path), "--rollout", "guess/e0-i1/0")
    plain = [_STYLE.sub("", line).strip("│ ") for line in lines]
    assert status == 0 and plain[0].startswith("step 1: 1 of the 3 rollouts")
    assert "status ok  reward 0  advantage 0  filtered: zero_advantage" in plain
    assert "héllo<id:600><|im_end|>" in plain
    status, lines = run_cli(monkeypatch, "inspect", str(run.path), "--step", "1", "--rollout", "guess/e0-i0")
    assert status == 0 and _STYLE.sub("", lines[0]).startswith("step 1: 2 of the 3 rollouts")


@pytest.mark.parametrize("argv, message", [
    (["--step", "7"], "{run}: step 7 is not committed (committed steps: 1..1)"),
    (["--rollout", "guess/e9-i9/0"], "{run}: no committed step holds guess/e9-i9/0 (committed steps: 1..1)"),
    (["--step", "1", "--rollout", "nope"], "step 1's window holds no rollout or group nope"),
])
def test_a_bad_step_or_rollout_is_one_red_line(run, monkeypatch, argv, message):
    status, lines = run_cli(monkeypatch, "inspect", str(run.path), *argv)
    assert status == 2 and coloured(lines, RED) == [message.format(run=run.path)] and len(lines) == 1


def test_a_run_without_config_needs_a_tokenizer(run, monkeypatch):
    run.config_path.unlink()
    status, lines = run_cli(monkeypatch, "inspect", str(run.path), "--step", "1")
    assert status == 2 and "give --tokenizer" in coloured(lines, RED)[0]
    status, lines = run_cli(monkeypatch, "inspect", str(run.path), "--step", "1", "--tokenizer", "tiny")
    assert status == 0


def test_sample_rows_for_the_tracker_are_plain_strings_and_numbers(run):
    rows = step_sample_rows(run, 1, TOKENIZER, count=2)
    assert [r["rollout_id"] for r in rows] == ["guess/e0-i0/0", "guess/e0-i1/0"]  # spread over the window
    first = rows[0]
    assert first["prompt"] == "<|im_start|>user\nGuess my number.<|im_end|><|im_start|>assistant\n"
    assert first["completion"] == "5<|im_end|>\n[env] <|im_start|>user\nhigher<|im_end|>\n 7 was it<|im_end|>"
    assert (first["reward"], first["advantage"], first["filtered"], first["status"]) == (1.0, 0.5, "", "ok")
    assert all(isinstance(v, (str, int, float)) for row in rows for v in row.values())
    assert [list(r) for r in rows] == [list(first)] * 2  # the same columns in every row
    assert tracker_sample_rows(run, "tiny", count=3)(1) == step_sample_rows(run, 1, TOKENIZER, count=3)


def test_window_rows_first_k_spread_and_by_id(run):
    window = run.read_window(1)
    assert [r["rollout_id"] for r in window_rows(window, 2)] == ["guess/e0-i0/0", "guess/e0-i0/1"]
    assert [r["rollout_id"] for r in window_rows(window, 2, spread=True)] == ["guess/e0-i0/0", "guess/e0-i1/0"]
    assert [r["rollout_id"] for r in window_rows(window, 10)] == ["guess/e0-i0/0", "guess/e0-i0/1", "guess/e0-i1/0"]
    assert [r["rollout_id"] for r in window_rows(window, rollout_ids=["guess/e0-i1/0", "guess/e0-i0"])] == [
        "guess/e0-i1/0", "guess/e0-i0/0", "guess/e0-i0/1"]
