"""Server-sent events split from the blocks a socket delivers (beam_rl/inference/sse.py)."""

from __future__ import annotations

import pytest

from beam_rl.inference.sse import EventData

STREAM = b'data: {"a": 1}\n\n: a comment\n\ndata: {"b": 2}\n\nevent: ping\nid: 7\n\ndata: [DONE]\n\n'
DATA = [b'{"a": 1}', b'{"b": 2}', b"[DONE]"]


def feed_in_pieces(stream: bytes, size: int) -> list[bytes]:
    events = EventData()
    return [data for start in range(0, len(stream), size) for data in events.feed(stream[start:start + size])]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("line_end", [b"\n", b"\r\n", b"\r"])
def test_every_event_comes_out_once_however_the_stream_is_cut(size, line_end):
    assert feed_in_pieces(STREAM.replace(b"\n", line_end), size) == DATA


def test_an_event_waits_for_its_blank_line():
    events = EventData()
    assert events.feed(b'data: {"a": 1}\n') == []
    assert events.feed(b"\ndata: [DO") == [b'{"a": 1}']
    assert events.feed(b"NE]\n\n") == [b"[DONE]"]


def test_several_data_lines_are_one_event_joined_by_line_feeds():
    assert EventData().feed(b"id: 1\ndata: [1,\ndata:2]\n\n") == [b"[1,\n2]"]
