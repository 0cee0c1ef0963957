"""Write a Python function: the reward is the share of the task's tests that the program passes, run in
the sandbox (beam_rl.envs.sandbox), one sandbox per rollout.
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from beam_rl.envs.base import DatasetEnvironment, RewardUnavailable, Trajectory, chat_prompt_ids
from beam_rl.envs.datasets import BadRows, PromptText
from beam_rl.envs.registry import register_env
from beam_rl.envs.sandbox import SandboxLimits, SandboxResult, SandboxUnavailable, run_python
from beam_rl.printable import printable

HARNESS = (Path(__file__).resolve().parent / "code_harness.py").read_text()
# Opening fence with an optional language tag, the code, then a closing fence or the end of the text
# (a completion cut at max_tokens still holds its program).
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:^[ \t]*```|\Z)", re.DOTALL | re.MULTILINE)


def split_test(test: str) -> tuple[str, Any]:
    """`assert <expression> == <literal>` as (expression, expected value).

    The expression runs in the sandbox; the expected value is a Python literal, compared outside it.
    """
    try:
        (statement,) = ast.parse(test).body
    except (SyntaxError, ValueError):
        raise ValueError(f"test {test!r} is not one Python statement") from None
    compare = statement.test if isinstance(statement, ast.Assert) else None
    if not (isinstance(compare, ast.Compare) and len(compare.ops) == 1 and isinstance(compare.ops[0], ast.Eq)):
        raise ValueError(f"test {test!r} is not of the form `assert <expression> == <literal>`")
    try:
        expected = ast.literal_eval(compare.comparators[0])
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise ValueError(f"test {test!r}: the right-hand side of == must be a Python literal") from None
    return ast.get_source_segment(test, compare.left) or ast.unparse(compare.left), expected


class CodeRow(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    task_id: str = Field(min_length=1)
    prompt: PromptText  # the function's signature and docstring, to be completed
    tests: list[str] = Field(min_length=1)  # each `assert <expression> == <literal>`
    reference: str | None = None  # a solution that passes every test (bundled tasks have one)

    @field_validator("tests")
    @classmethod
    def _assert_style(cls, tests: list[str]) -> list[str]:
        for i, test in enumerate(tests):
            try:
                split_test(test)
            except ValueError as err:
                raise ValueError(f"tests[{i}]: {err}") from None
        return tests


def extract_program(text: str) -> str:
    """The program in a completion: its first fenced block tagged python/py (else its first fenced
    block of any kind), or the whole text when it has no fence."""
    blocks = [(m.group(1).lower(), m.group(2)) for m in _FENCE.finditer(text)]
    for tag, body in blocks:
        if tag in ("python", "py", "python3"):
            return body
    return blocks[0][1] if blocks else text


@dataclass(frozen=True)
class TestOutcome:
    passed: bool
    detail: str  # "passed", "returned 3, expected 4", "ZeroDivisionError: ...", "timed out after 2.0 s"


@dataclass(frozen=True)
class TestReport:
    """Every test's outcome for one program, and the sandbox run that produced them."""

    outcomes: list[TestOutcome]
    sandbox: SandboxResult

    @property
    def score(self) -> float:
        return sum(o.passed for o in self.outcomes) / len(self.outcomes)


@register_env
class Code(DatasetEnvironment):
    """Single-turn coding: complete a function; reward = tests passed / tests.

    All of a rollout's tests run in one sandbox (limits from the constructor: `cpu_s`, `wall_s`,
    `memory_mb`, `processes`, `file_size_mb`, defaulting to SandboxLimits'; no network), each in its
    own process with at most `test_timeout_s`. The sandbox's caps hold all of its processes together:
    the harness, the test's process and whatever the program starts share `processes`, `memory_mb`
    and `cpu_s`. A program that loops, crashes or exhausts a limit fails the tests it spoils;
    only a sandbox that cannot run at all makes the reward unavailable.
    """

    name = "code"
    row_model = CodeRow
    data_dir = Path(__file__).resolve().parent / "data"
    data_name = "code"
    PROMPT = (
        "Complete this Python function. Reply with the whole function in one ```python code block.\n\n"
        "```python\n{prompt}```"
    )
    # The harness stops starting tests after this share of wall_s, so its report is written in time.
    BUDGET_SHARE = 0.8

    def __init__(
        self,
        tokenizer: Any,
        max_turns: int = 1,
        *,
        cpu_s: float = SandboxLimits.cpu_s,
        wall_s: float = SandboxLimits.wall_s,
        memory_mb: int = SandboxLimits.memory_mb,
        processes: int = SandboxLimits.processes,
        file_size_mb: int = SandboxLimits.file_size_mb,
        test_timeout_s: float = 1.0,
        dataset: str | Path | None = None,
        bad_rows: BadRows = "fail",
        max_context: int | None = None,
    ) -> None:
        super().__init__(tokenizer, max_turns, dataset=dataset, bad_rows=bad_rows, max_context=max_context)
        self.limits = SandboxLimits(
            cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb, processes=processes, file_size_mb=file_size_mb
        )
        if not test_timeout_s > 0:
            raise ValueError(f"test_timeout_s must be > 0, got {test_timeout_s}")
        self.test_timeout_s = test_timeout_s

    def render_prompt(self, row: dict[str, Any]) -> list[int]:
        content = self.PROMPT.format(prompt=row["prompt"])
        return chat_prompt_ids(self.tokenizer, [{"role": "user", "content": content}])

    async def reward(self, row: dict[str, Any], trajectory: Trajectory) -> float:
        try:
            report = await self.run_tests(row, extract_program(self.final_text(trajectory)))
        except SandboxUnavailable as err:
            raise RewardUnavailable(str(err)) from err
        return report.score

    async def run_tests(self, row: dict[str, Any], program: str) -> TestReport:
        """Run `program` against every test of `row` in one sandbox."""
        calls, expected = zip(*(split_test(test) for test in row["tests"]), strict=True)
        token = secrets.token_hex(16)  # marks the harness's report line among the program's output
        spec = {
            "calls": calls,
            "token": token,
            "test_timeout_s": self.test_timeout_s,
            "budget_s": self.limits.wall_s * self.BUDGET_SHARE,
        }
        result = await run_python(
            HARNESS, files={"solution.py": program, "tests.json": json.dumps(spec)}, limits=self.limits
        )
        replies = _report(result.stdout, token, len(calls))
        if replies is None:
            why = _why_no_report(result)
            return TestReport([TestOutcome(False, why)] * len(calls), result)
        return TestReport([_outcome(reply, want) for reply, want in zip(replies, expected, strict=True)], result)


