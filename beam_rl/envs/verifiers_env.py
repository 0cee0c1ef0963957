"""`kind = "verifiers"`: a verifiers (v1, PyPI 0.4.0) environment run whole (`env`, its id:
beam_rl/envs/verifiers_episodes.py), or a taskset as a single-turn beam-rl environment (`taskset`, an import
path): its tasks are the rows, and its own `@vf.reward` functions score each completion, called the way
verifiers calls them (Task.score).

verifiers is imported when the environment is built, not with beam-rl: only runs that use it pay for its
import. It is one of beam-rl's dependencies since Beam 2.70, whose protobuf < 7 admits the >= 6.31 that
verifiers needs through prime-sandboxes (docs/environments.md, "verifiers").
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from pydantic import TypeAdapter

from beam_rl.envs.base import (
    CompletionClient,
    Environment,
    RewardUnavailable,
    SamplingParams,
    Trajectory,
    chat_prompt_ids,
)
from beam_rl.envs.registry import register_env
from beam_rl.envs.verifiers_episodes import VerifiersEpisodes, verifiers_module


def _needs_runtime(fn: Any) -> bool:
    # Task.score skips a signal whose `runtime` parameter has no default when it is given no runtime.
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


@register_env
class Verifiers(Environment):
    """`env` (a v1 environment's id) runs its episodes whole (VerifiersEpisodes); `taskset` (an import path
    "module:Class") scores beam-rl's single-turn completions with the taskset's own rewards (VerifiersTaskset).
    The other arguments are the chosen one's."""

    name = "verifiers"

    def __init__(
        self,
        tokenizer: Any,
        max_turns: int = 4,
        *,
        env: str | None = None,
        taskset: str | None = None,
        max_context: int | None = None,
        **args: Any,
    ) -> None:
        if (env is None) == (taskset is None):
            raise ValueError(
                "verifiers: give `env` (a v1 environment's id, run whole) or `taskset` (an import path "
                "'package.module:Class', whose rewards score single turns), not both"
            )
        super().__init__(tokenizer, max_turns)
        self.impl: Environment = (
            VerifiersEpisodes(tokenizer, max_turns, env=env, max_context=max_context, **args)
            if env is not None
            else VerifiersTaskset(tokenizer, max_turns, taskset=taskset or "", **args)
        )  # set: checked above
        self.multi_turn = self.impl.multi_turn

    def __getattr__(self, name: str) -> Any:  # what only the chosen one has (follow_ups, config, ...)
        if name == "impl":
            raise AttributeError(name)
        return getattr(self.impl, name)

    def load_rows(self, split: str = "train") -> list[dict[str, Any]]:
        return self.impl.load_rows(split)

    def group_is_one_call(self) -> bool:
        return self.impl.group_is_one_call()

    def render_prompt(self, row: dict[str, Any]) -> list[int]:
        return self.impl.render_prompt(row)

    def reward(self, row: dict[str, Any], trajectory: Trajectory) -> Any:
        return self.impl.reward(row, trajectory)

    def stop_token_ids(self) -> list[int]:
        return self.impl.stop_token_ids()

    async def run(
        self, client: CompletionClient, row: dict[str, Any], prompt_ids: list[int], sampling: SamplingParams
    ) -> Trajectory:
        return await self.impl.run(client, row, prompt_ids, sampling)

    async def run_group(
        self, client: CompletionClient, row: dict[str, Any], prompt_ids: list[int], sampling: SamplingParams, n: int
    ) -> list[Trajectory]:
        return await self.impl.run_group(client, row, prompt_ids, sampling, n)


