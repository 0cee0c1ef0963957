"""`beam-rl replay`: every step of real runs (the rollout pipeline alone on Prism, and the whole loop with the
reference trainer, where policy versions move and the staleness filter acts) replays bit for bit from its
windows; a changed advantage parameter and a corrupted rank file are named at their first difference."""

from __future__ import annotations

import io
import json
import re
import shutil

import numpy as np
import pyarrow as pa
import pytest
from rich.console import Console

from beam_rl import wiring
from beam_rl.config import config_from_dict, load_config
from beam_rl.observe.replay import ReplayError, _fresh_start, first_table_difference, replay_steps
from beam_rl.rundir import RunDir
from beam_rl.scoring.group import score_group
from beam_rl.source import admission
from beam_rl.standin.server import EmbeddedServer, FaultConfig
from beam_rl.model.tiny import tiny_model_dir
from beam_rl.types import Rollout, TrainBatch, Turn
from beam_rl.job.run import run_job
from beam_rl.job.rollouts import run_rollouts
from schemas.commit_record import FileEntry, checksum
from schemas.train_batch import in_version
from tests.support.cli import RED, coloured, run_cli
from tests.support.paths import REPO

GREEN = "\x1b[32m"
_STYLE = re.compile(r"\x1b\[[0-9;]*m")

# The main job's environment with its defaults: a partial credit of 0.1, which float32 cannot hold.
ENV = {"name": "arithmetic_easy", "group_size": 8}


def _rollouts_config(run_dir):
    return config_from_dict({
        "run": {"dir": str(run_dir), "max_steps": 10},
        "envs": [{**ENV, "limit": 16}],
        "batch": {"rollouts_per_step": 32},
        "inference": {"max_tokens": 8, "max_inflight": 32},
    })


@pytest.fixture(scope="module")
def rollouts_run(tmp_path_factory):
    """`beam-rl rollouts`: no trainer, no staleness check, no config.json; 16 prompts of 8 in steps of 32
    trainable rollouts (groups of equal rewards are not: they are dropped as zero-advantage)."""
    servers = [EmbeddedServer(model_dir=tiny_model_dir(), served_model_name="tiny", max_num_seqs=32,
                              faults=FaultConfig(latency_s=0.05)) for _ in range(2)]
    urls = [s.start() for s in servers]
    try:
        run_dir = tmp_path_factory.mktemp("rollouts-run")
        config = _rollouts_config(run_dir)
        run_rollouts(config, urls, with_trainer=False)
    finally:
        for s in servers:
            s.stop()
    return config, RunDir(run_dir)


