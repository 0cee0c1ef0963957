"""What an environment's way of reaching the model costs, side by side in one run against one embedded
instant server in a process of its own (its CPU is not counted):

- a two-turn episode (a completion, a user message, a completion) run inline (the environment calls the
  dispatcher's client), inline through the inference proxy (it calls the proxy with the `openai` package,
  in the worker's process), and as a black-box agent program (`kind = "agent"`: a process per rollout);
- a two-turn verifiers environment (tests/fixtures/vf_toy_mt: a harness, a tool between its two calls)
  run whole: inline, as a `process` env server and as a `tcp://` env server (verifiers' serve_env, started
  by the bench).

CPU per rollout is the whole machine's user+system time (/proc/stat) less the inference server's, over a
path's rollouts: it counts the worker, the proxy, agent processes, env servers and their runtimes. Latency
is each rollout's sent-to-finished time. Run it on an otherwise idle machine.

    .venv/bin/python -m bench.cost.env_paths --rollouts 256 --max-tokens 128 --out bench/cost/env_paths.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from beam_rl import wiring
from beam_rl.config import config_from_dict
from beam_rl.envs.base import CompletionClient, SamplingParams, Trajectory, chat_prompt_ids
from beam_rl.envs.loop_local import loop_local
from beam_rl.envs.multi_turn import Conversation, FollowUps
from beam_rl.envs.proxy import Episode, shared_proxy
from beam_rl.envs.reverse_text import ReverseText
from beam_rl.standin.launch import start_subprocess_server
from beam_rl.types import GroupRequest, make_group_id
from bench.common.results import write_results

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

    async def run(self, client: CompletionClient, row: dict[str, Any], prompt_ids: list[int],
                  sampling: SamplingParams) -> Trajectory:
        from openai import AsyncOpenAI

        proxy = await shared_proxy()
        episode = Episode(self, client, sampling, self.follow_ups)
        with proxy.serve(episode) as endpoint:

            async def start(stack: contextlib.AsyncExitStack) -> AsyncOpenAI:
                client = AsyncOpenAI(base_url=endpoint.shared_base_url, api_key="x")
                stack.push_async_callback(client.close)
                return client

            # One client for every rollout of the loop, as a harness holds one.
            create = (await loop_local(("openai", id(self)), start)).chat.completions.create
            messages: list[dict[str, Any]] = [{"role": "user", "content": self.prompt_text(row)}]
            first = await create(model="policy", messages=messages, extra_headers=endpoint.headers)
            messages += [{"role": "assistant", "content": first.choices[0].message.content}, FOLLOW_UP]
            await create(model="policy", messages=messages, extra_headers=endpoint.headers)
        return episode.trajectory({})


TOY_ENV = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "vf_toy_mt"
_TICK = os.sysconf("SC_CLK_TCK")


def _machine_cpu_s() -> float:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / _TICK


def _process_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / _TICK  # utime, stime, and its reaped children's


def measure(path: str, env_entry: dict[str, Any], url: str, server_pid: int, rollouts: int, max_tokens: int,
            max_inflight: int) -> dict[str, Any]:
    config = config_from_dict({
        "model": {"max_context": 1024},
        "envs": [{"name": path, "group_size": 4, "mode": "rollout", "max_turns": 2, **env_entry}],
        "inference": {"max_tokens": max_tokens, "max_inflight": max_inflight},
    })
    envs = wiring.build_envs(config)
    env = envs[path]
    rows = env.load_rows("train")
    requests = [GroupRequest(make_group_id(0, i), 0, i, path, 4, rows[i % len(rows)])
                for i in range(rollouts // 4 + 1)]
    out = []
    with wiring.dispatcher_thread(config, [url], envs, lambda: 0) as thread:
        # One group first, outside the measure: a server, a proxy, an env server start with their first episode.
        thread.add_groups(requests[:1])
        while len(out) < 4:
            out += thread.poll(0.1)
        out = []
        cpu, wall = _machine_cpu_s() - _process_cpu_s(server_pid), time.perf_counter()
        thread.add_groups(requests[1:])
        while len(out) < len(requests[1:]) * 4:
            out += thread.poll(0.1)
        cpu, wall = _machine_cpu_s() - _process_cpu_s(server_pid) - cpu, time.perf_counter() - wall
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
    parser.add_argument("--paths", nargs="*", help="only these paths (default: all)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TOY_ENV), os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, str(TOY_ENV))
    with tempfile.TemporaryDirectory() as tmp:
        agent = Path(tmp) / "agent.py"
        agent.write_text(AGENT)
        data = Path(tmp) / "rows"
        data.mkdir()
        texts = [json.loads(line)["text"] for line in (Path(ReverseText.data_dir) / "reverse_text_train.jsonl")
                 .read_text().splitlines()[:64]]
        (data / "train.jsonl").write_text("".join(json.dumps({"prompt": f"Reverse: {t}"}) + "\n" for t in texts))
        external, address = _external_env_server()
        toy = {"kind": "verifiers", "args": {"env": "vf_toy_mt", "config": {"taskset": {"num_tasks": 64}}}}
        paths = {
            "inline": {"kind": "bench.cost.env_paths:TwoTurn"},
            "inline_proxy": {"kind": "bench.cost.env_paths:TwoTurnViaProxy"},
            "agent_process": {"kind": "agent", "args": {"command": [sys.executable, str(agent)],
                                                         "dataset": str(data)}},
            "verifiers_inline": toy,
            "verifiers_process": {**toy, "args": {**toy["args"], "server": "process"}},
            "verifiers_tcp": {**toy, "args": {**toy["args"], "server": address}},
        }
        server, url = start_subprocess_server(mode="instant", max_num_seqs=256)
        try:
            results = []
            for name, entry in paths.items():
                if args.paths and name not in args.paths:
                    continue
                results.append(measure(name, entry, url, server.pid, args.rollouts, args.max_tokens,
                                       args.max_inflight))
                print(results[-1], flush=True)
        finally:
            server.terminate()
            server.wait()
            external.terminate()
            external.wait()

    for r in results:
        base = "inline" if r["path"] in ("inline", "inline_proxy", "agent_process") else "verifiers_inline"
        baseline = next((b for b in results if b["path"] == base), None)
        r["cpu_vs_its_inline"] = r["cpu_ms_per_rollout"] / baseline["cpu_ms_per_rollout"] if baseline else None
    table = Table(title=f"two-turn episodes, {args.max_tokens} tokens a turn, {args.rollouts} rollouts a path")
    for column in ("path", "tokens/rollout", "CPU ms/rollout", "x its inline", "p50 s", "p99 s"):
        table.add_column(column, justify="right")
    for r in results:
        ratio = "" if r["cpu_vs_its_inline"] is None else f"{r['cpu_vs_its_inline']:.2f}"
        table.add_row(r["path"], f"{r['completion_tokens_per_rollout']:.0f}", f"{r['cpu_ms_per_rollout']:.1f}",
                      ratio, f"{r['latency_p50_s']:.3f}", f"{r['latency_p99_s']:.3f}")
    Console().print(table)
    if args.out:
        write_results(args.out, {"args": vars(args) | {"out": str(args.out)}, "results": results})


def _external_env_server() -> tuple[subprocess.Popen, str]:
    """verifiers' serve_env on a TCP port, as someone else would run it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    config = {"taskset": {"id": "vf_toy_mt", "num_tasks": 64},
              "agent": {"runtime": {"type": "subprocess"}, "max_turns": 2}}
    code = ("import json, sys; import verifiers.v1 as vf; from verifiers.v1.serve import serve_env; "
            "serve_env(config=vf.resolve_env_config(json.loads(sys.argv[1])), address=sys.argv[2], max_workers=1)")
    return subprocess.Popen([sys.executable, "-c", code, json.dumps(config), address], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True), address


if __name__ == "__main__":
    main()
