"""Tests of the bundled environments and their registry, driven by a scripted completion client."""

from __future__ import annotations

import asyncio
import operator
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from beam_rl.envs import ENVIRONMENTS, make_env, register_env, registry
from beam_rl.envs.agent import BlackBoxAgent
from beam_rl.envs.arithmetic import Arithmetic, ArithmeticEasy, first_integer
from beam_rl.envs.base import Completion, SamplingParams, Trajectory, chat_prompt_ids
from beam_rl.envs.code import Code
from beam_rl.envs.data import make_datasets
from beam_rl.envs.datasets import DatasetError
from beam_rl.envs.guess_number import CORRECT, HIGHER, LOWER, NO_GUESS, GuessNumber, hint
from beam_rl.envs.reverse_text import ReverseText, similarity
from beam_rl.envs.tool_use import ToolArithmetic
from beam_rl.envs.verifiers_env import Verifiers
from beam_rl.types import Turn
from tests.support.fakes import ScriptedClient

ROW = {"secret": 7, "low": 1, "high": 10}
QUESTION = "Guess my secret integer between 1 and 10. Reply with one number."


def ids(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def answer(tok: Any, text: str) -> Trajectory:
    """A single-turn trajectory whose completion is `text` (tokenized, no EOS)."""
    token_ids = ids(tok, text)
    return Trajectory([Turn(token_ids, [-0.1] * len(token_ids), "stop")])


def completion(tok: Any, text: str, stop: bool = True) -> Completion:
    """A completion of `text`, ending with EOS like a server's when it stopped on its own."""
    token_ids = ids(tok, text) + ([tok.eos_token_id] if stop else [])
    return Completion(token_ids, [-0.25] * len(token_ids), "stop" if stop else "length")


def chatml(*messages: tuple[str, str]) -> str:
    turns = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)
    return turns + "<|im_start|>assistant\n"


def hint_ids(tok: Any, hint_text: str) -> list[int]:
    """The environment's answer after a turn that ended with <|im_end|>: a user turn, then the assistant's."""
    return ids(tok, f"\n<|im_start|>user\n{hint_text}<|im_end|>\n<|im_start|>assistant\n")


# --- Registry --------------------------------------------------------------------------------------


def test_registry_holds_the_bundled_environments(tok: Any) -> None:
    assert {name: cls for name, cls in ENVIRONMENTS.items()} == {
        "agent": BlackBoxAgent,
        "arithmetic": Arithmetic,
        "arithmetic_easy": ArithmeticEasy,
        "reverse_text": ReverseText,
        "guess_number": GuessNumber,
        "code": Code,
        "tool_arithmetic": ToolArithmetic,
        "verifiers": Verifiers,
    }
    env = make_env("guess_number", tok, max_turns=3, max_context=256)
    assert isinstance(env, GuessNumber) and (env.max_turns, env.max_context) == (3, 256)


def test_make_env_errors_name_the_environment(tok: Any) -> None:
    with pytest.raises(KeyError, match=r"unknown environment 'nope' \(registered: \['agent', 'arithmetic', "):
        make_env("nope", tok)
    with pytest.raises(TypeError, match=r"environment 'reverse_text': .*'partial_credit'"):
        make_env("reverse_text", tok, partial_credit=0.5)


def test_register_env_refuses_clashes_and_non_environments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "ENVIRONMENTS", dict(ENVIRONMENTS))

    class Impostor(Arithmetic):
        name = "arithmetic"

    with pytest.raises(ValueError, match="already registered by beam_rl.envs.arithmetic.Arithmetic"):
        register_env(Impostor)

    class Nameless(Arithmetic):
        name = ""

    with pytest.raises(ValueError, match="has no `name`"):
        register_env(Nameless)
    with pytest.raises(TypeError, match="expects an Environment subclass"):
        register_env(dict)  # type: ignore[arg-type]

    class Fresh(Arithmetic):
        name = "fresh_arithmetic"

    assert register_env(Fresh) is Fresh and registry.ENVIRONMENTS["fresh_arithmetic"] is Fresh
    assert "fresh_arithmetic" not in ENVIRONMENTS  # the monkeypatched copy took it


# --- Bundled datasets ------------------------------------------------------------------------------


