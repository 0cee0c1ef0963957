"""A step's rollouts as text, decoded through the run's tokenizer without losing a token: for
`beam-rl inspect --step N --samples K` (rich) and for the W&B samples table (plain dicts)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
from rich.console import Group
from rich.panel import Panel
from rich.text import Text

from beam_rl.printable import printable
from beam_rl.rundir import RunDir

# How each kind of token shows in the terminal.
STYLES = {
    "special": "dim",  # <|im_end|> and the like
    "unknown": "bold red",  # <id:123>: an id the tokenizer has no text for
    "prompt": "",
    "env": "cyan",  # what the environment appended between turns: context, never trained on
    "completion": "green",  # what the model generated
    "version": "magenta",  # where the policy version changes inside a turn
}
_MAX_CHAR_TOKENS = 4  # a character of a byte-level BPE spans at most 4 tokens (its UTF-8 bytes)


@dataclass(frozen=True)
class Piece:
    """Consecutive tokens and how they show: decoded text, a special token's own text, or `<id:N>`."""

    kind: Literal["text", "special", "unknown"]
    text: str
    ids: tuple[int, ...]


class TokenText:
    """Token ids as text through a tokenizer, every id accounted for: special tokens as their literal text
    (`<|im_end|>`), ids the tokenizer has no token for or whose bytes are not text (a stray piece of a
    UTF-8 character) as `<id:N>`, control characters escaped (`\\x16`)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab = len(tokenizer)
        self.special = set(tokenizer.all_special_ids) | {
            i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special
        }

    def pieces(self, ids: Sequence[int]) -> list[Piece]:
        out: list[Piece] = []
        run: list[int] = []
        for token in ids:
            token = int(token)
            if token in self.special or not self._known(token):
                out += self._decode(run)
                run = []
                out.append(
                    Piece("special", self.tokenizer.convert_ids_to_tokens(token), (token,))
                    if token in self.special
                    else Piece("unknown", f"<id:{token}>", (token,))
                )
            else:
                run.append(token)
        return out + self._decode(run)

    def plain(self, ids: Sequence[int]) -> str:
        return "".join(piece.text for piece in self.pieces(ids))

    def rich(self, ids: Sequence[int], style: str = "") -> Text:
        text = Text()
        for piece in self.pieces(ids):
            text.append(piece.text, STYLES[piece.kind] if piece.kind != "text" else style)
        return text

    def _known(self, token: int) -> bool:
        return 0 <= token < self.vocab and self.tokenizer.convert_ids_to_tokens(token) is not None

    def _decode(self, run: list[int]) -> list[Piece]:
        """A run of ordinary tokens decoded together (a character may span several byte-level tokens);
        where that leaves a replacement character, the shortest spans that decode cleanly, and `<id:N>`
        for a token that starts none."""
        if not run:
            return []
        text = self._text(run)
        if "\ufffd" not in text:
            return [Piece("text", printable(text), tuple(run))]
        out: list[Piece] = []
        i = 0
        while i < len(run):
            for j in range(i + 1, min(i + _MAX_CHAR_TOKENS, len(run)) + 1):
                text = self._text(run[i:j])
                if "\ufffd" not in text:
                    if out and out[-1].kind == "text":  # one piece per stretch of text
                        out[-1] = Piece("text", out[-1].text + printable(text), out[-1].ids + tuple(run[i:j]))
                    else:
                        out.append(Piece("text", printable(text), tuple(run[i:j])))
                    i = j
                    break
            else:
                out.append(Piece("unknown", f"<id:{run[i]}>", (run[i],)))
                i += 1
        return out

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


# -- choosing rollouts ------------------------------------------------------------------------------------


class RolloutNotFound(KeyError):
    """No row of the window has this rollout or group id."""


def window_rows(
    window: pa.Table, count: int | None = None, rollout_ids: Sequence[str] = (), spread: bool = False
) -> list[dict[str, Any]]:
    """Rows of a window as dicts: those named in `rollout_ids` (a rollout id, or a group id for all of its
    group), in the order named; else the first `count` (or, with `spread`, `count` spaced evenly over
    the window, so they come from several groups)."""
    if rollout_ids:
        ids = window.column("rollout_id").to_pylist()
        groups = window.column("group_id").to_pylist()
        rows = []
        for wanted in rollout_ids:
            found = [i for i, (rid, gid) in enumerate(zip(ids, groups)) if wanted in (rid, gid)]
            if not found:
                raise RolloutNotFound(wanted)
            rows += found
        return window.take(rows).to_pylist()
    count = window.num_rows if count is None else min(count, window.num_rows)
    if spread and count:
        return window.take(np.unique(np.linspace(0, window.num_rows - 1, count).round().astype(int))).to_pylist()
    return window.slice(0, count).to_pylist()


def find_step(run_dir: RunDir, rollout_id: str) -> int | None:
    """The committed step whose window holds a rollout (or group) id, from the commit records' group lists."""
    candidates = {rollout_id, rollout_id.rsplit("/", 1)[0]}  # a group id, or a rollout id: <group id>/<attempt>
    for step in run_dir.committed_steps():
        if candidates & set(run_dir.read_commit(step).window.group_ids):
            return step
    return None


# -- one rollout as text -----------------------------------------------------------------------------------


