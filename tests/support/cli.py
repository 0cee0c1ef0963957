"""The `beam-rl` command run in this process, and its coloured lines read back."""

from __future__ import annotations

import io
import re

from rich.console import Console

from beam_rl import cli

RED, YELLOW = "\x1b[31m", "\x1b[33m"
STYLE = re.compile(r"\x1b\[[0-9;]*m")  # a colour code


def run_cli(monkeypatch, *argv: str) -> tuple[int, list[str]]:
    """`beam-rl ARGV` in this process; its exit status and the lines it printed, with their colours."""
    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, width=10_000, color_system="standard", force_terminal=True))
    status = cli.main(list(argv))
    return status, out.getvalue().splitlines()


def coloured(lines: list[str], colour: str) -> list[str]:
    """The text of the lines printed in `colour` (rich highlights numbers and paths within them)."""
    return [STYLE.sub("", line) for line in lines if line.startswith(colour)]
