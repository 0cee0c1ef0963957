"""A fleet of simulated vLLM engines for scale benchmarks: many `EmbeddedServer(mode="simulated")` on one event
loop per process, each on its own loopback port with the routes, metrics and `/simulated/trace` of the
single server, spread over a few processes so that thousands fit a small machine.

    python -m beam_rl.standin.fleet --servers 1000 --processes 2 --max-num-seqs 4 --sim-time-scale 50

prints `READY <url> <url> ...` once every server listens, and serves until SIGINT or SIGTERM.

- One engine per server (beam_rl/standin/simulated.py), unchanged: continuous batching, log-normal lengths,
  a prefix cache, a bounded KV cache with `--sim-kv-cache-tokens`; streamed answers send one event per
  engine step per request, as vLLM does.
- The fleet runs in processes of its own, so a client measuring its own CPU (a dispatcher) does not pay
  for the fleet; `--sim-time-scale` slows every engine step so that the fleet's event rate fits the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import pathlib
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

from beam_rl import processes
from beam_rl.standin.launch import wait_until_ready
from beam_rl.standin.server import EmbeddedServer
from beam_rl.standin.simulated import SimulatedParams, add_simulated_args, simulated_params_from_args


async def serve(
    count: int,
    max_num_seqs: int,
    params: SimulatedParams,
    served_model_name: str | None,
    host: str = "127.0.0.1",
    port_base: int = 0,
) -> None:
    """Start `count` servers on this loop, print `READY <urls>`, serve until SIGINT or SIGTERM."""
    servers = [
        EmbeddedServer(
            mode="simulated",
            max_num_seqs=max_num_seqs,
            served_model_name=served_model_name,
            host=host,
            port=port_base + i if port_base else 0,
            simulated=params,
        )
        for i in range(count)
    ]
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    urls = [await server.start_async() for server in servers]
    gc.collect()
    gc.freeze()  # the imports' heap (torch, transformers) lives as long as the process: skip it in collections
    print("READY " + " ".join(urls), flush=True)
    await stopping.wait()
    await asyncio.gather(*(server.stop_async() for server in servers), return_exceptions=True)


def _shares(servers: int, parts: int) -> list[int]:
    """`servers` split over `parts` processes as evenly as can be (none empty)."""
    parts = max(1, min(parts, servers))
    return [servers // parts + (i < servers % parts) for i in range(parts)]


@contextlib.contextmanager
def start_fleet(
    servers: int,
    server_args: tuple[str, ...] | list[str] = (),
    processes_: int = 1,
    port_base: int = 0,
    ready_timeout_s: float = 300.0,
) -> Iterator[tuple[list[str], list[int]]]:
    """`servers` simulated servers in `processes_` child processes; yields (their urls, the processes' pids).
    `server_args`: each process's other flags (`--max-num-seqs`, `--served-model-name`, `--sim-*`)."""
    procs: list[subprocess.Popen] = []
    # This checkout importable in the children, as beam_rl.standin.launch does for a single server.
    root = str(pathlib.Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    try:
        offset = 0
        for count in _shares(servers, processes_):
            cmd = [sys.executable, "-m", "beam_rl.standin.fleet", "--servers", str(count), *server_args]
            if port_base:
                cmd += ["--port-base", str(port_base + offset)]
            offset += count
            procs.append(
                subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, preexec_fn=processes.die_with_parent)
            )
        urls = [url for proc in procs for url in wait_until_ready(proc, ready_timeout_s).split()]
        yield urls, [proc.pid for proc in procs]
    finally:
        processes.stop_processes(procs)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, required=True)
    parser.add_argument("--processes", type=int, default=1, help="spread the servers over this many processes")
    parser.add_argument("--port-base", type=int, default=0, help="server i listens on port-base + i (0: any free)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    add_simulated_args(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.servers < 1 or args.processes < 1:
        raise SystemExit("--servers and --processes must be at least 1")
    if args.processes == 1:
        asyncio.run(
            serve(
                args.servers,
                args.max_num_seqs,
                simulated_params_from_args(args),
                args.served_model_name,
                args.host,
                args.port_base,
            )
        )
        return
    # Several processes: each serves its share with the same flags; this one prints their urls and waits.
    own = {"--servers", "--processes", "--port-base"}
    rest = [a for i, a in enumerate(argv) if a.split("=")[0] not in own and (i == 0 or argv[i - 1] not in own)]
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    with start_fleet(args.servers, rest, args.processes, args.port_base) as (urls, _pids):
        print("READY " + " ".join(urls), flush=True)
        stopping.wait()


if __name__ == "__main__":
    main()
