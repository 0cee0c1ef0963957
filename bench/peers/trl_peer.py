"""TRL's rollout loop as a peer in the side-by-side harness (bench/peers/job.py): `trl.experimental.async_grpo`'s
AsyncRolloutWorker, from TRL's own virtualenv, run by `trl_loop.py` against the fleet.

- The venv is built once per machine from PyPI with uv, under the project's cache (`peers/trl/`), as every peer's
  (`shims/venvs.py`): one builder at a time, marked complete only when every pin installed, rebuilt when a pin
  changes.
- Pinned: TRL and the packages its worker imports, exactly; the rest of the tree as the index stood on
  EXCLUDE_NEWER. torch is PyPI's build (CUDA libraries and all: PyPI has no CPU-only torch); the worker's child
  never touches a GPU, and torch is the same release as beam-rl's own venv, so uv's cache serves it here.
- vLLM is not installed: TRL's constructor asks only that it import, and `trl_loop.py` patches that one check.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from beam_rl.model.tiny import tiny_model_dir
from bench.peers.job import PeerJob, save_job
from bench.peers.shims.venvs import ensure_venv, is_built, venv_python

TRL_VERSION = "1.16.0"
PINS = (
    f"trl=={TRL_VERSION}",
    "torch==2.15.0",
    "transformers==5.25.0",
    "accelerate==1.16.0",
    "datasets==5.2.0",
    "aiohttp==3.14.5",  # the worker's HTTP client (TRL's `vllm` extra)
)
EXCLUDE_NEWER = "2026-12-07T00:00:00Z"  # the day the pins were resolved
LOOP = Path(__file__).with_name("trl_loop.py")
INSTALL_TIMEOUT_S = 1800  # a cold cache downloads torch and its CUDA libraries: about 3 GB
# `env` execs the loop in its place (one process): no hub (the tokenizer is the offline tiny one, from its
# directory), and no warning that trl.experimental is experimental. The worker's spawned child inherits both.
ENV = ("env", "HF_HUB_OFFLINE=1", "HF_DATASETS_OFFLINE=1", "TRL_EXPERIMENTAL_SILENCE=1")


class Trl:
    NAME = "trl"
    CANNOT: ClassVar[dict[str, str]] = {
        "multi_turn": "TRL's worker takes another turn only when the model's answer parses as a tool call; the "
        "simulated engine's tokens never do, so every rollout would end after one turn",
        "tokens_lost_on_server_kill": "no failover: the worker retries a failed request on its one server (30 "
        "tries, backing off to 16 s), so with that server killed it delivers nothing more and its child fails "
        "after about 8 minutes",
        "servers": "one server: the worker posts every request to its one vllm_server_base_url (TRL scales out "
        "with vLLM's data parallelism behind that URL), so it drives the fleet's first server and the rest idle",
        "affinity": "no group affinity: each rollout of a group is its own request, and the server (vLLM's "
        "data-parallel front end) places it",
        "partial rollouts": "none: a weight update pauses the server with mode=keep and resumes it (TRL's own sync), "
        "the worker holding its requests open; a rollout across an update is one sample stamped with the policy "
        "version its group started under",
    }

    def unavailable(self) -> str | None:
        if is_built("trl", list(PINS), EXCLUDE_NEWER):
            return None
        return f"TRL's venv {venv_python('trl').parent.parent} is not built: prepare() builds it from PyPI (--prepare)"

    def prepare(self) -> None:
        ensure_venv("trl", list(PINS), EXCLUDE_NEWER, INSTALL_TIMEOUT_S)

    def command(self, job: PeerJob) -> list[str]:
        why = self.unavailable()
        if why:
            raise RuntimeError(why)
        job_path = job.work_dir / "job.json"
        job.work_dir.mkdir(parents=True, exist_ok=True)
        save_job(job, job_path)
        python = str(venv_python("trl"))
        # The fleet serves the tiny model: its tokenizer is read from the directory beam-rl builds (no hub here).
        return [*ENV, python, str(LOOP), "--job", str(job_path), "--tokenizer", str(tiny_model_dir())]

    def version(self) -> str:
        return f"trl {TRL_VERSION}"
