"""Response text as vLLM's detokenizer makes it: the non-streamed text and the streamed chunks
hold back a trailing incomplete UTF-8 character exactly as tokenizers' DecodeStream does."""

from __future__ import annotations

import random

import pytest
from tokenizers.decoders import DecodeStream

from beam_rl.standin.generator import ChoiceResult, GenerationParams
from beam_rl.standin.protocol import CompletionRequest
from beam_rl.standin.responses import CompletionStream, TokenTexts, visible_text
from beam_rl.model.tokenizer import load_tokenizer
from tests.support.server_helpers import sse_data


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("tiny")


def byte_tokens(tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte of `text`, through the byte-level alphabet."""
    alphabet = {}
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = 0
    for byte in range(256):
        if byte in printable:
            alphabet[byte] = chr(byte)
        else:
            alphabet[byte] = chr(256 + shifted)
            shifted += 1
    vocab = tokenizer.get_vocab()
    return [vocab[alphabet[b]] for b in text.encode()]


def decode_stream(tokenizer, ids: list[int]) -> str:
    stream = DecodeStream(skip_special_tokens=True)
    return "".join(stream.step(tokenizer.backend_tokenizer, t) or "" for t in ids)


def test_an_incomplete_character_is_held_back_until_completed(tokenizer):
    ids = byte_tokens(tokenizer, "A€B")  # € is three bytes: E2 82 AC
    assert [visible_text(tokenizer, ids[:k], True) for k in range(1, 6)] == ["A", "A", "A", "A€", "A€B"]


def test_visible_text_is_what_decode_stream_emits(tokenizer):
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(3, 512) for _ in range(rng.randrange(1, 16))]  # many lone bytes >= 0x80
        assert visible_text(tokenizer, ids, True) == decode_stream(tokenizer, ids), ids


def test_stream_chunks_carry_the_same_text(tokenizer):
    ids = byte_tokens(tokenizer, "x€y") + byte_tokens(tokenizer, "€")[:2]  # ends mid-character
    params = GenerationParams(prompt_ids=(5,), max_tokens=len(ids))
    request = CompletionRequest(prompt=[5], max_tokens=len(ids), stream=True, return_token_ids=True)
    stream = CompletionStream(TokenTexts(tokenizer), "m", params, request)
    choice = ChoiceResult()
    chunks = []
    for token in ids:  # one token per step, like a running request
        choice.token_ids.append(token)
        choice.logprobs.append(-1.0)
        choice.finish_reason = "length" if len(choice.token_ids) == len(ids) else None
        (event,) = sse_data(stream.chunks([choice]).decode().splitlines())
        chunks.append(event["choices"][0])
    assert [c["text"] for c in chunks] == ["x", "", "", "€", "y", "", ""]
    assert [c["token_ids"] for c in chunks] == [[t] for t in ids]
    assert "".join(c["text"] for c in chunks) == visible_text(tokenizer, ids, True) == "x€y"
    assert stream.end() == b"data: [DONE]\n\n"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_whole_choice_in_one_chunk_carries_the_text_stepped_token_by_token(tokenizer, skip_special_tokens):
    """The instant backend sends each choice whole, in its last chunk: its text is the per-token stream's,
    whether the choice ends on a whole character or mid-character (its text is then a prefix's)."""
    rng = random.Random(1)
    ends_mid_character = 0
    for _ in range(1000):
        ids = [rng.randrange(0, 512) for _ in range(rng.randrange(2, 64))]  # specials and lone bytes included
        params = GenerationParams(prompt_ids=(5,), max_tokens=len(ids))
        request = CompletionRequest(prompt=[5], max_tokens=len(ids), stream=True,
                                    skip_special_tokens=skip_special_tokens)
        stream = CompletionStream(TokenTexts(tokenizer), "m", params, request)
        choice = ChoiceResult(token_ids=list(ids), logprobs=[-1.0] * len(ids), finish_reason="length")
        (event,) = sse_data(stream.chunks([choice]).decode().splitlines())
        per_token = DecodeStream(skip_special_tokens=skip_special_tokens)
        expected = "".join(per_token.step(tokenizer.backend_tokenizer, t) or "" for t in ids)
        assert event["choices"][0]["text"] == expected, ids
        ends_mid_character += visible_text(tokenizer, ids, skip_special_tokens) != tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens)
    assert ends_mid_character > 100  # both kinds of ending