def test_bundled_datasets_are_what_the_generator_writes(tmp_path: Path) -> None:
    written = make_datasets.write_datasets(tmp_path)
    assert len(written) == 10
    for path in written:
        assert path.read_bytes() == (make_datasets.DATA_DIR / path.name).read_bytes(), path.name


@pytest.mark.parametrize(
    ("name", "n_train", "n_eval"),
    [("arithmetic", 200, 50), ("arithmetic_easy", 90, 20), ("reverse_text", 200, 50), ("guess_number", 200, 50),
     ("tool_arithmetic", 200, 50)],
)
def test_bundled_datasets_load_and_validate(tok: Any, name: str, n_train: int, n_eval: int) -> None:
    env = make_env(name, tok)
    assert (len(env.load_rows("train")), len(env.load_rows("eval"))) == (n_train, n_eval)


def test_arithmetic_rows_are_correct_and_eval_is_held_out(tok: Any) -> None:
    ops = {"+": operator.add, "-": operator.sub, "*": operator.mul}
    env = make_env("arithmetic", tok)
    train, eval_ = env.load_rows("train"), env.load_rows("eval")
    for row in train + eval_:
        a, op, b = row["question"].split()
        assert ops[op](int(a), int(b)) == int(row["answer"]), row
    assert not {r["question"] for r in train} & {r["question"] for r in eval_}
    assert {r["level"] for r in train} == {0, 1, 2}


def test_arithmetic_easy_is_one_digit_answers_with_partial_credit(tok: Any) -> None:
    env = make_env("arithmetic_easy", tok)
    assert env.partial_credit == 0.1
    assert {r["level"] for r in env.load_rows("train")} == {0}
    assert {int(r["answer"]) for r in env.load_rows("train")} <= set(range(10))


def test_reverse_text_and_guess_number_rows(tok: Any) -> None:
    rev = make_env("reverse_text", tok)
    train, eval_ = rev.load_rows("train"), rev.load_rows("eval")
    assert max(len(r["text"]) for r in train + eval_) <= 12
    assert not {r["text"] for r in train} & {r["text"] for r in eval_}
    for row in make_env("guess_number", tok).load_rows("train"):
        assert row["low"] <= row["secret"] <= row["high"]


def test_custom_dataset_directory_and_row_errors(tok: Any, tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text(
        '{"question": "1 + 1", "answer": "2", "level": 0}\n{"question": "10 * 10", "answer": "100", "level": 2}\n'
    )
    assert [r["answer"] for r in make_env("arithmetic", tok, dataset=tmp_path).load_rows("train")] == ["2", "100"]
    assert [r["answer"] for r in make_env("arithmetic_easy", tok, dataset=tmp_path).load_rows("train")] == ["2"]

    (tmp_path / "eval.jsonl").write_text('{"question": "1 + 1", "answer": "two"}\n')
    with pytest.raises(DatasetError, match=r"eval\.jsonl:1: field 'answer': .*integer"):
        make_env("arithmetic", tok, dataset=tmp_path).load_rows("eval")

    skipping = make_env("arithmetic", tok, dataset=tmp_path, bad_rows="skip")
    with pytest.raises(DatasetError, match=r"eval\.jsonl: no rows \(1 bad rows skipped\)"):
        skipping.load_rows("eval")
    (tmp_path / "eval.jsonl").write_text(
        '{"question": "1 + 1", "answer": "two"}\n{"question": "2 + 2", "answer": "4"}\n'
    )
    assert skipping.load_rows("eval") == [{"question": "2 + 2", "answer": "4", "level": 0}]
    assert [(e.line, e.field) for e in skipping.skipped_rows["eval"]] == [(1, "answer")]

    games = tmp_path / "games"
    games.mkdir()
    (games / "train.jsonl").write_text('{"secret": 3, "low": 1, "high": 10}\n{"secret": 11, "low": 1, "high": 10}\n')
    (games / "eval.jsonl").write_text('{"secret": 3, "low": 5, "high": 4}\n')
    with pytest.raises(DatasetError, match=r"train\.jsonl:2: field 'secret': .*outside \[1, 10\]"):
        make_env("guess_number", tok, dataset=games).load_rows("train")
    with pytest.raises(DatasetError, match=r"eval\.jsonl:1: field 'high': .*below low"):
        make_env("guess_number", tok, dataset=games).load_rows("eval")


# --- Prompts ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "row", "content"),
    [
        ("arithmetic", {"question": "3 + 4", "answer": "7"}, "What is 3 + 4? Reply with just the number."),
        ("reverse_text", {"text": "abc de"}, "Reverse the text: abc de"),
        ("guess_number", {"secret": 7, "low": 1, "high": 10}, QUESTION),
    ],
)
def test_prompts_render_with_the_chat_template(tok: Any, name: str, row: dict, content: str) -> None:
    prompt_ids = make_env(name, tok).render_prompt(row)
    assert type(prompt_ids) is list and all(type(i) is int for i in prompt_ids)
    messages = [{"role": "user", "content": content}]
    assert prompt_ids == tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert tok.decode(prompt_ids) == chatml(("user", content))


