"""A black-box agent as an environment: any program that samples through an OpenAI client.

Each rollout runs `command` once, in a process group of its own, with the dataset row as JSON on its stdin,
`OPENAI_BASE_URL` naming the rollout's endpoint on the inference proxy (beam_rl/envs/proxy.py) and
`OPENAI_API_KEY` the endpoint's secret, which no other rollout's program is given; the `openai` package
reads both itself. Every call it makes is one turn of the rollout, sampled by the dispatcher's client and
kept token for token. It reports its result as a JSON object on the last line of
its stdout; `reward` (a number) is the rollout's reward, and the object travels in the rollout's info.

The program is the user's own code, like a plug-in environment: it runs with the run's permissions. Its
environment holds only PATH, HOME, the locale, TMPDIR, VIRTUAL_ENV and PYTHONPATH of the worker, the
proxy's two variables and the `env` given here, so the worker's credentials do not reach it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from beam_rl.envs.base import (
    CompletionClient,
    DatasetEnvironment,
    RewardUnavailable,
    SamplingParams,
    Trajectory,
    chat_prompt_ids,
)
from beam_rl.envs.datasets import BadRows
from beam_rl.envs.multi_turn import FollowUps
from beam_rl.envs.proxy import Endpoint, Episode, shared_proxy
from beam_rl.envs.registry import register_env
from beam_rl.processes import scrubbed_env

_STDERR_TAIL = 2000  # characters of a failed agent's stderr kept in the rollout's error


class AgentRow(BaseModel):
    """A row the agent is given whole; `prompt` is the first user message a group's rollouts share."""

    model_config = ConfigDict(extra="allow")

    prompt: str = Field(min_length=1)


class AgentError(RuntimeError):
    """The agent program failed its episode: it exited with an error, ran past its time, or made no call."""


@register_env
class BlackBoxAgent(DatasetEnvironment):
    """`command` (a list, or a string split like a shell's) runs once per rollout; `timeout_s` bounds it.
    `dataset` is required: a directory of `<split>.jsonl` files whose rows have a `prompt`."""

    name = "agent"
    multi_turn = True
    row_model = AgentRow

    def __init__(
        self,
        tokenizer: Any,
        max_turns: int = 4,
        *,
        command: list[str] | str,
        dataset: str | Path | None = None,
        timeout_s: float = 300.0,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        max_context: int | None = None,
        bad_rows: BadRows = "fail",
    ) -> None:
        if dataset is None:
            raise ValueError("the agent environment needs `dataset`: a directory of <split>.jsonl rows with a prompt")
        super().__init__(tokenizer, max_turns, dataset=dataset, bad_rows=bad_rows, max_context=max_context)
        self.command = shlex.split(command) if isinstance(command, str) else [str(part) for part in command]
        if not self.command:
            raise ValueError("the agent environment's `command` is empty")
        if shutil.which(self.command[0]) is None:
            raise ValueError(
                f"the agent environment's command {self.command[0]!r} is not an executable found "
                "on PATH or at that path"
            )
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.extra_env = {str(k): str(v) for k, v in (env or {}).items()}
        self.cwd = cwd
        stops = self.stop_token_ids()
        if not stops:
            raise ValueError("the agent environment needs a tokenizer with an eos token (the end of a turn)")
        self.follow_ups = FollowUps(tokenizer, stops[0])

    def render_prompt(self, row: dict[str, Any]) -> list[int]:
        # The group's prompt, for admission and prefix affinity; the rollout's own is its first call's.
        return chat_prompt_ids(self.tokenizer, [{"role": "user", "content": row["prompt"]}])

    async def run(
        self, client: CompletionClient, row: dict[str, Any], prompt_ids: list[int], sampling: SamplingParams
    ) -> Trajectory:
        proxy = await shared_proxy()
        episode = Episode(self, client, sampling, self.follow_ups)
        try:
            with proxy.serve(episode) as endpoint:
                result = await self._run_program(endpoint, row)
        finally:
            await episode.aclose()
        if episode.failure is not None:
            raise episode.failure  # the inference error itself: a server's fault counts as one
        if not episode.turns:
            raise AgentError(f"agent `{shlex.join(self.command)}`: it exited without calling the model")
        return episode.trajectory({"agent": result})

    async def _run_program(self, endpoint: Endpoint, row: dict[str, Any]) -> dict[str, Any]:
        env = scrubbed_env()
        env.update(self.extra_env, OPENAI_BASE_URL=endpoint.base_url, OPENAI_API_KEY=endpoint.secret)
        process = await asyncio.create_subprocess_exec(
            *self.command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            cwd=self.cwd,
            start_new_session=True,
        )
        try:
            out, err = await asyncio.wait_for(process.communicate(json.dumps(row).encode()), self.timeout_s)
        except TimeoutError:
            raise AgentError(
                f"agent `{shlex.join(self.command)}`: still running after timeout_s = {self.timeout_s:g} s; stopped"
            ) from None
        finally:
            if process.returncode is None:  # timed out, or the rollout was cancelled: the whole group goes
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
        if process.returncode != 0:
            tail = err.decode(errors="replace").strip()[-_STDERR_TAIL:]
            raise AgentError(
                f"agent `{shlex.join(self.command)}`: exited with status {process.returncode}"
                + (f": {tail.splitlines()[-1]}" if tail else "")
            )
        return _result(out.decode(errors="replace"))

    def reward(self, row: dict[str, Any], trajectory: Trajectory) -> float:
        value = trajectory.info.get("agent", {}).get("reward")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RewardUnavailable(
                "the agent reported no reward: print a JSON object with a numeric 'reward' as the last line of stdout"
            )
        return float(value)


def _result(stdout: str) -> dict[str, Any]:
    """The JSON object on the last non-empty line of the agent's stdout; none is an empty result."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    if not lines:
        return {}
    try:
        result = json.loads(lines[-1])
    except json.JSONDecodeError:
        return {}
    return result if isinstance(result, dict) else {}