@pytest.fixture(scope="module")
def job_run(tmp_path_factory):
    """`beam-rl run` with the reference trainer: a bound of one step off-policy drops rollouts as stale.
    Admission is blind to the bound here (as it is in effect when rollouts take longer than steps), so
    that the stale filter has rollouts to drop and the replay has its cuts to match."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(admission, "staleness_at_training", lambda *_: 0)
        return _job_run(tmp_path_factory)


def _job_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("job-run")
    config = config_from_dict({
        "run": {"dir": str(run_dir), "max_steps": 6},
        "envs": [{**ENV, "epochs": 100}],
        "batch": {"rollouts_per_step": 32},
        "inference": {"max_tokens": 8, "max_inflight": 64},
        "off_policy": {"max_async_level": 1, "max_off_policy_steps": 1},
    })
    return config, run_job(config, Console(file=io.StringIO()))


def _copy(run: RunDir, tmp_path) -> RunDir:
    return RunDir(shutil.copytree(run.path, tmp_path / "copy"))


def test_every_step_of_a_rollouts_run_replays_bit_for_bit(rollouts_run):
    config, run = rollouts_run
    steps = run.committed_steps()
    assert len(steps) >= 2 and not run.config_path.exists()
    assert run.input_exhausted_path.is_file()  # the last step is the packer's final, partial batch
    results = list(replay_steps(run, steps, wiring.replay_parts(run, config)))  # no config.json: staleness off, as the run
    assert [r.step for r in results] == steps
    for result in results:
        assert result.identical, [str(d) for d in result.differences]
        assert result.identical_files == ["rank_0.arrow"]
    # Something was trained with advantages of both signs: the replay had real work to match.
    advantages = pa.ipc.open_file(pa.memory_map(str(run.rank_path(1, 0)))).read_all().column("advantages")
    values = pa.concat_arrays([c.values for c in advantages.chunks]).to_numpy()
    assert (values > 0).any() and (values < 0).any()


def test_every_step_of_a_run_with_a_trainer_replays_bit_for_bit(job_run, monkeypatch):
    config, run = job_run
    windows = [run.read_window(step) for step in run.committed_steps()]
    versions = np.concatenate([w.column("policy_version_start").to_numpy() for w in windows])
    flags = [f for w in windows for f in w.column("filtered").to_pylist()]
    assert versions.max() >= 2 and "stale" in flags  # versions moved and the staleness filter acted
    status, lines = run_cli(monkeypatch, "replay", str(run.path), "--all")
    assert status == 0, lines
    assert coloured(lines, RED) == []
    assert [line.split(":")[0] for line in coloured(lines, GREEN)] == [f"step {s}" for s in run.committed_steps()]
    assert _STYLE.sub("", lines[-1]) == f"{len(windows)} of {len(windows)} steps identical"


def test_every_step_of_the_main_job_replays_bit_for_bit(tmp_path, monkeypatch):
    """`scripts/run-main.sh`'s run: configs/tiny.toml as it ships, only its run directory moved."""
    config = load_config(REPO / "configs" / "tiny.toml")
    config = config.model_copy(update={"run": config.run.model_copy(update={"dir": tmp_path / "tiny"})})
    run = run_job(config, Console(file=io.StringIO()))
    steps = run.committed_steps()
    assert steps == list(range(1, config.run.max_steps + 1))
    rewards = np.concatenate([run.read_window(s).column("reward").to_numpy() for s in steps])
    assert (rewards == 0.1).any()  # the default partial credit, which float32 cannot hold
    status, lines = run_cli(monkeypatch, "replay", str(run.path), "--all")
    assert status == 0 and coloured(lines, RED) == [], lines
    assert _STYLE.sub("", lines[-1]) == f"{len(steps)} of {len(steps)} steps identical"


def test_replaying_without_the_staleness_check_the_run_had_is_named_at_the_first_cut(job_run, monkeypatch):
    _, run = job_run
    stale_step = next(s for s in run.committed_steps() if run.read_commit(s).window.filtered.get("stale"))
    status, lines = run_cli(monkeypatch, "replay", str(run.path), "--step", str(stale_step), "--staleness", "off")
    assert status == 1
    [line] = coloured(lines, RED)
    # Unchecked, stale rollouts fill a batch the run rejected: some step is cut differently (earlier).
    assert line.startswith(f"step {stale_step}: rollouts/step_{stale_step}/COMMIT.json") and "column cut" in line


def test_a_changed_grpo_epsilon_is_named_at_its_first_difference(job_run, tmp_path, monkeypatch):
    _, run = job_run
    copy = _copy(run, tmp_path)
    config = json.loads(copy.config_path.read_text())
    assert config["envs"][0]["algorithm"] == "grpo"
    config["envs"][0]["algorithm_args"] = {"eps": 0.5}
    copy.config_path.write_text(json.dumps(config))
    status, lines = run_cli(monkeypatch, "replay", str(copy.path), "--step", "1")
    assert status == 1
    [line] = coloured(lines, RED)
    match = re.fullmatch(r"step 1: rollouts/step_1/rank_0\.arrow row (\d+) column advantages \(rollout (\S+), "
                         r"token (\d+)\): committed (\S+) \(0x\w+\), replay (\S+) \(0x\w+\)", line)
    assert match, line
    row, rollout, token, committed, replayed = match.groups()
    table = pa.ipc.open_file(pa.memory_map(str(run.rank_path(1, 0)))).read_all()
    assert table.column("rollout_id")[int(row)].as_py() == rollout
    assert np.float32(committed) == np.float32(table.column("advantages")[int(row)].as_py()[int(token)])
    # The first token the loss trains on: the context before it carries advantage 0 under any eps.
    assert int(token) == np.flatnonzero(table.column("loss_mask")[int(row)].as_py())[0]
    assert abs(float(replayed)) < abs(float(committed))  # eps 0.5 shrinks every GRPO advantage


