"""The tiny offline tokenizer: lossless round trips, ChatML template, special ids, save/load."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from beam_rl.model.tokenizer import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    TINY_VOCAB_SIZE,
    _train_tiny_bpe,
    build_tiny_tokenizer,
    load_tokenizer,
    save_tokenizer,
)


@pytest.mark.parametrize(
    "text",
    [
        "What is 12 + 7? The answer is 19.",
        "Reverse 'hello': olleh",
        "  leading spaces, tabs\tand\n\nnewlines\n",
        "Ünïcode ✓ 日本語 🙂",
        "",
    ],
)
def test_round_trip_is_lossless(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_have_fixed_ids(tok):
    assert tok.convert_tokens_to_ids([ENDOFTEXT, IM_START, IM_END]) == [0, 1, 2]
    assert tok.eos_token == IM_END and tok.eos_token_id == 2
    assert tok.pad_token == ENDOFTEXT and tok.pad_token_id == 0
    assert len(tok) == TINY_VOCAB_SIZE
    # A special token in text is one id, never split into bytes.
    assert tok.encode(IM_END) == [2]


def test_digits_are_single_tokens(tok):
    # Qwen-style digit splitting: "19" is two tokens, "1" and "9".
    pieces = tok.convert_ids_to_tokens(tok.encode("12 + 7 = 19"))
    assert [p for p in pieces if p.strip("Ġ").isdigit()] == ["1", "2", "7", "1", "9"]


def test_chatml_template(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without == text[: -len("<|im_start|>assistant\n")]
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids == tok.encode(text)
    assert ids[0] == 1 and ids.count(2) == 2


def test_load_tiny_is_cached_and_build_is_deterministic(tok):
    assert load_tokenizer("tiny") is tok
    fresh = build_tiny_tokenizer()
    assert fresh is not tok
    assert fresh.backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()


def test_build_is_deterministic_across_processes():
    # Rust hash maps are seeded per process; the trained merges must not depend on it.
    code = "from beam_rl.model.tokenizer import _train_tiny_bpe; print(_train_tiny_bpe().to_str())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == json.loads(_train_tiny_bpe().to_str())


def test_save_and_reload_through_autotokenizer(tok, tmp_path):
    save_tokenizer(tok, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"] == tok.chat_template
    for loaded in (load_tokenizer(str(tmp_path)), AutoTokenizer.from_pretrained(str(tmp_path))):
        assert loaded.encode("Reverse 'abc': cba") == tok.encode("Reverse 'abc': cba")
        assert loaded.eos_token_id == 2 and loaded.pad_token_id == 0
        assert loaded.chat_template == tok.chat_template


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such local path"):
        load_tokenizer(str(tmp_path / "nope"))
