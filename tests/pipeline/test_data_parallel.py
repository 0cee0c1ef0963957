"""The data-parallel trainer (beam_rl/trainer/data_parallel.py): two gloo ranks, each reading only its own
rank file, train a committed step to the weights the reference trainer (one process standing in for both
ranks) trains it to."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from safetensors.numpy import load_file

from beam_rl.config import TrainerSection, config_from_dict
from beam_rl.processes import free_port
from beam_rl.rundir import RunDir
from beam_rl.standin.server import EmbeddedServer
from beam_rl.model.tiny import tiny_model_dir
from beam_rl.trainer import data_parallel
from beam_rl.trainer.reference import ReferenceTrainer
from beam_rl.job.rollouts import run_rollouts

pytestmark = pytest.mark.timeout(600)

RANKS = 2


@pytest.fixture(scope="module")
def committed_step(tmp_path_factory) -> Path:
    """A run directory with one step packed for two ranks: the tiny model's rollouts on reverse_text."""
    run = tmp_path_factory.mktemp("dp") / "run"
    config = config_from_dict({
        "run": {"dir": str(run), "max_steps": 1},
        "envs": [{"name": "reverse_text", "group_size": 4, "limit": 32}],
        "model": {"max_context": 256},
        "batch": {"rollouts_per_step": 32, "trainer_ranks": RANKS, "seq_len": 256},
        "inference": {"max_tokens": 16, "max_inflight": 32},
        "runner": {"name": "direct"},
    })
    with EmbeddedServer(model_dir=tiny_model_dir(), served_model_name="tiny", max_num_seqs=32) as server:
        run_rollouts(config, [server.url], with_trainer=False)
    record = RunDir(run).read_commit(1)
    assert record.counts.ranks == RANKS and all(record.counts.micro_batches) and record.counts.trained_tokens
    return run


def _copy(run: Path, to: Path) -> RunDir:
    shutil.copytree(run, to)
    return RunDir(to)


def _audited_rank(rank: int, world_size: int, port: int, args: tuple, log_dir: str, dies: int | None) -> None:
    """A rank that records every committed file it maps, then trains as `beam-rl train --nproc` does;
    rank `dies` is killed (SIGKILL) once it has mapped its file."""
    original = RunDir.map_committed_file

    def logged(self, record, name, **kwargs):
        with open(Path(log_dir) / f"rank_{rank}.log", "a") as log:
            log.write(name + "\n")
        if rank == dies:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, record, name, **kwargs)

    RunDir.map_committed_file = logged
    data_parallel._spawned_rank(rank, world_size, port, args)
    # What still runs once the rank is done: the interpreter exits with it.
    threads = [Path(task, "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
    (Path(log_dir) / f"threads_{rank}.txt").write_text("\n".join(threads))


def _launch(run_dir: RunDir, nproc: int, log_dir: Path, dies: int | None = None) -> None:
    log_dir.mkdir(exist_ok=True)
    args = (str(run_dir.path), str(tiny_model_dir()), TrainerSection(), 1, 0)
    mp.start_processes(_audited_rank, args=(nproc, free_port(), args, str(log_dir), dies), nprocs=nproc,
                       start_method="spawn")


@pytest.fixture(scope="module")
def trained_on_two_ranks(committed_step, tmp_path_factory) -> tuple[RunDir, Path]:
    """The committed step trained by two ranks as `beam-rl train --nproc 2` does: the run and the ranks' logs."""
    where = tmp_path_factory.mktemp("parallel")
    parallel = _copy(committed_step, where / "run")
    _launch(parallel, RANKS, where / "logs")
    return parallel, where / "logs"


def test_two_gloo_ranks_train_a_step_to_the_reference_trainers_weights_each_reading_only_its_file(
        committed_step, trained_on_two_ranks, tmp_path):
    reference = _copy(committed_step, tmp_path / "reference")
    ReferenceTrainer(reference, tiny_model_dir(), TrainerSection()).train(1)
    parallel, logs = trained_on_two_ranks

    for rank in range(RANKS):
        read = set((logs / f"rank_{rank}.log").read_text().split())
        assert read == {f"rank_{rank}.arrow"}, (rank, read)  # its own file, never the other's
    initial = load_file(str(tiny_model_dir() / "model.safetensors"))
    expected = load_file(str(reference.weights_path(1) / "model.safetensors"))
    trained = load_file(str(parallel.weights_path(1) / "model.safetensors"))
    assert set(trained) == set(expected)
    moved = max(float(abs(expected[k] - initial[k]).max()) for k in expected)
    apart = max(float(abs(trained[k] - expected[k]).max()) for k in expected)
    print(f"largest weight change {moved:.3g}; largest difference, 2 ranks against the reference {apart:.3g}")
    # AdamW's first step moves weights by about lr (1e-3); summing on two ranks reorders float additions.
    assert moved > 5e-4 and apart < 1e-5
    # Rank 0 records the step as the reference trainer does: the same loss, tokens and samples.
    metrics = [json.loads(line)["trainer"] for run in (reference, parallel)
               for line in run.metrics_path.read_text().splitlines() if '"trainer"' in line]
    assert len(metrics) == 2
    ours, theirs = metrics[1], metrics[0]
    assert (ours["processes"], theirs["processes"]) == (RANKS, 1)
    for key in ("trainable_tokens", "tokens", "samples", "micro_batches", "ranks", "reward_mean"):
        assert ours[key] == pytest.approx(theirs[key]), key
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5, abs=1e-7)


def test_a_rank_has_released_its_process_group_when_it_returns(trained_on_two_ranks):
    """Gloo's threads left running into interpreter exit abort a rank now and then (SIGABRT, 'terminate called
    without an active exception'); a group something still holds keeps them running after
    destroy_process_group."""
    _, logs = trained_on_two_ranks
    for rank in range(RANKS):
        threads = (logs / f"threads_{rank}.txt").read_text().split()
        assert not [t for t in threads if "gloo" in t or "tcpstore" in t], (rank, threads)


def test_ranks_that_do_not_match_the_steps_rank_files_stop_with_the_key_named(committed_step, tmp_path):
    run = _copy(committed_step, tmp_path / "run")
    with pytest.raises(Exception, match=r"step 1 was packed for 2 ranks \(batch.trainer_ranks\), the trainer "
                                        r"runs 3 \(--nproc\)"):
        _launch(run, 3, tmp_path / "logs")
    assert run.latest_stable_weights() is None  # nothing published


def test_a_rank_killed_mid_step_stops_the_others_and_nothing_is_published(committed_step, tmp_path):
    run = _copy(committed_step, tmp_path / "run")
    started = time.monotonic()
    with pytest.raises(mp.ProcessExitedException, match="process 1 terminated with signal SIGKILL"):
        _launch(run, RANKS, tmp_path / "logs", dies=1)
    print(f"the launcher stopped rank 0 {time.monotonic() - started:.1f} s after the ranks started")
    assert run.latest_stable_weights() is None  # the run resumes from the weights published before


def test_trainer_ranks_that_do_not_match_the_packers_are_refused_at_load():
    with pytest.raises(ValueError, match=r"trainer.nproc.*2 ranks, but batch.trainer_ranks = 1 rank files a step"):
        config_from_dict({"envs": [{"name": "reverse_text"}], "trainer": {"nproc": 2}})
    config_from_dict({"envs": [{"name": "reverse_text"}], "trainer": {"nproc": 2}, "batch": {"trainer_ranks": 2}})
