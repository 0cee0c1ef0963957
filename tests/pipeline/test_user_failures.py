"""What a user can cause or meet, through the `beam-rl` command as a terminal runs it (a subprocess): a
config naming what does not exist, a damaged or copied run directory, partial weights, a server that
never answers, a full disk. Each ends in one line that says what happened, never a traceback; what is
committed stays as it was; and once the cause is fixed, a resume continues with no step lost or repeated.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from beam_rl.processes import free_port
from beam_rl.rundir import RunDir
from beam_rl.standin.server import EmbeddedServer, FaultConfig
from beam_rl.model.tiny import tiny_model_dir
from tests.support.paths import SUPPORT
from tests.support.small_run import write_small_run_config

pytestmark = pytest.mark.timeout(600)


def beam_rl(*argv: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`beam-rl ARGV` in a process of its own (with `env` added to this one's); lines are not wrapped (a wide
    terminal)."""
    return subprocess.run([sys.executable, "-m", "beam_rl.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "10000", **(env or {})})


def said(proc: subprocess.CompletedProcess, status: int) -> list[str]:
    """The lines the command printed last (what went wrong, then what is kept): no traceback anywhere."""
    assert proc.returncode == status, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    everything = proc.stdout + proc.stderr
    assert "Traceback" not in everything, everything[-5000:]
    return [line for line in proc.stdout.splitlines() if line.strip()][-2:]


def committed(run: RunDir) -> dict[str, bytes]:
    return {str(p.relative_to(run.path)): p.read_bytes() for p in sorted(run.rollouts_dir.rglob("*")) if p.is_file()}


def assert_contiguous_and_once(run: RunDir, steps: int) -> None:
    assert run.committed_steps() == list(range(1, steps + 1))
    groups = Counter(g for s in run.committed_steps() for g in run.read_commit(s).group_ids)
    assert groups and set(groups.values()) == {1}  # no group trained twice
    assert run.stable_weight_steps() == list(range(1, steps + 1))  # the trainer trained every step


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> RunDir:
    """`beam-rl run` of the small run (instant embedded servers, the reference trainer): 4 steps."""
    root = tmp_path_factory.mktemp("finished")
    config = write_small_run_config(root / "run.toml", root / "run", max_steps=4, epochs=10)
    said(beam_rl("run", str(config)), 0)
    return RunDir(root / "run")


@pytest.fixture
def resumable(finished_run, tmp_path) -> RunDir:
    """A copy of the finished run that has 2 steps left: its config.json asks for 6."""
    run = RunDir(shutil.copytree(finished_run.path, tmp_path / "run"))
    config = run.read_config()
    config["run"]["max_steps"] = 6
    run.write_config(config)
    return run


def _small_config(tmp_path: Path, edit: tuple[str, str] | None = None, **inference: str) -> Path:
    path = write_small_run_config(tmp_path / "run.toml", tmp_path / "run", max_steps=2, epochs=1)
    text = path.read_text()
    if edit:
        text = text.replace(*edit, 1)
    for key, value in inference.items():
        text = text.replace("[inference]\n", f"[inference]\n{key} = {value}\n", 1)
    path.write_text(text)
    return path


@pytest.mark.parametrize("edit, key, message", [
    (('name = "reverse_text"', 'name = "reverse_text"\nalgorithm = "gpro"'), "envs[0].algorithm",
     "unknown advantage algorithm 'gpro'; registered: ['dr_grpo', 'grpo', 'maxrl', 'reinforce_plus_plus_baseline', "
     "'rloo']"),
    (('name = "reverse_text"', 'name = "reverse_text"\nalgorithm_args = {eps = "small"}'),
     "envs[0].algorithm_args.eps", "expected a number (the default is 1e-06), got 'small'"),
    (("[model]\n", '[model]\nname = "{missing}"\n'), "model.name",
     '{missing} is not a directory: give "tiny" or a local Hugging Face model directory (nothing is downloaded)'),
    (("[model]\n", '[model]\nname = "{empty}"\n'), "model.name",
     "{empty}/config.json: not a model config with a vocab_size (FileNotFoundError: "),
    (("[model]\n", '[model]\nname = "{unknown}"\n'), "model.name",
     "{unknown}/config.json: transformers cannot load this model (ValueError: "),
    (("[model]\n", '[trainer.lora]\ntarget_modules = ["q_proj", "nope_proj"]\n\n[model]\n'),
     "trainer.lora.target_modules", "['nope_proj'] name no weight matrix of tiny (it has ['down_proj', "),
], ids=["unknown algorithm", "algorithm argument of the wrong type", "no model directory", "not a model directory",
        "a model transformers does not know", "LoRA modules the model lacks"])
def test_a_config_error_is_one_line_before_anything_starts(tmp_path, edit, key, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "config.json").write_text('{"model_type": "no-such-model", "vocab_size": 64}')
    names = {"missing": tmp_path / "nope", "empty": tmp_path / "empty", "unknown": tmp_path / "unknown"}
    replacement = edit[1]
    for name, path in names.items():
        replacement = replacement.replace(f"{{{name}}}", str(path))
    config = _small_config(tmp_path, (edit[0], replacement))
    [line] = said(beam_rl("run", str(config)), 2)[-1:]
    assert line.startswith(f"invalid config {config}: {key}: {message.format(**names)}"), line
    assert not (tmp_path / "run").exists()  # found before the run directory, a server or Beam


@pytest.mark.parametrize("damage", ["config.json", "COMMIT.json", "metrics.jsonl", "rank file"])
def test_a_damaged_run_directory_is_named_in_one_line_and_nothing_starts(resumable, damage):
    run = resumable
    if damage == "rank file":  # of a step the trainer has not trained yet: it reads it next
        shutil.rmtree(run.weights_path(4))
    before = committed(run)
    path = {"config.json": run.config_path, "COMMIT.json": run.commit_path(2), "metrics.jsonl": run.metrics_path,
            "rank file": run.rank_path(4, 0)}[damage]
    original = path.read_bytes()
    if damage == "metrics.jsonl":  # a line in the middle (a torn last line is repaired, not an error)
        lines = original.splitlines(keepends=True)
        path.write_bytes(b"".join(lines[:3] + [b"\x00\xff garbage\n"] + lines[3:]))
    else:
        path.write_bytes(b"\x00\xff garbage")
    metrics = run.metrics_path.read_bytes()
    commands = [["run", "--resume", str(run.path)]]
    if damage in ("config.json", "COMMIT.json"):
        commands += [["replay", str(run.path), "--all"], ["inspect", str(run.path), "--step", "2"]]
    for argv in commands:
        [line] = said(beam_rl(*argv), 2)[-1:]
        assert line.startswith(str(path)), (argv, line)
    assert committed(run) == {**before, **({str(path.relative_to(run.path)): path.read_bytes()}
                                           if path.is_relative_to(run.rollouts_dir) else {})}
    assert run.metrics_path.read_bytes() == metrics  # nothing started: not a line appended


def test_partial_weights_are_named_and_the_run_resumes_once_they_are_removed(resumable):
    run = resumable
    (run.weights_path(4) / "model.safetensors").unlink()  # STABLE, but no weights
    before = committed(run)
    [line] = said(beam_rl("run", "--resume", str(run.path)), 2)[-1:]
    assert line.endswith(f"the newest published weights, step 4, cannot be loaded: {run.weights_path(4)}: no "
                         f"*.safetensors files. Remove {run.weights_path(4)} and the run resumes from the weights "
                         "published before them"), line
    assert committed(run) == before
    shutil.rmtree(run.weights_path(4))
    said(beam_rl("run", "--resume", str(run.path)), 0)
    assert_contiguous_and_once(run, 6)
    assert {k: v for k, v in committed(run).items() if k in before} == before


def test_a_copied_run_directory_resumes_in_the_copy(resumable, tmp_path):
    """config.json names the directory the run was made in; the directory given is the one resumed."""
    original = resumable
    copy = RunDir(shutil.copytree(original.path, tmp_path / "copy"))
    before = committed(original)
    said(beam_rl("run", "--resume", str(copy.path)), 0)
    assert_contiguous_and_once(copy, 6)
    assert committed(original) == before and original.committed_steps() == [1, 2, 3, 4]


def test_a_server_where_nothing_listens_is_named_within_the_start_up_patience(tmp_path, record_property):
    """The defaults: inference.startup_timeout_s = 30, not all_servers_down_timeout_s (300)."""
    url = f"http://127.0.0.1:{free_port()}"
    config = _small_config(tmp_path, ('embedded_mode = "instant"', f'urls = ["{url}"]'))
    started = time.monotonic()
    proc = beam_rl("run", str(config))
    seconds = time.monotonic() - started
    record_property("seconds_to_the_error", round(seconds, 1))
    [line] = said(proc, 2)[-1:]
    assert line.startswith(f"inference servers cannot serve this run: {url} cannot be reached ("), line
    assert line.endswith("none answered within inference.startup_timeout_s = 30 s")
    assert 30 <= seconds < 90
    assert RunDir(tmp_path / "run").committed_steps() == []


def test_a_server_that_answers_every_request_with_http_500_stops_the_run_within_the_start_up_patience(
        tmp_path, record_property):
    with EmbeddedServer(mode="instant", faults=FaultConfig(error_rate=1.0)) as server:
        config = _small_config(tmp_path, ('embedded_mode = "instant"', f'urls = ["{server.url}"]'),
                               startup_timeout_s="5.0")
        started = time.monotonic()
        [line, kept] = said(beam_rl("run", str(config)), 1)
        seconds = time.monotonic() - started
    record_property("seconds_to_the_error", round(seconds, 1))
    assert line.startswith(f"the run stopped: AllServersDownError: none of all 1 inference servers ({server.url}) "
                           "has answered a request since the run started"), line
    assert line.endswith("past inference.startup_timeout_s = 5"), line
    assert kept == f"no step is committed in {tmp_path / 'run'}; beam-rl run --resume {tmp_path / 'run'} continues from there"
    assert seconds < 120  # not inference.all_servers_down_timeout_s (300 s)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 3 MiB filesystem of its own (tmpfs): room for a step or two of the small run and its weights."""
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_stops_the_run_in_one_line_and_a_resume_with_room_finishes_it(small_tmpfs, tmp_path):
    run = RunDir(small_tmpfs / "run")
    config = write_small_run_config(tmp_path / "run.toml", run.path, max_steps=6, epochs=10)
    [line, kept] = said(beam_rl("run", str(config)), 1)
    assert line.startswith("the run stopped: ") and ("No space left on device" in line or "is full" in line), line
    last = run.last_committed_step()
    assert kept == (f"steps 1..{last} are committed in {run.path}" if last else f"no step is committed in {run.path}") \
        + f"; beam-rl run --resume {run.path} continues from there"
    for step in run.committed_steps():
        run.verify_step(run.read_commit(step))  # every committed step whole
    before = committed(run)
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_tmpfs)], check=True)  # room again
    said(beam_rl("run", "--resume", str(run.path)), 0)
    assert_contiguous_and_once(run, 6)
    assert {k: v for k, v in committed(run).items() if k in before} == before
    assert json.loads(run.config_path.read_text())["run"]["max_steps"] == 6


