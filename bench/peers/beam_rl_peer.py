"""beam-rl as a peer of the side-by-side (bench/peers/job.py): the real rollout job (`beam_rl.job.rollouts`: the
dispatcher, scoring, the packer and the Arrow steps on Prism or embedded Flink) against the harness's servers.

- `command(job)` runs this module in a process of its own; that process tree (the job, Prism or Flink's JVM, the
  Beam workers) is the orchestrator the harness measures.
- A rollout is delivered when its step is committed to the run directory (what a trainer reads): a follower
  thread reads each committed step's observation window and appends its rollouts to `job.out_path`.
- Prompts: the harness's file is the dataset (`PromptsFile`); the multi-turn workload runs the project's own
  multi-turn game, `guess_number`, on the rows the harness rendered from it (`MULTI_TURN_ENV`).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

from beam_rl.config import RunConfig, config_from_dict
from bench.common.engines import SyntheticEnv
from bench.peers.job import SLOTS_PER_SERVER, PeerJob, append_rollout, job_file, load_job, read_prompts
from bench.peers.workloads import MULTI_TURN_MAX_TURNS, STEP_GROUPS, multi_turn_epochs

MULTI_TURN_ENV = "guess_number"  # every turn answered by the environment ("higher", "lower", "reply with a number")
POLL_S = 0.1


class PromptsFile(SyntheticEnv):
    """The harness's prompts file as a dataset: row i is line i (its `prompt_ids`), the reward a cheap function
    of the completion (the benchmark measures orchestration, not scoring)."""

    name = "peers_prompts"

    def __init__(self, tokenizer: Any, max_turns: int = 1, *, path: str) -> None:
        super().__init__(tokenizer, max_turns)
        self.path = path

    def load_rows(self, split: str = "train") -> list[dict[str, Any]]:
        return [{"prompt_ids": group["prompt_ids"]} for group in read_prompts(Path(self.path))]


def job_config(job: PeerJob, runner: str, env_mode: str = "group") -> RunConfig:
    """The run: every prompt of the file once (multi-turn: `guess_number`'s first rows, epoch after epoch, as
    the harness wrote them: exactly the job's groups), as many steps as the groups fill, permits for every slot
    of the fleet."""
    if job.groups % STEP_GROUPS:
        raise ValueError(f"{job.name}: groups = {job.groups} is not a multiple of {STEP_GROUPS} (a step's groups)")
    if job.name == "multi_turn":
        epochs, per_epoch = multi_turn_epochs(job.groups)
        env = {"name": MULTI_TURN_ENV, "max_turns": MULTI_TURN_MAX_TURNS, "epochs": epochs, "limit": per_epoch}
        env_mode = "rollout"  # a conversation is its own request turn after turn: no group call
    else:
        env = {"name": "prompts", "kind": f"{__name__}:PromptsFile", "args": {"path": str(job.prompts_path)}}
    return config_from_dict({
        "run": {"dir": str(job.work_dir / "run"), "max_steps": job.groups // STEP_GROUPS, "seed": job.seed},
        "envs": [env | {"group_size": job.group_size, "mode": env_mode}],
        "model": {"max_context": 2048},
        "batch": {"rollouts_per_step": STEP_GROUPS * job.group_size, "seq_len": 2048},
        "inference": {"urls": job.urls, "max_tokens": job.max_tokens, "temperature": 1.0,
                      "max_inflight": len(job.urls) * SLOTS_PER_SERVER, "request_timeout_s": 600.0},
        # The simulated engine's completions are random ids: a group of equal rewards must still be delivered.
        "filters": {"zero_advantage": {"mode": "monitor"}},
        "runner": {"name": runner},
    })


def _prompt_line(group_id: str, per_epoch: int | None) -> int:
    """The prompts file's line of beam-rl's group `<env>/e<epoch>-i<row>`."""
    epoch, row = group_id.rpartition("/")[2].removeprefix("e").split("-i")
    return int(row) + (int(epoch) * per_epoch if per_epoch else 0)


class Follower(threading.Thread):
    """Appends each committed step's rollouts to the contract's JSONL as soon as the step is committed."""

    def __init__(self, run_dir: Path, out_path: Path, group_ids: list[str], per_epoch: int | None) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.out_path, self.group_ids, self.per_epoch = run_dir, out_path, group_ids, per_epoch
        self.stop = threading.Event()
        self.error: BaseException | None = None  # what stopped it: the job's process exits with it

    def run(self) -> None:
        try:
            self._follow()
        except BaseException as err:  # noqa: BLE001 (a dead follower must fail the run, not shrink it)
            self.error = err

    def _follow(self) -> None:
        from beam_rl.rundir import RunDir

        directory, following = RunDir(str(self.run_dir)), None
        with open(self.out_path, "a") as out:
            while True:
                stopping = self.stop.is_set()  # one more look after the job ended: its last step
                # Steps commit in order: once the first is seen, a look is one stat of the next step's
                # commit file, as a trainer's reader waits (the follower runs in the measured process).
                if following is None:
                    following = next(iter(directory.committed_steps()), None)
                while following is not None and directory.is_committed(following):
                    self._deliver(out, directory.read_window(following).to_pylist())
                    following += 1
                if stopping:
                    return
                self.stop.wait(POLL_S)

    def _deliver(self, out: Any, window: list[dict[str, Any]]) -> None:
        now = time.time()
        for r in window:
            reason = "length" if r["truncated"] else "stop" if r["status"] == "ok" else r["status"]
            line = _prompt_line(r["group_id"], self.per_epoch)
            # The file holds every group the run draws; one past it (a dataset that offers more than the job
            # asks for) is delivered under beam-rl's own id.
            group_id = self.group_ids[line] if line < len(self.group_ids) else f"beam-rl:{r['group_id']}"
            append_rollout(out, group_id, r["completion_tokens"], reason, now)


class BeamRl:
    """beam-rl on Prism (the runner `direct`), its defaults: a group per request (`envs.mode = "group"`)."""

    NAME = "beam-rl (prism)"
    RUNNER = "direct"
    ENV_MODE = "group"
    CANNOT: ClassVar[dict[str, str]] = {}

    def unavailable(self) -> str | None:
        return None

    def prepare(self) -> None:
        """Nothing to install: beam-rl runs from this checkout's environment."""

    def command(self, job: PeerJob) -> list[str]:
        return [sys.executable, "-m", __name__, "--runner", self.RUNNER, "--env-mode", self.ENV_MODE,
                "--job", str(job_file(job))]

    def version(self) -> str:
        import subprocess

        root = Path(__file__).resolve().parents[2]
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        return f"beam-rl {commit or 'unknown'} ({self.RUNNER})"


class BeamRlFlinkLocal(BeamRl):
    """beam-rl on embedded Flink (the runner `flink-local`: a JVM of its own and its Beam workers)."""

    NAME = "beam-rl (flink-local)"
    RUNNER = "flink-local"

    def unavailable(self) -> str | None:
        import shutil

        return None if shutil.which("java") else "no `java` on PATH (flink-local runs Flink's job server in a JVM)"


class BeamRlRolloutMode(BeamRl):
    """beam-rl on Prism with a request per rollout (`envs.mode = "rollout"`): a slot is free as soon as its own
    rollout ends, not when its group's longest one does."""

    NAME = "beam-rl (prism, rollout mode)"
    ENV_MODE = "rollout"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", type=Path, required=True, help="the PeerJob as JSON (BeamRl.command writes it)")
    parser.add_argument("--runner", default="direct", choices=("direct", "flink-local"))
    parser.add_argument("--env-mode", default="group", choices=("group", "rollout"))
    args = parser.parse_args(argv)
    job = load_job(args.job)
    config = job_config(job, args.runner, args.env_mode)
    group_ids = [g["group_id"] for g in read_prompts(job.prompts_path)]
    follower = Follower(job.work_dir / "run", job.out_path, group_ids,
                        multi_turn_epochs(job.groups)[1] if job.name == "multi_turn" else None)
    follower.start()
    from beam_rl.job.rollouts import run_rollouts  # Beam: only in the process that runs the job

    try:
        run_rollouts(config, job.urls, with_trainer=False)
    finally:
        follower.stop.set()
        follower.join()
    if follower.error is not None:
        raise RuntimeError(f"following the run directory failed: {follower.error!r}") from follower.error


if __name__ == "__main__":
    main()