def version_summary(row: dict[str, Any]) -> str:
    """The policy versions of a rollout: when sent and finished, the range its tokens came from, and
    where the version changes inside a turn."""
    turns = row["turns"] or []
    tokens = [v for t in turns for v in t["policy_versions"] if v >= 0]
    parts = [f"sent v{row['policy_version_start']}, finished v{row['policy_version_end']}"]
    parts.append(f"tokens v{min(tokens)}..v{max(tokens)}" if tokens else "tokens: versions unknown")
    for i, turn in enumerate(turns):
        changes = _version_changes(turn["policy_versions"])
        if changes:
            parts.append(f"turn {i}: " + ", ".join(f"v{a}->v{b} at token {at}" for at, a, b in changes))
    return "; ".join(parts)


def _version_changes(versions: Sequence[int]) -> list[tuple[int, int, int]]:
    return [(i, versions[i - 1], versions[i]) for i in range(1, len(versions)) if versions[i] != versions[i - 1]]


def _version_runs(ids: Sequence[int], versions: Sequence[int]) -> list[tuple[int | None, list[int]]]:
    """The completion's ids in runs of one policy version (None: unknown)."""
    if len(versions) != len(ids):
        return [(None, list(ids))]
    runs: list[tuple[int | None, list[int]]] = []
    for token, version in zip(ids, versions):
        if runs and runs[-1][0] == version:
            runs[-1][1].append(token)
        else:
            runs.append((version, [token]))
    return runs


def rollout_panel(row: dict[str, Any], text: TokenText) -> Panel:
    """One rollout for the terminal: what became of it, where it ran, then its prompt and each turn."""
    status = row["status"]
    head = Text()
    head.append(f"status {status}", "bold" if status == "ok" else "bold red")
    head.append(f"  reward {row['reward']:.4g}  advantage {row['advantage']:.4g}  ")
    if row["filtered"]:
        head.append(f"filtered: {row['filtered']}", "yellow")
    else:  # errored, cancelled and reward_error rollouts never reach the advantages
        head.append("clean" if status == "ok" else "left out of its group's scoring")
    lines: list[Any] = [
        head,
        Text(f"policy versions: {version_summary(row)}"),
        Text(
            f"server {row['server'] or '(never sent)'}  dispatch worker {row['dispatch_worker'] or '-'}  "
            f"score worker {row['score_worker'] or '-'}"
        ),
    ]
    for error in row["errors"]:
        lines.append(Text(f"error: {error}", "red"))
    if row["prompt_ids"] is None:
        lines.append(Text("tokens not recorded (see errors)", "red"))
    else:
        lines.append(Text(f"prompt ({len(row['prompt_ids'])} tokens)", "bold"))
        lines.append(text.rich(row["prompt_ids"], STYLES["prompt"]))
    for i, turn in enumerate(row["turns"] or []):
        if turn["env_ids"]:
            lines.append(Text(f"turn {i}: environment ({len(turn['env_ids'])} tokens, context)", "bold cyan"))
            lines.append(text.rich(turn["env_ids"], STYLES["env"]))
        lines.append(
            Text(
                f"turn {i}: completion ({len(turn['completion_ids'])} tokens, finish "
                f"{turn['finish_reason'] or 'unknown'})",
                "bold green",
            )
        )
        body = Text()
        runs = _version_runs(turn["completion_ids"], turn["policy_versions"])
        for version, ids in runs:
            if len(runs) > 1:  # mark every run, the first too: the version each stretch came from
                body.append(f"⟨v{version if version is not None and version >= 0 else '?'}⟩", STYLES["version"])
            body.append_text(text.rich(ids, STYLES["completion"]))
        lines.append(body)
    title = f"{row['rollout_id']}  ({row['env']})"
    return Panel(Group(*lines), title=title, title_align="left", border_style="red" if status != "ok" else "blue")


# -- the W&B samples table ---------------------------------------------------------------------------------


def sample_row(row: dict[str, Any], text: TokenText) -> dict[str, str | int | float]:
    """One rollout as plain strings and numbers: the environment's tokens between turns as `[env] ...`."""
    completion = []
    for turn in row["turns"] or []:
        if turn["env_ids"]:
            completion.append(f"\n[env] {text.plain(turn['env_ids'])}\n")
        completion.append(text.plain(turn["completion_ids"]))
    return {
        "rollout_id": row["rollout_id"],
        "env": row["env"],
        "status": row["status"],
        "reward": _shortest(row["reward"]),
        "advantage": _shortest(row["advantage"]),
        "filtered": row["filtered"] or "",
        "policy_versions": version_summary(row),
        "prompt": text.plain(row["prompt_ids"] or []),
        "completion": "".join(completion),
        "finish_reasons": ",".join(str(t["finish_reason"]) for t in row["turns"] or []),
        "server": row["server"] or "",
        "errors": "\n".join(row["errors"]),
    }


def _shortest(value: float) -> float:
    """A value a float32 holds exactly with the digits float32 has (a float32 column's 0.1, not
    0.10000000149011612); any other float64 as it is."""
    single = np.float32(value)
    return float(str(single)) if float(single) == value else value


def step_sample_rows(run_dir: RunDir, step: int, tokenizer: Any, count: int = 8) -> list[dict[str, str | int | float]]:
    """`count` rollouts of a committed step, spread over its window, as plain dicts."""
    text = TokenText(tokenizer)
    return [sample_row(row, text) for row in window_rows(run_dir.read_window(step), count, spread=True)]


def tracker_sample_rows(
    run_dir: RunDir, model_name: str, count: int = 8
) -> Callable[[int], list[dict[str, str | int | float]]]:
    """RunObserver's `sample_rows`: step -> a few of its rollouts, decoded through the run's tokenizer
    (loaded at the first call)."""

    def rows(step: int) -> list[dict[str, str | int | float]]:
        from beam_rl.model.location import tokenizer_for

        return step_sample_rows(run_dir, step, tokenizer_for(model_name), count)

    return rows
