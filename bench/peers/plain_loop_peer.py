"""The plainest orchestrator a user could write, as a peer (bench/peers/job.py): one asyncio loop keeping every
slot of the fleet busy with `/v1/completions` requests (a group per request, `n` = group size), servers taken
in turn, a failed request sent again whole to the next server; no scoring, no packing, nothing written but the
rollouts. The harness's own check (tests/pipeline/test_peers.py) and a floor for the orchestrator's CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import httpx

from bench.peers.job import SLOTS_PER_SERVER, PeerJob, append_rollout, job_file, load_job, read_prompts

ATTEMPTS = 5


class PlainLoop:
    NAME = "plain loop"
    CANNOT: ClassVar[dict[str, str]] = {
        "multi_turn": "a completions loop with no environment: nothing answers between turns",
    }

    def unavailable(self) -> str | None:
        return None

    def prepare(self) -> None:
        """Nothing to install: httpx from this checkout's environment."""

    def command(self, job: PeerJob) -> list[str]:
        return [sys.executable, "-m", __name__, "--job", str(job_file(job))]

    def version(self) -> str:
        return f"httpx {httpx.__version__}"


async def run(job: PeerJob) -> None:
    groups = read_prompts(job.prompts_path)[: job.groups]
    servers = itertools.cycle(job.urls)
    slots = asyncio.Semaphore(max(1, len(job.urls) * SLOTS_PER_SERVER // job.group_size))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    with open(job.out_path, "a") as out:
        async with httpx.AsyncClient(timeout=600, limits=limits) as client:

            async def one(group: dict[str, Any]) -> None:
                async with slots:
                    for _ in range(ATTEMPTS):
                        url = next(servers)
                        try:
                            response = await client.post(f"{url}/v1/completions", json=_body(job, group))
                            response.raise_for_status()
                        except httpx.HTTPError:
                            continue
                        for choice in response.json()["choices"]:
                            append_rollout(out, group["group_id"], len(choice["token_ids"]), choice["finish_reason"],
                                           time.time())
                        return

            await asyncio.gather(*(one(group) for group in groups))


def _body(job: PeerJob, group: dict[str, Any]) -> dict[str, Any]:
    return {"model": job.model, "prompt": group["prompt_ids"], "max_tokens": job.max_tokens, "n": job.group_size,
            "temperature": 1.0, "return_token_ids": True}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", type=Path, required=True)
    asyncio.run(run(load_job(parser.parse_args(argv).job)))


if __name__ == "__main__":
    main()