def test_a_run_whose_every_rollout_fails_stops_naming_the_cause_and_resumes_once_fixed(resumable, record_property):
    """The defaults (run.stop_after_errored_groups = 16): an environment whose prompts the model's context
    cannot hold (tests/support/padded_prompts.py) fails every rollout; the run stops in one line naming the cause,
    the live view, `status` and `inspect` show the errors by cause, and once the prompts fit it resumes."""
    run = resumable
    config = run.read_config()
    config["envs"][0].update(kind="padded_prompts:PaddedPrompts", args={"pad_tokens": 300})  # 256 tokens of context
    run.write_config(config)
    before = committed(run)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(SUPPORT), os.environ.get("PYTHONPATH")]))}
    started = time.monotonic()
    proc = beam_rl("run", "--resume", str(run.path), env=env)
    record_property("seconds_to_the_stop", round(time.monotonic() - started, 1))
    [line, kept] = said(proc, 1)
    assert line.startswith("the run stopped: NothingTrainsError: nothing can train: every rollout of the last 16 "
                           "groups errored (run.stop_after_errored_groups = 16); most frequent cause: "
                           "PromptTooLong, "), line
    assert "env 'reverse_text' row " in line and "leaving no room to generate under model.max_context (256)" in line
    assert kept == f"steps 1..4 are committed in {run.path}; beam-rl run --resume {run.path} continues from there"
    newest = "errored: PromptTooLong; the newest: PromptTooLong: env 'reverse_text' row "
    assert newest in proc.stdout  # the live view, under its table
    assert committed(run) == before
    for command in ("status", "inspect"):
        out = said(beam_rl(command, str(run.path)), 0)
        assert out[-1].startswith("  ") and newest in out[-1], out
    config["envs"][0]["args"] = {"pad_tokens": 0}  # fixed: the prompts fit
    run.write_config(config)
    said(beam_rl("run", "--resume", str(run.path), env=env), 0)
    assert_contiguous_and_once(run, 6)
    assert {k: v for k, v in committed(run).items() if k in before} == before


def test_a_context_the_model_does_not_have_is_named_before_anything_starts(tmp_path):
    config = _small_config(tmp_path)
    config.write_text(config.read_text().replace("max_context = 256", "max_context = 2048")
                      .replace("seq_len = 256", "seq_len = 2048"))
    [line] = said(beam_rl("run", str(config)), 2)[-1:]
    assert line == (f"invalid config {config}: model.max_context: 2048 is above the model's context: "
                    f"max_position_embeddings = 1024 in {tiny_model_dir(0) / 'config.json'}")
    assert not (tmp_path / "run").exists()  # found before the run directory, a server or Beam
