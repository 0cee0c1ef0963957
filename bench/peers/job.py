"""The contract between the peers harness and each peer adapter (bench/peers/README.md).

- The harness writes the prompts file, starts the fleet, launches `Peer.command(job)` as one process group,
  follows `job.out_path` and measures every column from outside; an adapter only launches the peer's real loop.
- A peer APPENDS one JSONL line per finished rollout to `out_path`, flushed per line:
  `{"group_id": str, "completion_tokens": int, "finish_reason": str, "t": time.time()}`.
- Prompts are JSONL, one group per line: `{"group_id": str, "prompt_ids": [int], "prompt": str}`.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Protocol

# Each simulated server's max_num_seqs: a peer whose concurrency is configurable keeps len(urls) * this in flight.
SLOTS_PER_SERVER = 16


@dataclass(frozen=True)
class PeerJob:
    name: str  # the workload: "short", "long_tail", "multi_turn"
    urls: list[str]  # the simulated servers (OpenAI/vLLM API; /v1/completions, /v1/chat/completions)
    model: str  # served model name ("tiny")
    prompts_path: Path  # JSONL, one group per line: {"group_id": str, "prompt_ids": [int], "prompt": str}
    group_size: int  # rollouts per prompt
    max_tokens: int
    groups: int  # how many groups to finish (the peer stops after; the harness may also stop it)
    out_path: Path  # the peer APPENDS one JSONL line per finished rollout (flushed per line)
    work_dir: Path  # the peer's scratch (its run dir, logs)
    seed: int


class Peer(Protocol):
    NAME: str  # "beam-rl (prism)", "trl", "verifiers (stock)", ...
    CANNOT: dict[str, str]  # column -> why this system cannot do it

    def unavailable(self) -> str | None:
        """None if runnable here; else the exact reason (one line)."""
        ...

    def prepare(self) -> None:
        """Install its own venv under ~/.cache/beam-rl/peers/<name>/ (idempotent, locked, pinned)."""
        ...

    def command(self, job: PeerJob) -> list[str]:
        """The argv of ONE process; its process tree is the orchestrator the harness measures."""
        ...

    def version(self) -> str:
        """ "trl 1.16.0", "prime-rl <commit>"."""
        ...


def save_job(job: PeerJob, path: Path) -> None:
    """The job as JSON, for an adapter whose loop runs in a process (or a venv) of its own: `load_job` reads it."""
    path.write_text(json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in asdict(job).items()}))


def job_file(job: PeerJob) -> Path:
    """`work_dir/job.json`, written (the work dir made): the argument of a loop that runs as a process of its own."""
    job.work_dir.mkdir(parents=True, exist_ok=True)
    path = job.work_dir / "job.json"
    save_job(job, path)
    return path


def load_job(path: Path) -> PeerJob:
    raw: dict[str, Any] = json.loads(path.read_text())
    paths = {f.name for f in fields(PeerJob) if f.type in (Path, "Path")}
    values: dict[str, Any] = {k: Path(v) if k in paths else v for k, v in raw.items()}
    return PeerJob(**values)


def write_prompts(path: Path, groups: Iterable[dict[str, Any]]) -> None:
    """Write the prompts file: one group per line, {"group_id", "prompt_ids", "prompt"}."""
    with open(path, "w") as f:
        for group in groups:
            f.write(json.dumps({k: group[k] for k in ("group_id", "prompt_ids", "prompt")}) + "\n")


def read_prompts(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def append_rollout(f: Any, group_id: str, completion_tokens: int, finish_reason: str, t: float) -> None:
    """One finished rollout as the contract's JSONL line, flushed so the harness sees it live."""
    f.write(
        json.dumps(
            {"group_id": group_id, "completion_tokens": completion_tokens, "finish_reason": finish_reason, "t": t}
        )
        + "\n"
    )
    f.flush()


def read_rollouts(out_path: Path) -> list[dict[str, Any]]:
    """The finished rollouts so far; a last line still being written is skipped (the peer appends live)."""
    rows = []
    try:
        with open(out_path) as f:
            for line in f:
                if not line.endswith("\n"):
                    break
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        return []
    return rows


# module (under bench.peers) -> the names of the Peer classes it defines; imported lazily so that a peer whose
# adapter has not landed, or whose import fails, is skipped rather than breaking the harness.
PEER_MODULES = ("beam_rl_peer", "plain_loop_peer", "trl_peer", "verifiers_peer", "prime_rl_peer", "skyrl_peer")


def registry() -> dict[str, list[type]]:
    """Module name -> the Peer classes it defines (classes with NAME, CANNOT and command); missing modules skipped."""
    found: dict[str, list[type]] = {}
    for module_name in PEER_MODULES:
        try:
            module = importlib.import_module(f"bench.peers.{module_name}")
        except ModuleNotFoundError as e:
            if e.name == f"bench.peers.{module_name}":
                continue
            raise
        classes = [
            value
            for value in vars(module).values()
            if isinstance(value, type)
            and value.__module__ == module.__name__
            and hasattr(value, "NAME")
            and hasattr(value, "CANNOT")
            and callable(getattr(value, "command", None))
        ]
        found[module_name] = classes
    return found
