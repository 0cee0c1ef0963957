"""`beam-rl inspect` and `beam-rl report` (in-process) on intact and damaged run directories: inspect
verifies every committed file, names each damaged step in one red line and exits with status 2."""

from __future__ import annotations

import re

import pytest

from beam_rl import cli
from beam_rl.inference.inflight import UpdateTiming
from beam_rl.rundir import RunDir
from beam_rl.types import TrainBatch
from tests.support.cli import RED, STYLE, YELLOW, coloured, run_cli
from tests.support.step_damage import FILE_DAMAGE, RECORD_DAMAGE
from tests.unit.trainer.test_reader import batch



def cells(lines: list[str], step: int) -> list[str]:
    row = next(STYLE.sub("", line) for line in lines if re.search(rf"│\s+{step}\s+│", STYLE.sub("", line)))
    return [cell.strip() for cell in row.split("│")[1:-1]]


def three_steps(run: RunDir) -> RunDir:
    for step in (1, 2, 3):
        committed = batch(step)
        committed.window = {"rollouts": 10 * step, "trained_rollouts": step, "reward_mean": 0.25, "errored": 1,
                            "filtered": {"gibberish": 2}, "staleness_max": 0,
                            "tokens_by_fate": {"trained": 10 * step, "stale": 10}}
        run.write_step(committed)
    return run


def step_rows(lines: list[str]) -> list[str]:
    """The step numbers of the table's rows."""
    rows = [STYLE.sub("", line).split("│") for line in lines]
    return [row[1].strip() for row in rows if len(row) == 11 and row[1].strip().isdigit()]


def test_inspect_shows_every_committed_step_of_an_intact_run(tmp_path, monkeypatch):
    run = three_steps(RunDir(tmp_path))
    status, lines = run_cli(monkeypatch, "inspect", str(run.path))
    assert status == 0 and step_rows(lines) == ["1", "2", "3"]
    assert cells(lines, 3) == ["3", "30", "3", "11", "0.250", "1", "gibberish=2", "0", "75%"]  # 30 of 40 trained
    assert coloured(lines, RED) == []


@pytest.mark.parametrize("damage", sorted(FILE_DAMAGE))
@pytest.mark.parametrize("name", ["rank_1.arrow", "window.arrow"])
def test_inspect_names_a_damaged_file_in_one_red_line_and_exits_2(tmp_path, monkeypatch, damage, name):
    run = three_steps(RunDir(tmp_path))
    damage_file, says = FILE_DAMAGE[damage]
    path = run.step_dir(2) / name
    damage_file(path)
    status, lines = run_cli(monkeypatch, "inspect", str(run.path))
    assert status == 2
    red = coloured(lines, RED)
    assert len(red) == 1 and re.fullmatch(rf"{re.escape(str(path))}: step 2 is corrupt: {says}", red[0]), red
    assert step_rows(lines) == ["1", "3"]  # the intact steps are still shown
    assert not any("Traceback" in line for line in lines)


@pytest.mark.parametrize("damage", sorted(RECORD_DAMAGE))
def test_inspect_names_a_damaged_commit_record_in_one_red_line_and_exits_2(tmp_path, monkeypatch, damage):
    run = three_steps(RunDir(tmp_path))
    damage_record, says = RECORD_DAMAGE[damage]
    damage_record(run.commit_path(3))
    status, lines = run_cli(monkeypatch, "inspect", str(run.path))
    assert status == 2
    red = coloured(lines, RED)
    assert len(red) == 1 and re.match(rf"{re.escape(str(run.commit_path(3)))}: {says}", red[0]), red
    assert step_rows(lines) == ["1", "2"]
    assert not any("Traceback" in line for line in lines)


def test_inspect_reports_a_stray_file_as_a_warning_and_exits_0(tmp_path, monkeypatch):
    run = three_steps(RunDir(tmp_path))
    stray = run.step_dir(1) / "rank_5.arrow"
    stray.write_bytes(run.rank_path(1, 0).read_bytes())
    status, lines = run_cli(monkeypatch, "inspect", str(run.path))
    assert status == 0 and step_rows(lines) == ["1", "2", "3"]
    assert coloured(lines, YELLOW) == [f"{stray}: not listed in its step's commit record; readers ignore it"]
    assert coloured(lines, RED) == []


def test_report_plots_an_intact_run_and_names_a_damaged_commit_record(tmp_path, monkeypatch):
    run = three_steps(RunDir(tmp_path))
    status, lines = run_cli(monkeypatch, "report", str(run.path))
    assert status == 0 and step_rows(lines) == ["1", "2", "3"]
    assert (run.path / "report.png").stat().st_size > 0
    assert not any("weight updates" in line for line in lines)  # none yet
    RECORD_DAMAGE["garbage"][0](run.commit_path(2))
    status, lines = run_cli(monkeypatch, "report", str(run.path))
    red = coloured(lines, RED)
    assert status == 2
    assert red == [f"{run.commit_path(2)}: not a commit record: Invalid JSON: expected value at line 1 column 1"]
    assert not any("Traceback" in line for line in lines)


