"""Server-sent events (the `text/event-stream` of a streamed completion) split from the blocks a socket
delivers, rather than line by line: a dispatcher reads a thousand streams at once, and one read of a
busy stream often holds several events."""

from __future__ import annotations


class EventData:
    """The `data` of each complete event in a stream fed block by block. Lines may end in LF, CRLF or CR;
    an event's several data lines are joined with LF; comments and other fields are skipped."""

    def __init__(self) -> None:
        self._tail = b""  # the start of an event whose blank line has not come yet
        self._after_cr = False  # the last block ended in CR: an LF opening the next one ends no other line

    @property
    def pending(self) -> int:
        """Bytes held of an event not yet ended: what a stream makes its reader keep."""
        return len(self._tail)

    def feed(self, block: bytes) -> list[bytes]:
        if self._after_cr and block.startswith(b"\n"):
            block = block[1:]
        self._after_cr = block.endswith(b"\r")
        if b"\r" in block:
            block = block.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        buffer = self._tail + block if self._tail else block
        *events, self._tail = buffer.split(b"\n\n")
        found = []
        for event in events:
            if event.startswith(b"data:") and b"\n" not in event:  # what vLLM sends: one data line
                found.append(event[5:].strip())
                continue
            lines = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
            if lines:
                found.append(b"\n".join(lines))
        return found