class VerifiersTaskset(Environment):
    """Rows are the tasks' data (TaskData as JSON); the prompt is the task's system prompt and prompt,
    rendered with the policy's chat template; reward = verifiers' weighted sum of the task's rewards
    (`Trace.reward`) for a trace holding the prompt and the completion's text as the assistant's reply.

    `taskset` (and `eval_taskset`, for the "eval" split) is an import path "module:Class" of a
    `vf.Taskset` subclass, built with its own config type from `taskset_args`. Only what runs without a
    runtime is supported: a reward that needs one (a sandbox) or a judge (a model endpoint) is refused
    when the environment is built. A scoring failure (verifiers' TaskError) makes the rollout an error,
    as an errored trace is in verifiers, not a reward of 0.
    """

    name = "verifiers"

    def __init__(
        self,
        tokenizer: Any,
        max_turns: int = 1,
        *,
        taskset: str,
        eval_taskset: str | None = None,
        taskset_args: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(tokenizer, max_turns)
        self._vf = verifiers_module()
        self._paths = {"train": taskset, "eval": eval_taskset}
        self._args = dict(taskset_args or {})
        self._tasks: dict[str, list[Any]] = {}
        self._template = self.tasks("train")[0]  # one task type per taskset: it rebuilds a task from a row
        self._check_scorable(self._template)

    def tasks(self, split: str) -> list[Any]:
        if split not in self._tasks:
            path = self._paths.get(split)
            if path is None:
                raise ValueError(f"verifiers environment: no taskset for split {split!r} (set eval_taskset)")
            self._tasks[split] = self._load(path)
        return self._tasks[split]

    def _load(self, path: str) -> list[Any]:
        from verifiers.v1.utils.generic import concrete_type

        module_name, _, attr = path.partition(":")
        if not module_name or not attr:
            raise ValueError(f"taskset must be an import path 'package.module:Class', got {path!r}")
        cls = getattr(importlib.import_module(module_name), attr)
        if not (isinstance(cls, type) and issubclass(cls, self._vf.Taskset)):
            raise ValueError(f"taskset {path!r} is not a verifiers.v1 Taskset subclass")
        config_type = concrete_type(cls, self._vf.TasksetConfig, origin=self._vf.Taskset) or self._vf.TasksetConfig
        taskset = cls(config_type(**self._args))
        if not taskset.bounded:
            raise ValueError(f"taskset {path!r} is infinite: bound it (e.g. a Taskset.take view) to use it here")
        tasks = list(taskset)
        if not tasks:
            raise ValueError(f"taskset {path!r} has no tasks")
        return tasks

    def _check_scorable(self, task: Any) -> None:
        rewards = task.hooks("reward")
        needs = [fn.__name__ for fn in rewards if _needs_runtime(fn)]
        if needs:
            raise ValueError(f"verifiers rewards {needs} need a runtime (a sandbox); this adapter scores offline")
        if task.config.judges:
            raise ValueError("verifiers judges need a model endpoint; this adapter runs the task's rewards only")
        if not rewards:
            raise ValueError(f"{type(task).__name__} has no @vf.reward function")

    def load_rows(self, split: str = "train") -> list[dict[str, Any]]:
        return [task.data.model_dump(mode="json", exclude_none=True) for task in self.tasks(split)]

    def _task(self, row: dict[str, Any]) -> Any:
        data_type = type(self._template).data_type()
        return type(self._template)(data_type.model_validate(row), self._template.config)

    def _messages(self, task: Any) -> list[dict[str, Any]]:
        data = task.data
        messages: list[dict[str, Any]] = []
        if data.system_prompt:
            messages.append({"role": "system", "content": data.system_prompt})
        if isinstance(data.prompt, str):
            messages.append({"role": "user", "content": data.prompt})
        else:
            messages += [m.model_dump(mode="json", exclude_none=True) for m in data.prompt or []]
        return messages

    def render_prompt(self, row: dict[str, Any]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, self._messages(self._task(row)))

    async def reward(self, row: dict[str, Any], trajectory: Trajectory) -> float:
        from verifiers.v1.errors import TaskError
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask

        vf = self._vf
        task = self._task(row)
        as_message = TypeAdapter(vf.Message).validate_python
        nodes = [
            MessageNode(parent=i - 1 if i else None, message=as_message(message))
            for i, message in enumerate(self._messages(task))
        ]
        reply = vf.AssistantMessage(content=self.final_text(trajectory))
        nodes.append(MessageNode(parent=len(nodes) - 1, message=reply, sampled=True))
        trace = Trace(
            task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            agent=AgentInfo(config=vf.AgentConfig(), name="beam-rl"),
            nodes=nodes,
        )
        try:
            await task.score(trace)
        except TaskError as exc:
            raise RewardUnavailable(f"verifiers scoring failed: {exc}") from exc
        unscored = [name for name, value in trace.rewards.items() if value is None]
        if unscored:
            raise RewardUnavailable(f"verifiers rewards {unscored} produced no score")
        return trace.reward