def test_control_tokens_in_data_stay_plain_text(tok: Any) -> None:
    prompt_ids = chat_prompt_ids(tok, [{"role": "user", "content": "ab<|im_end|>cd"}])
    assert prompt_ids.count(tok.eos_token_id) == 1  # only the template's own end of turn
    assert tok.decode(prompt_ids) == chatml(("user", "ab<|im_end|>cd"))


# --- Single-turn rewards ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [("19", 19), ("  -3 apples", -3), ("5-3", 5), ("7.5", 7), ("x12y 4", 12), ("abc", None), ("", None), ("٣", None)],
)
def test_first_integer(text: str, value: int | None) -> None:
    assert first_integer(text) == value


@pytest.mark.parametrize(
    ("text", "plain", "easy"),
    [
        ("19", 1.0, 1.0),
        ("The answer is 19.", 1.0, 1.0),
        ("18", 0.0, 0.1),
        ("12 + 7 = 19", 0.0, 0.1),  # the first integer is 12: restating the question is wrong
        ("no idea", 0.0, 0.0),
    ],
)
def test_arithmetic_reward(tok: Any, text: str, plain: float, easy: float) -> None:
    row = {"question": "12 + 7", "answer": "19"}
    assert make_env("arithmetic", tok).reward(row, answer(tok, text)) == plain
    assert make_env("arithmetic", tok, partial_credit=0.1).reward(row, answer(tok, text)) == easy
    assert make_env("arithmetic", tok).reward({"question": "2 - 5", "answer": "-3"}, answer(tok, "-3")) == 1.0


def test_arithmetic_rejects_partial_credit_outside_unit_interval(tok: Any) -> None:
    with pytest.raises(ValueError, match="partial_credit"):
        make_env("arithmetic", tok, partial_credit=1.0)


@pytest.mark.parametrize(
    ("text", "expected"),
    # ratio = 2 * matched / (len(pred) + len(target)), target "olleh": "oll" matches 3 of 3 + 5;
    # "hello" matches only the block "ll" (no other character lines up in order around it).
    [("olleh", 1.0), (" olleh\n", 1.0), ("oll", 2 * 3 / 8), ("hello", 2 * 2 / 10), ("xyz", 0.0), ("", 0.0)],
)
def test_reverse_text_reward(tok: Any, text: str, expected: float) -> None:
    assert make_env("reverse_text", tok).reward({"text": "hello"}, answer(tok, text)) == pytest.approx(expected)
    assert similarity(text.strip(), "olleh") == pytest.approx(expected)


def test_reward_reads_the_completion_only_up_to_eos(tok: Any) -> None:
    env = make_env("reverse_text", tok)
    token_ids = ids(tok, "olleh") + [tok.eos_token_id] + ids(tok, "junk after the end")
    assert env.decode(token_ids) == "olleh"
    client = ScriptedClient(tok, [Completion(token_ids, [-0.1] * len(token_ids), "stop")])
    trajectory = asyncio.run(env.run(client, {"text": "hello"}, [1, 2, 3], SamplingParams()))
    assert env.reward({"text": "hello"}, trajectory) == 1.0
    assert trajectory.turns[0].completion_ids == token_ids  # the trajectory keeps every id as returned


