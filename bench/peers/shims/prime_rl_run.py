"""prime-rl's orchestrator for the side-by-side harness, run in prime-rl's venv (bench/peers/prime_rl_peer.py):
its env server (`prime_rl.entrypoints.env_server`) and its orchestrator (`prime_rl.orchestrator.orchestrator`)
from a source checkout, and a fake trainer in their place on the trainer's side of the filesystem transports:
it takes each step's batch (`rollouts/step_N/rank_0.bin`), sleeps `--train-s`, and publishes the step's
weights (`broadcasts/step_N/STABLE`), which the orchestrator's watcher loads into the servers
(`/update_weights`). Every episode the orchestrator's dispatcher emits appends the harness's line to `--out`.

    python prime_rl_run.py --orchestrator ORCH.toml --env-server ENV.toml --out OUT --output-dir DIR
"""

from __future__ import annotations

import argparse
import ctypes
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


def die_with_parent() -> None:
    """The env server ends with this process, however it ends (the harness stops the process group, and the
    env server's own SIGTERM handler can outlive its parent)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def publish(output_dir: Path, step: int) -> None:
    weights = output_dir / "broadcasts" / f"step_{step}"
    weights.mkdir(parents=True, exist_ok=True)
    (weights / "STABLE").touch()


def fake_trainer(output_dir: Path, train_s: float, stop: threading.Event) -> None:
    publish(output_dir, 0)  # the trainer's start-up broadcast, which the orchestrator waits for before its first step
    step = 1  # the orchestrator's first batch is step 1's; training it publishes step 1's weights
    while not stop.is_set():
        batch = output_dir / "rollouts" / f"step_{step}" / "rank_0.bin"
        if not batch.exists():
            time.sleep(0.05)
            continue
        time.sleep(train_s)
        publish(output_dir, step)
        step += 1


def record_episodes(out_path: str) -> None:
    """Append the harness's line for each episode the dispatcher emits (`Dispatcher.emit_episode`)."""
    from prime_rl.orchestrator.dispatcher import Dispatcher

    from bench.peers.job import append_rollout

    out = open(out_path, "a")  # noqa: SIM115 (open for the run's life)
    emit = Dispatcher.emit_episode

    async def emit_and_record(self, meta, group, episode):  # type: ignore[no-untyped-def]
        await emit(self, meta, group, episode)
        for trace in episode.traces:
            usage = trace.usage
            finish = trace.calls[-1].finish_reason if trace.calls else None
            group_id = getattr(trace.task.data, "group_id", None) or str(meta.group_id)
            append_rollout(
                out, group_id, usage.completion_tokens if usage else 0, finish or str(trace.stop_condition), time.time()
            )

    Dispatcher.emit_episode = emit_and_record


def bridge_verifiers() -> None:
    """prime-rl at this commit reads `Branch.multi_modal_data` (verifiers' main branch, its submodule); verifiers
    0.4.0's branches have no such field: a text-only branch carries no images, which prime-rl reads as None."""
    from verifiers.v1.trace import Branch

    if not hasattr(Branch, "multi_modal_data"):
        Branch.multi_modal_data = property(lambda self: None)  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--orchestrator", required=True)
    parser.add_argument("--env-server", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--train-s", type=float, default=1.0)
    args = parser.parse_args()
    # The env server as prime-rl's launcher starts it: its own process, at the address the config derives.
    env_server = subprocess.Popen(
        [sys.executable, "-m", "prime_rl.entrypoints.env_server", "@", args.env_server], preexec_fn=die_with_parent
    )
    stop = threading.Event()
    threading.Thread(target=fake_trainer, args=(Path(args.output_dir), args.train_s, stop), daemon=True).start()
    bridge_verifiers()
    record_episodes(args.out)
    from prime_rl.orchestrator import orchestrator

    sys.argv = ["orchestrator", "@", args.orchestrator]
    try:
        orchestrator.main()
    finally:
        stop.set()
        env_server.terminate()
        env_server.wait(30)


if __name__ == "__main__":
    main()
