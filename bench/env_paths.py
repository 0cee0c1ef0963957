"""What an environment's way of reaching the model costs: the same two-turn episode (a completion, a user
message, a completion) run inline (the environment calls the dispatcher's client), inline through the
inference proxy (the environment calls the proxy with the `openai` package, in the worker's process), and
as a black-box agent program (`kind = "agent"`: a process per rollout calling the proxy), side by side in
one run against one embedded instant server in a process of its own (its CPU is not counted).

CPU per rollout is this process's user+system time plus that of the agent processes it reaped, over the
rollouts of the path; latency is each rollout's sent-to-finished time.

    .venv/bin/python -m bench.env_paths --rollouts 256 --max-tokens 128 --out bench/env_paths.json
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from beam_rl import components
from beam_rl.config import config_from_dict
from beam_rl.envs.base import CompletionClient, SamplingParams, Trajectory, chat_prompt_ids
from beam_rl.envs.multi_turn import Conversation, FollowUps
from beam_rl.envs.proxy import Episode, shared_proxy
from beam_rl.envs.reverse_text import ReverseText
from beam_rl.standin.launch import start_subprocess_server
from beam_rl.types import GroupRequest, make_group_id
from bench.results import write_results

FOLLOW_UP = {"role": "user", "content": "Now say it again, differently."}

AGENT = '''
import json, sys
from openai import OpenAI

row = json.load(sys.stdin)
client = OpenAI()
messages = [{"role": "user", "content": row["prompt"]}]
reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
messages += [{"role": "assistant", "content": reply}, %r]
client.chat.completions.create(model="policy", messages=messages)
print(json.dumps({"reward": 0.0}))
''' % FOLLOW_UP


class TwoTurn(ReverseText):
    """reverse_text's rows; two turns with a fixed user message between them, run inline."""

    name = "two_turn"
    multi_turn = True

    def __init__(self, tokenizer: Any, max_turns: int = 2, **kwargs: Any) -> None:
        super().__init__(tokenizer, max_turns, **kwargs)
        self.follow_ups = FollowUps(tokenizer, self.stop_token_ids()[0])

    def render_prompt(self, row: dict[str, Any]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, [{"role": "user", "content": self.prompt_text(row)}])

    def prompt_text(self, row: dict[str, Any]) -> str:
        return f"Reverse: {row['text']}"

    async def run(self, client: CompletionClient, row: dict[str, Any], prompt_ids: list[int],
                  sampling: SamplingParams) -> Trajectory:
        conversation = Conversation(self, client, prompt_ids, sampling)
        completion = await conversation.complete()
        assert completion is not None
        conversation.reply(self.follow_ups.ids([FOLLOW_UP], conversation.closed(self.follow_ups.stop_id)))
        await conversation.complete()
        return Trajectory(conversation.turns)

    def reward(self, row: dict[str, Any], trajectory: Trajectory) -> float:
        return 0.0


class TwoTurnViaProxy(TwoTurn):
    """The same episode, its calls made with the `openai` package through the proxy in this process."""

    name = "two_turn_proxy"
    _openai: Any = None

    async def run(self, client: CompletionClient, row: dict[str, Any], prompt_ids: list[int],
                  sampling: SamplingParams) -> Trajectory:
        from openai import AsyncOpenAI

        proxy = await shared_proxy()
        episode = Episode(self, client, sampling, self.follow_ups)
        with proxy.serve(episode) as endpoint:
            if self._openai is None:  # one client for every rollout, as a harness holds one
                self._openai = AsyncOpenAI(base_url=endpoint.shared_base_url, api_key="x")
            create = self._openai.chat.completions.create
            messages: list[dict[str, Any]] = [{"role": "user", "content": self.prompt_text(row)}]
            first = await create(model="policy", messages=messages, extra_headers=endpoint.headers)
            messages += [{"role": "assistant", "content": first.choices[0].message.content}, FOLLOW_UP]
            await create(model="policy", messages=messages, extra_headers=endpoint.headers)
        return episode.trajectory({})


def _cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure(path: str, env_entry: dict[str, Any], url: str, rollouts: int, max_tokens: int,
            max_inflight: int) -> dict[str, Any]:
    config = config_from_dict({
        "envs": [{"name": path, "group_size": 4, "mode": "rollout", "max_turns": 2, **env_entry}],
        "inference": {"max_tokens": max_tokens, "max_inflight": max_inflight},
    })
    envs = components.build_envs(config)
    env = envs[path]
    rows = env.load_rows("train")
    requests = [GroupRequest(make_group_id(0, i), 0, i, path, 4, rows[i % len(rows)]) for i in range(rollouts // 4)]
    out = []
    with components.dispatcher_thread(config, [url], envs, lambda: 0) as thread:
        cpu, wall = _cpu_s(), time.perf_counter()
        thread.add_groups(requests)
        while len(out) < len(requests) * 4:
            out += thread.poll(0.1)
        cpu, wall = _cpu_s() - cpu, time.perf_counter() - wall
    failed = [r for r in out if not r.ok]
    if failed:
        raise RuntimeError(f"{path}: {len(failed)} rollouts failed, e.g. {failed[0].errors}")
    latency = sorted(r.t_finished - r.t_sent for r in out)
    return {
        "path": path,
        "rollouts": len(out),
        "completion_tokens_per_rollout": statistics.mean(r.completion_tokens for r in out),
        "cpu_ms_per_rollout": 1000 * cpu / len(out),
        "latency_p50_s": latency[len(latency) // 2],
        "latency_p99_s": latency[min(len(latency) - 1, int(0.99 * len(latency)))],
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128, help="per turn: two turns make a rollout")
    parser.add_argument("--max-inflight", type=int, default=32)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        agent = Path(tmp) / "agent.py"
        agent.write_text(AGENT)
        data = Path(tmp) / "rows"
        data.mkdir()
        texts = [json.loads(line)["text"] for line in (Path(ReverseText.data_dir) / "reverse_text_train.jsonl")
                 .read_text().splitlines()[:64]]
        (data / "train.jsonl").write_text("".join(json.dumps({"prompt": f"Reverse: {t}"}) + "\n" for t in texts))
        paths = {
            "inline": {"kind": "bench.env_paths:TwoTurn"},
            "inline_proxy": {"kind": "bench.env_paths:TwoTurnViaProxy"},
            "agent_process": {"kind": "agent", "args": {"command": [sys.executable, str(agent)],
                                                         "dataset": str(data)}},
        }
        server, url = start_subprocess_server(mode="instant", max_num_seqs=256)
        try:
            results = [measure(name, entry, url, args.rollouts, args.max_tokens, args.max_inflight)
                       for name, entry in paths.items()]
        finally:
            server.terminate()
            server.wait()

    base = results[0]["cpu_ms_per_rollout"]
    for r in results:
        r["cpu_vs_inline"] = r["cpu_ms_per_rollout"] / base
    table = Table(title=f"two-turn episode, {args.max_tokens} tokens a turn, {args.rollouts} rollouts a path")
    for column in ("path", "tokens/rollout", "CPU ms/rollout", "x inline", "p50 s", "p99 s"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(r["path"], f"{r['completion_tokens_per_rollout']:.0f}", f"{r['cpu_ms_per_rollout']:.1f}",
                      f"{r['cpu_vs_inline']:.2f}", f"{r['latency_p50_s']:.3f}", f"{r['latency_p99_s']:.3f}")
    Console().print(table)
    if args.out:
        write_results(args.out, {"args": vars(args) | {"out": str(args.out)}, "results": results})


if __name__ == "__main__":
    main()
