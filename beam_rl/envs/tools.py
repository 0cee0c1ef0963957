"""Tools a model can call, and the calls it writes: Qwen/Hermes `<tool_call>{"name", "arguments"}</tool_call>`."""

from __future__ import annotations

import abc
import ast
import json
import math
import operator
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar

# A block runs to its closing tag, or to the end of the text when a completion was cut inside it.
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class BadToolCall:
    """A <tool_call> block that cannot be run; `problem` is what the model is told."""

    text: str
    problem: str


def parse_tool_calls(text: str) -> list[ToolCall | BadToolCall]:
    """Every <tool_call> block of `text`, in order: a call to run, or what is wrong with it."""
    calls: list[ToolCall | BadToolCall] = []
    for match in _TOOL_CALL.finditer(text):
        body = match.group(1).strip()
        if not match.group(2):
            calls.append(BadToolCall(body, "the tool call has no closing </tool_call>"))
            continue
        calls.append(_parse_call(body))
    return calls


def _parse_call(body: str) -> ToolCall | BadToolCall:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as exc:
        return BadToolCall(body, f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})")
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return BadToolCall(body, 'a tool call is a JSON object {"name": ..., "arguments": {...}}')
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return BadToolCall(body, "the tool call's arguments must be a JSON object")
    return ToolCall(payload["name"], arguments)


class ToolError(Exception):
    """A call the tool refuses (bad arguments, an expression it cannot evaluate): the message goes back
    to the model as the tool's answer. Any other exception is a failure of the tool itself."""


class Tool(abc.ABC):
    """A function the model may call: a name, a description and a JSON schema of its arguments."""

    name: ClassVar[str]
    description: ClassVar[str]
    parameters: ClassVar[dict[str, Any]]

    def schema(self) -> dict[str, Any]:
        """The tool as chat templates take it (`tools=[...]`, OpenAI's function format)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    @abc.abstractmethod
    async def __call__(self, arguments: dict[str, Any]) -> str:
        """The tool's answer as text; raise ToolError for a call it refuses."""

    def _argument(self, arguments: dict[str, Any], key: str) -> str:
        value = arguments.get(key)
        if not isinstance(value, str):
            raise ToolError(f"{self.name} takes {{\"{key}\": <string>}}, got arguments {json.dumps(arguments)}")
        return value


# -- calculator -----------------------------------------------------------------------------------

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 500
MAX_INT_BITS = 4096  # ~1233 decimal digits: far beyond any task, far below a CPU-bound bignum


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses), evaluated on its
    syntax tree: names, calls and attributes are refused, and so are results too large to compute."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"not an arithmetic expression ({exc.msg})") from None
    try:
        return _evaluate(tree.body)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except OverflowError:
        raise ToolError("result too large") from None


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        # Estimate before computing: 9 ** 9 ** 9 must be refused, not attempted.
        if (
            isinstance(node.op, ast.Pow)
            and isinstance(left, int)
            and isinstance(right, int)
            and right > 0
            and max(left.bit_length(), 1) * right > MAX_INT_BITS * 2
        ):
            raise ToolError("result too large")
        return _bounded(_BINARY[type(node.op)](left, right))
    raise ToolError(f"unsupported syntax: {ast.unparse(node)!r}")


def _bounded(value: int | float) -> int | float:
    if isinstance(value, complex):  # a negative number to a fractional power
        raise ToolError("the result is not a real number")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ToolError("result too large")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result too large")
    return value


class Calculator(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression exactly (integers of any size, + - * / // % ** and parentheses)."
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. \"(123 + 4) * 5678\""}},
        "required": ["expression"],
    }

    async def __call__(self, arguments: dict[str, Any]) -> str:
        return str(evaluate(self._argument(arguments, "expression")))


# -- python (in the sandbox) ------------------------------------------------------------------------

RunPython = Callable[[str], Awaitable[Any]]  # source -> SandboxResult (exit_code, stdout, stderr, timed_out, ...)


class PythonTool(Tool):
    """Runs the model's code in beam_rl.envs.sandbox and answers with what it printed.

    `run_python` replaces the sandbox (same call and result shape); by default beam_rl.envs.sandbox.run_python
    is imported at the first call. SandboxUnavailable (the sandbox itself failed) is not the model's doing:
    it propagates, and the rollout leaves as an error instead of being scored.
    """

    name = "python"
    description = "Run a Python 3 program and return what it prints (stdout; stderr and the exit code if it fails)."
    parameters: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "a complete program; print the result"}},
        "required": ["code"],
    }

    def __init__(self, run_python: RunPython | None = None) -> None:
        self._run_python = run_python

    async def __call__(self, arguments: dict[str, Any]) -> str:
        code = self._argument(arguments, "code")
        run = self._run_python
        if run is None:
            from beam_rl.envs.sandbox import run_python  # the sandbox module is optional until used

            run = run_python
        result = await run(code)
        parts = [result.stdout]
        if result.timed_out:
            parts.append("[timed out]")
        elif result.signal:  # a limit (SIGXCPU for CPU time, ...) ended it
            parts += [result.stderr, f"[killed by {result.signal}]"]
        elif result.exit_code != 0:
            parts += [result.stderr, f"[exit code {result.exit_code}]"]
        return "\n".join(part.rstrip("\n") for part in parts if part)


TOOLS: dict[str, type[Tool]] = {tool.name: tool for tool in (Calculator, PythonTool)}