def test_another_algorithm_differs_in_the_advantages_of_the_first_step(rollouts_run):
    config, run = rollouts_run
    rloo = config.model_copy(update={"envs": [config.envs[0].model_copy(update={"algorithm": "rloo"})]})
    [result] = replay_steps(run, [1], wiring.replay_parts(run, rloo))
    first = result.differences[0]
    assert (first.file, first.column) == ("rollouts/step_1/rank_0.arrow", "advantages")
    assert first.committed != first.replayed


def test_a_corrupted_value_in_a_rank_file_is_named(rollouts_run, tmp_path, monkeypatch):
    config, run = rollouts_run
    copy = _copy(run, tmp_path)
    path = copy.rank_path(2, 0)
    # Where row 3's first trained advantage lies in the file: its address in the mapped values buffer.
    with pa.memory_map(str(path)) as mapped:
        base = mapped.read_buffer()
        reader = pa.ipc.open_file(base)
        micro_batch = reader.get_batch(0)  # one record batch per micro-batch; row 3 is in the first
        assert micro_batch.num_rows > 3
        column = micro_batch.column("advantages")
        token = int(np.flatnonzero(micro_batch.column("loss_mask")[3].as_py())[0])
        index = column.offsets[3].as_py() + token
        offset = column.values.buffers()[1].address - base.address + 4 * (column.values.offset + index)
        original = column.values[index].as_py()
    data = bytearray(path.read_bytes())
    assert np.frombuffer(data[offset:offset + 4], np.float32)[0] == np.float32(original)
    data[offset:offset + 4] = np.float32(12.5).tobytes()
    path.write_bytes(bytes(data))  # same size: only the checksum tells it from the committed file

    [result] = replay_steps(copy, [2], wiring.replay_parts(copy, config))
    first = result.differences[0]
    assert (first.file, first.row, first.column) == ("rollouts/step_2/rank_0.arrow", 3, "advantages")
    assert f"token {token}" in first.where
    assert (first.committed, first.replayed) == (np.float32(12.5), np.float32(original))
    assert result.notes == ["rollouts/step_2/rank_0.arrow does not match its commit record's checksum"]
    # The same from the command line, with the config the run did not write and its staleness check (off).
    copy.write_config(config.model_dump(mode="json"))
    status, lines = run_cli(monkeypatch, "replay", str(copy.path), "--step", "2", "--staleness", "off")
    assert status == 1
    [line] = coloured(lines, RED)
    assert line.startswith("step 2: rollouts/step_2/rank_0.arrow row 3 column advantages (rollout ")
    assert line.endswith(f"token {token}): committed 12.5 (0x41480000), replay {str(first.replayed)} "
                         f"(0x{first.replayed.view(np.uint32):08x})")


def test_a_rank_file_table_difference_names_row_column_and_values():
    schema = pa.schema([("rollout_id", pa.string()), ("reward", pa.float32()), ("input_ids", pa.list_(pa.int32()))])
    a = pa.table([["r/0", "r/1"], [0.5, 1.0], [[1, 2], [3, 4, 5]]], schema=schema)
    b = pa.table([["r/0", "r/1"], [0.5, 1.0], [[1, 2], [3, 9, 5]]], schema=schema)
    found = first_table_difference(a, b, "rank_0.arrow")
    assert str(found) == "rank_0.arrow row 1 column input_ids (rollout r/1, token 1): committed 4, replay 9"
    c = pa.table([["r/0", "r/1"], [0.5, -0.0], [[1, 2], [3, 4, 5]]], schema=schema)
    assert first_table_difference(a, c, "f").column == "reward"  # floats compare bit for bit: -0.0 is not 0.0
    assert first_table_difference(a, a, "f") is None
    nan = pa.table([["r/0"], [float("nan")], [[1]]], schema=schema)
    assert first_table_difference(nan, nan, "f") is None  # a NaN equals itself bit for bit