def test_an_empty_window_step_shows_zeros(tmp_path, monkeypatch):
    run = RunDir(tmp_path)
    run.write_step(TrainBatch(step=1, micro_batches=[], group_ids=[], window={}))
    status, lines = run_cli(monkeypatch, "inspect", str(run.path))
    assert status == 0 and cells(lines, 1) == ["1", "0", "0", "0", "0.000", "0", "0", "", "-"]


_BUSY_CONFIG = """
[run]
dir = "{run_dir}"
max_steps = 2
[inference]
urls = ["http://127.0.0.1:9"]
[[envs]]
name = "reverse_text"
group_size = 4
[batch]
rollouts_per_step = 8
[trainer]
kind = "none"
"""


@pytest.mark.parametrize("command", ["run", "rollouts"])
def test_a_run_directory_another_process_follows_is_a_one_line_error(tmp_path, monkeypatch, command):
    from beam_rl.rundir.lease import RunLease

    run = RunDir(tmp_path / "run")
    config = tmp_path / "run.toml"
    config.write_text(_BUSY_CONFIG.format(run_dir=run.path))
    with RunLease(run.path):  # another live process follows the run
        argv = ["run", str(config)] if command == "run" else ["rollouts", "--config", str(config)]
        status, lines = run_cli(monkeypatch, *argv)
    assert status == 2
    # Red, and after `rollouts`' spinner, behind the terminal codes that clear its line.
    red = [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line) for line in lines if RED in line]
    assert len(red) == 1 and red[0].startswith(f"{run.path} is followed by another beam-rl process"), lines
    assert not any("Traceback" in line for line in lines) and run.committed_steps() == []


def test_resuming_a_complete_run_starts_nothing_and_says_so(tmp_path, monkeypatch):
    from beam_rl.config import load_config

    run = three_steps(RunDir(tmp_path / "run"))
    config_path = tmp_path / "run.toml"
    config_path.write_text(_BUSY_CONFIG.format(run_dir=run.path).replace("max_steps = 2", "max_steps = 3"))
    config = load_config(str(config_path))
    run.write_config(config.model_dump(mode="json"))
    status, lines = run_cli(monkeypatch, "run", "--resume", str(run.path))
    assert status == 0
    assert [STYLE.sub("", line) for line in lines] == [
        f"{run.path} is complete: steps 1..3 are committed; `beam-rl report {run.path}` shows them"]
    assert not (run.path / "run.lock").exists()  # no job was started
    # With the reference trainer, the last step must be trained too: no weights yet, so not complete.
    reference = config.model_copy(update={"trainer": config.trainer.model_copy(update={"kind": "reference"})})
    assert not cli._run_complete(reference, 3) and cli._run_complete(config, 3)
    assert not cli._run_complete(config, 2) and not cli._run_complete(config, None)
    with run.publish_weights_dir(2) as weights:
        (weights / "model.safetensors").write_bytes(b"")
    assert not cli._run_complete(reference, 3)  # trained up to step 2 only
    with run.publish_weights_dir(3) as weights:
        (weights / "model.safetensors").write_bytes(b"")
    assert cli._run_complete(reference, 3)


def test_report_says_what_the_weight_updates_cost_each_server(tmp_path, monkeypatch):
    run = three_steps(RunDir(tmp_path))
    # As the source records them: keep mode's engine time lost is the pause, reload mode's the load.
    for version, timings, regenerated in ((1, [("keep", 0.02, 0.01), ("keep", 0.04, 0.03)], 3),
                                          (2, [("reload", 0.0, 0.03), ("reload", 0.0, 0.05)], 2)):
        run.append_metrics({"weight_update": {
            "t": 1.0, "shard": 0, "version": version, "seconds": 0.1, "regenerated_rollouts": regenerated,
            "cancelled_stale_rollouts": 1, "servers": [UpdateTiming(f"http://127.0.0.1:{port}", mode, version,
                                                                    paused, load).as_dict()
                                                       for port, (mode, paused, load) in enumerate(timings)]}})
    status, lines = run_cli(monkeypatch, "report", str(run.path))
    assert status == 0
    assert [STYLE.sub("", line) for line in lines if "weight updates" in line] == [
        "weight updates: 2 (keep/reload); engine time lost per update and server: mean 0.035 s, max 0.050 s; "
        "stale rollouts regenerated 5, cancelled 2"]