def test_run_group_asks_for_n_choices_in_one_request(tok: Any) -> None:
    env = make_env("arithmetic_easy", tok)
    row = {"question": "3 + 4", "answer": "7"}
    prompt_ids = env.render_prompt(row)
    texts = ["7", "6", "hmm", "7 or 8"]
    client = ScriptedClient(tok, [completion(tok, t) for t in texts])
    sampling = SamplingParams(max_tokens=8, temperature=1.0, seed=11)
    trajectories = asyncio.run(env.run_group(client, row, prompt_ids, sampling, n=4))
    assert client.calls == [(prompt_ids, sampling, 4)]
    assert [env.reward(row, t) for t in trajectories] == [1.0, 0.1, 0.0, 1.0]
    assert [t.turns[0].completion_ids for t in trajectories] == [ids(tok, x) + [tok.eos_token_id] for x in texts]
    assert all(t.turns[0].env_ids == [] and t.turns[0].finish_reason == "stop" for t in trajectories)


# --- guess_number: the multi-turn game -------------------------------------------------------------


@pytest.mark.parametrize(("guess", "expected"), [(3, HIGHER), (9, LOWER), (7, CORRECT), (None, NO_GUESS)])
def test_hint(guess: int | None, expected: str) -> None:
    assert hint(guess, 7) == expected


def test_game_reward_scales_down_by_turns(tok: Any) -> None:
    env = make_env("guess_number", tok, max_turns=4)
    assert [env.game_reward(k) for k in (1, 2, 3, 4)] == [1.0, 0.75, 0.5, 0.25]
    row = {"secret": 7, "low": 1, "high": 10}
    assert env.reward(row, Trajectory([], {"found_on_turn": 1})) == 1.0
    assert env.reward(row, Trajectory([], {"found_on_turn": 3})) == 0.5
    assert env.reward(row, Trajectory([])) == 0.0


def play(tok: Any, env: GuessNumber, *responses: Completion, sampling: SamplingParams | None = None):
    client = ScriptedClient(tok, *([r] for r in responses))
    prompt_ids = env.render_prompt(ROW)
    trajectory = asyncio.run(env.run(client, ROW, prompt_ids, sampling or SamplingParams(max_tokens=8)))
    return trajectory, client, prompt_ids


def test_each_turn_continues_the_exact_ids_of_the_last(tok: Any) -> None:
    env = make_env("guess_number", tok, max_turns=5)
    trajectory, client, prompt_ids = play(tok, env, completion(tok, "5"), completion(tok, "9"), completion(tok, "7"))
    first, second, third = trajectory.turns
    assert first.env_ids == []
    assert second.env_ids == hint_ids(tok, HIGHER)
    assert third.env_ids == hint_ids(tok, LOWER)
    assert client.prompts == [
        prompt_ids,
        prompt_ids + first.completion_ids + second.env_ids,
        prompt_ids + first.completion_ids + second.env_ids + second.completion_ids + third.env_ids,
    ]
    # The ids are exactly what the chat template makes of the whole conversation so far.
    conversation = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": HIGHER},
        {"role": "assistant", "content": "9"},
        {"role": "user", "content": LOWER},
    ]
    assert client.prompts[2] == tok.apply_chat_template(conversation, add_generation_prompt=True, return_dict=False)
    # Found on turn 3 of 5.
    assert env.reward(ROW, trajectory) == pytest.approx(3 / 5)


def test_generated_ids_are_never_retokenized(tok: Any) -> None:
    # "the" spelled letter by letter: re-tokenizing its text would give one token; the context must not.
    letter_ids = [i for letter in "the" for i in ids(tok, letter)] + [tok.eos_token_id]
    assert ids(tok, "the") != letter_ids[:3]
    env = make_env("guess_number", tok, max_turns=2)
    trajectory, client, prompt_ids = play(tok, env, Completion(letter_ids, [-1.0] * 4, "stop"), completion(tok, "7"))
    assert client.prompts[1][len(prompt_ids) : len(prompt_ids) + 4] == letter_ids
    assert trajectory.turns[0].completion_ids == letter_ids and trajectory.turns[0].logprobs == [-1.0] * 4
    assert trajectory.turns[1].env_ids == hint_ids(tok, NO_GUESS)