def test_a_bad_step_or_a_run_without_a_config_is_one_red_line(rollouts_run, job_run, monkeypatch):
    _, run = job_run
    status, lines = run_cli(monkeypatch, "replay", str(run.path), "--step", "99")
    assert status == 2 and coloured(lines, RED) == [f"{run.path}: step 99 is not committed (committed steps: 1..6)"]
    _, bare = rollouts_run
    with pytest.raises(ReplayError, match="no config.json"):
        list(replay_steps(bare, [1], wiring.replay_parts(bare)))
    status, lines = run_cli(monkeypatch, "replay", str(bare.path), "--step", "1")
    assert status == 2 and "give the run's config (--config)" in coloured(lines, RED)[0]


def _sink_step(run_dir, *groups: list[float], algorithm: str = "grpo", ranks: int = 1) -> RunDir:
    """One step as the pipeline makes it: groups of 8 scored and packed by the sink from the rollouts'
    float64 rewards, then written by the run directory (which keeps rewards as float32 in window.arrow)."""
    config = config_from_dict({"run": {"dir": str(run_dir)}, "envs": [{**ENV, "algorithm": algorithm}],
                               "batch": {"rollouts_per_step": 8 * len(groups), "trainer_ranks": ranks}})
    run = RunDir(run_dir)
    run.write_config(config.model_dump(mode="json"))
    builder, batches = wiring.batch_builder(config, 1), []
    for g, rewards in enumerate(groups):
        rollouts = [Rollout(f"arithmetic_easy/e0-i{g}", "arithmetic_easy", i, 8, prompt_ids=[1, 5, 6][:1 + i % 3],
                            reward=reward, turns=[Turn([7, 8, 2], [-0.5, -0.25, -1.0], "stop", policy_versions=[0] * 3)])
                    for i, reward in enumerate(rewards)]
        scored = score_group(rollouts, wiring.algorithms(config)[ENV["name"]],
                             wiring.pre_batch_filters(config), config.inference.temperature, min_scored=2)
        batches += builder.add(scored)
    [batch] = batches
    run.write_step(batch)
    return run


def test_batch_whitening_and_packing_over_ranks_replay_bit_for_bit(tmp_path):
    """REINFORCE++ whitens advantages over the batch's trained tokens; samples of three lengths are packed
    over two ranks."""
    run = _sink_step(tmp_path / "run", [1.0, 0.5, 0, 0, 0, 0, 0, 0], [0, 0.25, 0.75, 1, 0, 0, 0.5, 0],
                     algorithm="reinforce_plus_plus_baseline", ranks=2)
    [result] = replay_steps(run, [1], wiring.replay_parts(run))
    assert result.identical, [str(d) for d in result.differences]
    assert result.identical_files == ["rank_0.arrow", "rank_1.arrow"]
    assert run.read_commit(1).counts.micro_batches == [1, 1]  # both ranks hold samples
    # Dr.GRPO is REINFORCE++-baseline's group step without the whitening: replayed with it, advantages differ.
    [result] = replay_steps(run, [1], wiring.replay_parts(run, config_from_dict({**run.read_config(), "envs": [{**ENV, "algorithm": "dr_grpo"}]})))
    assert result.differences[0].column == "advantages"


