"""verifiers' rollout loop against the side-by-side harness's fleet (bench/peers/verifiers_peer.py launches it in
verifiers' own virtualenv; it imports verifiers and the standard library, and bench.peers.job for the line format).

Two ways, as verifiers' users run it:
- `stock`: the way prime-rl's orchestrator drives an environment (its `orchestrator/envs.py`): the taskset loaded
  here, the environment served by `serve_env` in a process of its own, each rollout one `EnvClient.run` over ZMQ
  with prime-rl's train client (verifiers' renderer posting token ids to `/inference/v1/generate`), and the
  environment's default harness for a plain chat task, `null`: one chat program, an OS process, per rollout.
- `inproc`: the env layer alone, the way `vf-eval` runs it: the environment in this process (`env.serving()`,
  `env.run_slot`), with a harness that calls the model from the event loop (bench/peers/shims/vf_peer_direct),
  so what a rollout costs is verifiers' interception, trace and scoring, not a process per rollout.

Each finished rollout appends its line to `--out`; the loop keeps `--max-concurrent` rollouts in flight (whole
groups, each group's rollouts on one server, servers taken in turn) until `--groups` groups have finished.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing
import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.serve import EnvClient, env_config_data, serve_env

from bench.peers.job import append_rollout

RunOne = Callable[[Any, Any], Awaitable[Any]]  # (task, client config) -> the episode


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("stock", "inproc"), required=True)
    parser.add_argument("--urls", required=True, help="the servers' base URLs, comma separated")
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokenizer", required=True, help="a local tokenizer directory for verifiers' renderer")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--group-size", type=int, required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--groups", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--turns", type=int, default=1, help="model calls per rollout (inproc: its tool loop)")
    parser.add_argument("--max-concurrent", type=int, default=64, help="rollouts in flight")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def env_config(args: argparse.Namespace) -> Any:
    harness = {"id": "null"} if args.mode == "stock" else {"id": "vf_peer_direct", "turns": args.turns}
    return vf.resolve_env_config(
        {
            "taskset": {"id": "vf_peer_prompts", "prompts_path": args.prompts},
            "agent": {"runtime": {"type": "subprocess"}, "harness": harness, "max_turns": max(args.turns, 1)},
        }
    )


def clients(args: argparse.Namespace) -> list[Any]:
    """One train client per server, as prime-rl configures its inference pool (the renderer pinned to a model)."""
    return [
        vf.TrainClientConfig(
            base_url=f"{url.rstrip('/')}/v1", api_key_var="BEAM_RL_PEER_KEY", renderer_model_name=args.tokenizer
        )
        for url in args.urls.split(",")
    ]


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


async def drive(args: argparse.Namespace, tasks: list[Any], run_one: RunOne) -> None:
    """Groups in flight up to the cap, each group's rollouts on one server; a line per finished rollout."""
    sampling_clients = itertools.cycle(clients(args))
    task_stream: Iterator[Any] = itertools.cycle(tasks)
    slots = asyncio.Semaphore(args.max_concurrent)
    out = open(args.out, "a")  # noqa: SIM115 (open for the loop's life)

    async def rollout(task: Any, client: Any) -> None:
        async with slots:
            episode = await run_one(task, client)
        (trace,) = episode.traces
        usage = trace.usage
        finish = trace.calls[-1].finish_reason if trace.calls else None
        append_rollout(
            out,
            task.data.group_id,
            usage.completion_tokens if usage else 0,
            finish or str(trace.stop_condition),
            time.time(),
        )

    async def group(task: Any, client: Any) -> None:
        await asyncio.gather(*(rollout(task, client) for _ in range(args.group_size)))

    groups_in_flight = max(1, args.max_concurrent // args.group_size)
    pending: set[asyncio.Task[None]] = set()
    started = 0
    while started < args.groups or pending:
        while started < args.groups and len(pending) < groups_in_flight:
            pending.add(asyncio.create_task(group(next(task_stream), next(sampling_clients))))
            started += 1
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for finished in done:
            finished.result()
    out.close()


async def run_stock(args: argparse.Namespace, tasks: list[Any], config: Any) -> None:
    address = free_address()
    spawn = multiprocessing.get_context("spawn")
    # The pipe's far end closing (this process gone, even killed) tells the env server to stop, as prime-rl's
    # launcher arms its servers: the harness stops this process's group, and no env server outlives it.
    keep, death_pipe = spawn.Pipe()
    server = spawn.Process(
        target=serve_env,
        kwargs={"max_workers": 1, "address": address, "death_pipe": death_pipe, "config_data": env_config_data(config)},
    )
    server.start()
    death_pipe.close()
    client = EnvClient(address)
    sampling = vf.SamplingConfig(max_tokens=args.max_tokens, temperature=1.0)
    try:
        await client.wait_for_server_startup(timeout=300)

        async def run_one(task: Any, client_config: Any) -> Any:
            return await client.run(client_config, args.model, sampling, task.data.model_dump(mode="json"))

        await drive(args, tasks, run_one)
    finally:
        await client.close()
        keep.close()
        server.join(30)


async def run_inproc(args: argparse.Namespace, tasks: list[Any], config: Any) -> None:
    env = vf.load_environment(config)
    sampling = vf.SamplingConfig(max_tokens=args.max_tokens, temperature=1.0)
    contexts: dict[str, Any] = {}

    async def run_one(task: Any, client_config: Any) -> Any:
        context = contexts.setdefault(
            client_config.base_url, vf.ModelContext(model=args.model, sampling=sampling, client=client_config)
        )
        (slot,) = env.slots(task)
        return await env.run_slot(slot, context)

    async with env.serving():
        await drive(args, tasks, run_one)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = env_config(args)
    tasks = list(vf.load_taskset(config.taskset))  # the client owns the taskset, as prime-rl's does
    if not tasks:
        sys.exit(f"verifiers loop: {args.prompts} holds no prompts")
    os.environ.setdefault("BEAM_RL_PEER_KEY", "EMPTY")
    asyncio.run((run_stock if args.mode == "stock" else run_inproc)(args, tasks, config))


if __name__ == "__main__":
    main()