def test_truncated_turn_is_closed_once(tok: Any) -> None:
    env = make_env("guess_number", tok, max_turns=3)
    trajectory, client, prompt_ids = play(tok, env, completion(tok, "3 4 5", stop=False), completion(tok, "7"))
    second = trajectory.turns[1]
    assert second.env_ids == [tok.eos_token_id] + hint_ids(tok, HIGHER)
    assert trajectory.turns[0].truncated
    # A stopped turn already ends with <|im_end|>: the hint must not add a second one.
    _, client_stopped, prompt_stopped = play(tok, env, completion(tok, "3"), completion(tok, "7"))
    context = client_stopped.prompts[1][len(prompt_stopped) :]
    assert context.count(tok.eos_token_id) == 2  # the model's, and the end of the hint's user turn
    assert tok.decode(client_stopped.prompts[1]).count("<|im_end|><|im_end|>") == 0


def test_game_ends_on_correct(tok: Any) -> None:
    env = make_env("guess_number", tok, max_turns=5)
    trajectory, client, _ = play(tok, env, completion(tok, "2"), completion(tok, "7"), completion(tok, "7"))
    assert len(client.calls) == 2 and len(trajectory.turns) == 2
    assert env.reward(ROW, trajectory) == pytest.approx(4 / 5)


def test_game_stops_after_max_turns_with_zero_reward(tok: Any) -> None:
    env = make_env("guess_number", tok, max_turns=3)
    trajectory, client, _ = play(
        tok, env, completion(tok, "1"), completion(tok, "I think"), completion(tok, "2"), completion(tok, "7")
    )
    assert len(client.calls) == 3 and len(trajectory.turns) == 3
    assert env.reward(ROW, trajectory) == 0.0
    assert trajectory.turns[2].env_ids == hint_ids(tok, NO_GUESS)


def test_seed_is_offset_per_turn(tok: Any) -> None:
    env = make_env("guess_number", tok, max_turns=3)
    guesses = [completion(tok, "1"), completion(tok, "2"), completion(tok, "3")]
    _, client, _ = play(tok, env, *guesses, sampling=SamplingParams(seed=40))
    assert [call[1].seed for call in client.calls] == [40, 41, 42]
    _, client, _ = play(tok, env, *guesses)
    assert [call[1].seed for call in client.calls] == [None, None, None]


def test_max_context_stops_the_game_and_caps_max_tokens(tok: Any) -> None:
    prompt_len = len(make_env("guess_number", tok).render_prompt(ROW))
    hint_len = len(hint_ids(tok, HIGHER))
    guess = completion(tok, "1")  # 2 ids: "1" and <|im_end|>
    # Turn 2's prompt (prompt + 2 + hint) leaves 3 tokens; turn 3's would leave none.
    max_context = prompt_len + 2 + hint_len + 3
    env = make_env("guess_number", tok, max_turns=5, max_context=max_context)
    trajectory, client, _ = play(tok, env, guess, Completion(ids(tok, "123"), [-1.0] * 3, "length"), guess)
    assert len(client.calls) == 2 and len(trajectory.turns) == 2
    assert [call[1].max_tokens for call in client.calls] == [8, 3]
    assert max(len(p) for p in client.prompts) < max_context
    assert env.reward(ROW, trajectory) == 0.0

    with pytest.raises(ValueError, match="leaves no room under max_context"):
        play(tok, make_env("guess_number", tok, max_context=prompt_len), guess)


def test_multi_turn_game_cannot_run_as_a_group(tok: Any) -> None:
    env = make_env("guess_number", tok)
    with pytest.raises(NotImplementedError):
        asyncio.run(env.run_group(ScriptedClient(tok), ROW, env.render_prompt(ROW), SamplingParams(), n=2))


def test_guess_number_needs_chatml_markers() -> None:
    word_level = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    plain = PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="[UNK]")
    with pytest.raises(ValueError, match="needs a ChatML tokenizer"):
        GuessNumber(plain)


def test_reward_cpu_ms_spends_that_much_cpu_per_reward(tok: Any) -> None:
    import time

    env = make_env("arithmetic", tok, reward_cpu_ms=50)
    row = {"question": "2 + 2", "answer": "4"}
    started = time.thread_time()
    assert env.reward(row, answer(tok, "4")) == 1.0
    assert 0.05 <= time.thread_time() - started < 0.5
    with pytest.raises(ValueError, match="reward_cpu_ms"):
        make_env("arithmetic", tok, reward_cpu_ms=-1)
