"""Tool calling: the model writes <tool_call> blocks, the environment runs the tools and answers with tool
messages rendered by the chat template, until the model answers without calling a tool.

Tokens stay exact: each turn's context is the previous context plus the completion ids plus the tool
messages' ids, which are cut from the chat template's own rendering; generated text is never re-tokenized.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from beam_rl.envs.arithmetic import ArithmeticRow
from beam_rl.envs.base import CompletionClient, DatasetEnvironment, SamplingParams, Trajectory, chat_prompt_ids
from beam_rl.envs.datasets import BadRows
from beam_rl.envs.multi_turn import ChatTemplateError, Conversation, FollowUps
from beam_rl.envs.registry import register_env
from beam_rl.envs.tools import TOOLS, BadToolCall, Tool, ToolCall, ToolError, parse_tool_calls

# Thousands separators are accepted in an answer ("4,359,267,021"); the answer is the last integer written.
_INTEGER = re.compile(r"-?[0-9]+(?:,[0-9]{3})*(?![0-9])")


def last_integer(text: str) -> int | None:
    """The last integer written in `text` ("so 12 * 3 = 36" -> 36), or None if it has none."""
    matches = _INTEGER.findall(text)
    return int(matches[-1].replace(",", "")) if matches else None


def tool_messages(results: list[tuple[str, str]]) -> list[dict[str, str]]:
    """The tool messages of (tool name, its answer) pairs."""
    return [{"role": "tool", "name": name, "content": content} for name, content in results]


@register_env
class ToolArithmetic(DatasetEnvironment):
    """Arithmetic too big for mental math, with tools: a calculator (and, with tools = ["calculator",
    "python"], Python in the sandbox).

    Each turn's <tool_call> blocks are run in order and answered as tool messages; a malformed call or
    an unknown tool is answered with what is wrong, so the model can try again. The episode ends on a
    turn without a tool call (the final answer), after `max_turns` turns, or when the context is full.
    reward = 1.0 if the final answer's last integer equals the row's answer, else 0.0 (also when the
    episode ended without a final answer).
    """

    name = "tool_arithmetic"
    multi_turn = True
    row_model = ArithmeticRow  # the same rows: a question and its integer answer
    data_dir = Path(__file__).resolve().parent / "data"
    data_name = "tool_arithmetic"
    PROMPT = "What is {question}? Use a tool to compute it, then reply with just the number."
    MAX_TOOL_OUTPUT_CHARS = 2000

    def __init__(
        self,
        tokenizer: Any,
        max_turns: int = 4,
        *,
        tools: list[str] | tuple[str, ...] = ("calculator",),
        max_context: int | None = None,
        dataset: str | Path | None = None,
        bad_rows: BadRows = "fail",
    ) -> None:
        # With max_context, a row whose prompt leaves no room to generate is a bad row.
        super().__init__(tokenizer, max_turns, dataset=dataset, bad_rows=bad_rows, max_context=max_context)
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        unknown = sorted(set(tools) - set(TOOLS))
        if unknown or not tools:
            raise ValueError(f"tools must name some of {sorted(TOOLS)}, got {list(tools)}")
        self.tools: dict[str, Tool] = {name: TOOLS[name]() for name in tools}
        stops = self.stop_token_ids()
        if not stops:
            raise ChatTemplateError(f"{self.name} needs a tokenizer with an eos token (the end of a turn)")
        self._stop_id = stops[0]
        self.follow_ups = FollowUps(tokenizer, self._stop_id)
        self._check_template()

    def _check_template(self) -> None:
        """The template must show the model its tools and carry tool messages; a template without tool
        support would render `tools` as nothing and the model would never learn of them."""
        probe = self.tokenizer.decode(self.render_prompt({"question": "1 + 1", "answer": "2"}))
        response = self.tokenizer.decode(self.follow_ups.ids(tool_messages([("calculator", "4242")]), closed=True))
        if any(name not in probe for name in self.tools) or "4242" not in response:
            raise ChatTemplateError(
                f"the chat template of this tokenizer does not render tools or tool messages; {self.name} "
                "needs a tool-calling template (Qwen/Hermes style)"
            )

    def render_prompt(self, row: dict[str, Any]) -> list[int]:
        content = self.PROMPT.format(question=row["question"])
        return chat_prompt_ids(
            self.tokenizer,
            [{"role": "user", "content": content}],
            tools=[tool.schema() for tool in self.tools.values()],
        )

    async def run(
        self, client: CompletionClient, row: dict[str, Any], prompt_ids: list[int], sampling: SamplingParams
    ) -> Trajectory:
        info: dict[str, Any] = {"answered": False, "tool_calls": 0, "bad_tool_calls": 0}
        conversation = Conversation(self, client, prompt_ids, sampling)
        while (completion_ids := await conversation.complete()) is not None:
            calls = parse_tool_calls(self.decode(completion_ids))
            if not calls:
                info["answered"] = True
                break
            if conversation.last_turn:
                break
            results = [await self._answer(call, info) for call in calls]
            # Tool messages that leave no room to answer end the episode at the next complete().
            conversation.reply(self.follow_ups.ids(tool_messages(results), conversation.closed(self._stop_id)))
        return Trajectory(conversation.turns, info)

    async def _answer(self, call: ToolCall | BadToolCall, info: dict[str, Any]) -> tuple[str, str]:
        """(tool name, what the tool answers) for one call; refusals are answers too."""
        if isinstance(call, BadToolCall):
            info["bad_tool_calls"] += 1
            return "error", f"error: {call.problem}"
        tool = self.tools.get(call.name)
        if tool is None:
            info["bad_tool_calls"] += 1
            return call.name, f"error: unknown tool {call.name!r} (available: {', '.join(self.tools)})"
        info["tool_calls"] += 1
        try:
            output = await tool(call.arguments)
        except ToolError as exc:
            return call.name, f"error: {exc}"
        if len(output) > self.MAX_TOOL_OUTPUT_CHARS:
            cut = len(output) - self.MAX_TOOL_OUTPUT_CHARS
            output = output[: self.MAX_TOOL_OUTPUT_CHARS] + f"\n[{cut} more characters cut]"
        return call.name, output

    def reward(self, row: dict[str, Any], trajectory: Trajectory) -> float:
        if not trajectory.info.get("answered"):
            return 0.0
        return 1.0 if last_integer(self.final_text(trajectory)) == int(row["answer"]) else 0.0
