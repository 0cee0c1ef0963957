"""Writes the bundled environment datasets (`<env>_<split>.jsonl` beside this file), deterministically.

Run `python -m beam_rl.envs.data.make_datasets` after changing a recipe and commit the output;
a test checks that the committed files are exactly what this script writes.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

from beam_rl.envs.data.code_tasks import TASKS

SEED = 20251130
DATA_DIR = Path(__file__).resolve().parent

# Short, common lowercase words: few BPE pieces each, so a tiny model can copy them letter by letter.
_WORDS = (
    "cat dog sun moon star tree leaf rock sand sea fish bird frog bear wolf lion goat duck owl ant "
    "bee cow pig hen fox elk yak bat eel cod ape jam pie cake milk tea egg rice corn bean nut salt "
    "red blue green gold pink gray black white cold warm hot dry wet soft hard fast slow big tiny "
    "old new top low high far near left right up down in out on off yes no one two six ten day "
    "night rain snow wind fire ice road door wall roof bed cup pen book desk box bag hat shoe sock "
    "ring bell drum song play run jump swim walk read sing draw cook bake grow stop go open shut"
).split()


def arithmetic_rows(rng: random.Random) -> dict[str, list[dict[str, Any]]]:
    """Three levels: 0 = one-digit answers, 1 = one-digit operands, 2 = two-digit operands.

    Level 0 holds every one-digit problem (110 of them), split between train and eval, so a model
    cannot pass eval by memorising train.
    """
    level0 = [(a, "+", b) for a in range(10) for b in range(10) if a + b <= 9]
    level0 += [(a, "-", b) for a in range(10) for b in range(a + 1)]
    level1 = [(a, "+", b) for a in range(10) for b in range(10) if a + b >= 10]
    level1 += [(a, "*", b) for a in range(2, 10) for b in range(2, 10)]
    level2: set[tuple[int, str, int]] = set()
    while len(level2) < 75:
        level2.add((rng.randint(10, 99), rng.choice("+-"), rng.randint(10, 99)))
    train: list[dict[str, Any]] = []
    eval_: list[dict[str, Any]] = []
    for level, pool, n_train, n_eval in ((0, level0, 90, 20), (1, level1, 50, 15), (2, sorted(level2), 60, 15)):
        picked = rng.sample(pool, n_train + n_eval)
        rows = [_arithmetic_row(a, op, b, level) for a, op, b in picked]
        train += rows[:n_train]
        eval_ += rows[n_train:]
    rng.shuffle(train)
    rng.shuffle(eval_)
    return {"train": train, "eval": eval_}


def _arithmetic_row(a: int, op: str, b: int, level: int) -> dict[str, Any]:
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"question": f"{a} {op} {b}", "answer": str(value), "level": level}


def reverse_text_rows(rng: random.Random) -> dict[str, list[dict[str, Any]]]:
    """One word (level 0) or two words (level 1) of at most 12 characters; train and eval disjoint."""
    singles = sorted(set(_WORDS))
    pairs = sorted({f"{a} {b}" for a in _WORDS for b in _WORDS if a != b and len(a) + len(b) + 1 <= 12})
    texts = [(t, 0) for t in rng.sample(singles, 100)] + [(t, 1) for t in rng.sample(pairs, 150)]
    rng.shuffle(texts)
    rows = [{"text": text, "level": level} for text, level in texts]
    return {"train": rows[:200], "eval": rows[200:]}


def guess_number_rows(rng: random.Random) -> dict[str, list[dict[str, Any]]]:
    """Secrets in [1, high] for a few range sizes; a game row is a seed, so repeats are fine."""

    def game() -> dict[str, Any]:
        high = rng.choice((4, 8, 10, 16))
        return {"secret": rng.randint(1, high), "low": 1, "high": high}

    return {"train": [game() for _ in range(200)], "eval": [game() for _ in range(50)]}


def code_rows(rng: random.Random) -> dict[str, list[dict[str, Any]]]:
    """The hand-written tasks of code_tasks.py, each row holding its complete reference solution;
    a quarter of them held out for eval."""
    rows = [
        {"task_id": t.task_id, "prompt": t.prompt, "tests": list(t.tests), "reference": t.prompt + t.reference}
        for t in TASKS
    ]
    rng.shuffle(rows)
    n_eval = len(rows) // 4
    return {"train": rows[n_eval:], "eval": rows[:n_eval]}


def tool_arithmetic_rows(rng: random.Random) -> dict[str, list[dict[str, Any]]]:
    """Products and sums too big to do in one's head (4- to 6-digit operands): a calculator call away."""

    def task() -> dict[str, Any]:
        a, b = rng.randint(1000, 999_999), rng.randint(1000, 99_999)
        op = rng.choice("*+-")
        return {"question": f"{a} {op} {b}", "answer": str({"+": a + b, "-": a - b, "*": a * b}[op])}

    return {"train": [task() for _ in range(200)], "eval": [task() for _ in range(50)]}


def build_datasets() -> dict[str, list[dict[str, Any]]]:
    """File name -> rows, for every bundled dataset. Each env draws from its own seeded stream."""
    files: dict[str, list[dict[str, Any]]] = {}
    for name, recipe in (
        ("arithmetic", arithmetic_rows),
        ("reverse_text", reverse_text_rows),
        ("guess_number", guess_number_rows),
        ("code", code_rows),
        ("tool_arithmetic", tool_arithmetic_rows),
    ):
        for split, rows in recipe(random.Random(f"{SEED}-{name}")).items():
            files[f"{name}_{split}.jsonl"] = rows
    return files


def write_datasets(out_dir: Path = DATA_DIR) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for file_name, rows in build_datasets().items():
        path = out_dir / file_name
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        written.append(path)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DATA_DIR, help="output directory (default: beside this script)")
    for path in write_datasets(parser.parse_args().out):
        print(path)


if __name__ == "__main__":
    main()