def _report(stdout: str, token: str, n_tests: int) -> list[Any] | None:
    for line in reversed(stdout.splitlines()):
        head, _, payload = line.partition(" ")
        if head == token:
            try:
                replies = json.loads(payload)
            except ValueError:
                return None
            return replies if isinstance(replies, list) and len(replies) == n_tests else None
    return None


def _why_no_report(result: SandboxResult) -> str:
    if result.timed_out:
        return f"no test report: the sandbox timed out after {result.wall_s:.1f} s"
    if result.signal:
        return f"no test report: the harness was {result.verdict}"
    if result.output_truncated:
        return "no test report: the program flooded the output"
    return f"no test report (harness exit status {result.exit_code})"


def _outcome(reply: Any, expected: Any) -> TestOutcome:
    if not isinstance(reply, dict):
        return TestOutcome(False, "malformed test result")
    if "timeout" in reply:
        timeout = reply["timeout"]
        return TestOutcome(False, f"timed out after {timeout} s" if timeout else "not run: out of time")
    if "error" in reply:  # the program's exception: its message is the program's text
        return TestOutcome(False, printable(str(reply["error"])))
    try:
        value = decode(reply.get("value"))
    except (ValueError, TypeError, RecursionError) as err:
        return TestOutcome(False, f"unreadable result: {err}")
    if same(value, expected):
        return TestOutcome(True, "passed")
    return TestOutcome(False, f"returned {_short(value)}, expected {_short(expected)}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


_SCALARS: dict[str, type] = {"bool": bool, "int": int, "str": str}
_COLLECTIONS: dict[str, type] = {"list": list, "tuple": tuple, "set": set, "frozenset": frozenset}


class _Unsupported:
    """A returned object of a type no test expects (its type's name kept for the message)."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name

    def __repr__(self) -> str:
        return f"<{self.type_name} object>"


def decode(node: Any) -> Any:
    """The value the harness encoded as [type tag, payload] (see code_harness.encode)."""
    if not (isinstance(node, list) and len(node) == 2 and isinstance(node[0], str)):
        raise ValueError(f"not a tagged value: {node!r:.80}")
    tag, payload = node
    if tag == "none" and payload is None:
        return None
    if tag in _SCALARS and type(payload) is _SCALARS[tag]:
        return payload
    if tag == "float" and isinstance(payload, str):
        return float(payload)
    if tag == "bytes" and isinstance(payload, str):
        return bytes.fromhex(payload)
    if tag in _COLLECTIONS and isinstance(payload, list):
        return _COLLECTIONS[tag](decode(item) for item in payload)
    if tag == "dict" and isinstance(payload, list):
        return {decode(k): decode(v) for k, v in payload}
    if tag == "other" and isinstance(payload, str):
        return _Unsupported(payload)
    raise ValueError(f"bad tagged value: {node!r:.80}")


def same(value: Any, expected: Any) -> bool:
    """Equal and of exactly the same types throughout (True is not 1, 1.0 is not 1); floats within a
    relative 1e-9."""
    if type(value) is not type(expected):
        return False
    if isinstance(expected, float):
        both_nan = math.isnan(value) and math.isnan(expected)
        return both_nan or math.isclose(value, expected, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(expected, (list, tuple)):
        return len(value) == len(expected) and all(same(v, e) for v, e in zip(value, expected, strict=True))
    if isinstance(expected, dict):
        return value.keys() == expected.keys() and all(same(value[k], expected[k]) for k in expected)
    return value == expected