def test_replay_of_a_step_starts_where_no_group_can_have_waited_past_a_cut(tmp_path):
    """Every clean rollout of each earlier window trained: the packer was empty; otherwise replay starts
    at the first step whose window kept some clean rollout untrained."""
    run = RunDir(tmp_path)
    stats = {1: {"status": {"ok": 16}, "filtered": {"zero_advantage": 8}, "trained_rollouts": 8},
             2: {"status": {"ok": 16, "error": 3}, "filtered": {}, "trained_rollouts": 8},  # 8 clean waited?
             3: {"status": {"ok": 8}, "filtered": {}, "trained_rollouts": 16}}
    for step, window in stats.items():
        run.write_step(TrainBatch(step=step, micro_batches=[[]], group_ids=[], window=window))
    assert _fresh_start(run, 2) == 2
    assert _fresh_start(run, 3) == _fresh_start(run, 4) == 2


def test_rewards_float32_cannot_hold_replay_bit_for_bit(tmp_path):
    """window.arrow and the rank files record the float64 rewards the sink scored: a reward of 0.1 is
    0.1 there, and every advantage computed from it replays bit for bit."""
    run = _sink_step(tmp_path / "run", [1.0, 0.1, 0.3, 0, 0, 0, 0, 0], [0.7, 0.1, 0.2, 0, 0, 0, 0, 0])
    assert run.read_window(1).column("reward").to_pylist()[:3] == [1.0, 0.1, 0.3]
    [result] = replay_steps(run, [1], wiring.replay_parts(run))
    assert result.identical and not result.notes, [str(d) for d in result.differences]


def test_a_schema_version_2_step_replays_with_its_float32_rewards_named_as_the_limit(tmp_path):
    """A step written by schema version 2 holds a reward of 0.1 as 0.10000000149011612: replayed in that
    version's layout, the GRPO advantage of the group below comes out one float32 step away from the
    run's, and the replay says why."""
    run = _sink_step(tmp_path / "rounded", [1.0, 0.1, 0, 0, 0, 0, 0, 0])
    _as_schema_version_2(run)
    assert run.read_window(1).column("reward").type == pa.float32()
    [result] = replay_steps(run, [1], wiring.replay_parts(run))
    first = result.differences[0]
    assert (first.file, first.column) == ("rollouts/step_1/rank_0.arrow", "advantages")
    assert first.where.startswith("rollout arithmetic_easy/e0-i0/1,")  # the one rewarded 0.1
    assert abs(int(first.committed.view(np.uint32)) - int(first.replayed.view(np.uint32))) == 1  # one ulp
    assert result.notes == ["rewards are recorded as float32 (e.g. 0.1 is stored as 0.10000000149011612) and "
                            "the run scored their float64 values: advantages and reward means replayed from "
                            "them can differ in the last bit"]
    exact = _sink_step(tmp_path / "exact", [1.0, 0.5, 0, 0, 0, 0, 0, 0])  # rewards float32 holds: identical
    _as_schema_version_2(exact)
    [result] = replay_steps(exact, [1], wiring.replay_parts(exact))
    assert result.identical, [str(d) for d in result.differences]


def _as_schema_version_2(run: RunDir) -> None:
    """Step 1's files and commit record as the writer of schema version 2 made them (float32 rewards)."""
    for path in (run.rank_path(1, 0), run.window_path(1)):
        table = pa.ipc.open_file(pa.py_buffer(path.read_bytes())).read_all()  # not mapped: rewritten below
        _overwrite_step_file(run, path, in_version(table, 2))
    run.commit_path(1).write_bytes(run.read_commit(1).model_copy(update={"schema_version": 2}).to_json())


def _overwrite_step_file(run: RunDir, path, table: pa.Table) -> None:
    """Replace a file of step 1, and its entry in the commit record, as a writer of that file would."""
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    record, data = run.read_commit(1), path.read_bytes()
    files = {**record.files, path.name: FileEntry(bytes=len(data), xxh3_128=checksum(data))}
    run.commit_path(1).write_bytes(record.model_copy(update={"files": files}).to_json())
