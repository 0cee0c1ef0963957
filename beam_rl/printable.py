"""Text from outside (a sandboxed program's output, a model's tokens) made safe to log or print: the
one home for escaping control characters.

A terminal acts on what it is sent: ESC/CSI/OSC sequences can move the cursor, rewrite earlier
lines, set the window title or hide text, and bidi overrides reorder what a line seems to say. Every
character that is not printable (C0 and C1 controls, DEL, format characters such as U+202E) is shown
as its Python escape instead (`\\x1b`, `\\u202e`); newline and tab are kept.
"""

from __future__ import annotations


def printable(text: str) -> str:
    """`text` with every non-printable character but newline and tab written as its escape."""
    if text.replace("\n", "").replace("\t", "").isprintable():  # the usual case, at C speed
        return text
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)
