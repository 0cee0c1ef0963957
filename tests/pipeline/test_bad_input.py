"""Bad input through the CLI (`beam_rl.cli.main`, in-process): malformed dataset rows, prompts longer
than the model's context, invalid configs, missing or unreadable files, an unwritable run directory,
and a full disk while a step is written.

The contract (docs/design.md, "Reliability"): a clear message naming the file, the line or row and the field
(or the config key), exit status 2 for bad input, and nothing already committed touched: every test
runs against a copy of a run directory with committed steps and compares a snapshot of its files.
"""

from __future__ import annotations

import errno
import io
import json
import os
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from beam_rl import cli
from beam_rl.envs import make_env
from beam_rl.rundir import RunDir, RunDirError
from beam_rl.rundir import steps as steps_module
from beam_rl.standin.server import EmbeddedServer
from beam_rl.model.tokenizer import load_tokenizer
from beam_rl.types import MicroBatch, Sample, TrainBatch

pytestmark = pytest.mark.timeout(120)

GROUP_SIZE = 4
MAX_CONTEXT = 256
MAX_TOKENS = 8

CONFIG = """\
[run]
dir = "{run_dir}"
max_steps = {max_steps}
bad_rows = "{bad_rows}"
[model]
max_context = {max_context}
[inference]
urls = [{urls}]
max_tokens = {max_tokens}
max_inflight = 16
max_retries = 0
[[envs]]
name = "reverse_text"
group_size = {group_size}
limit = 16
{env_args}
[batch]
rollouts_per_step = 8
seq_len = 256
[filters.zero_advantage]
mode = "monitor"
"""
# Zero-advantage groups flagged, not dropped: a filtered group arriving after the last full batch
# is lost from every window (see tests/pipeline/test_faults.py::test_groups_after_the_last_batch_...).

GOOD_ROWS = ["left", "two", "pie", "stop cold", "roof song", "warm cook"]
_REAL_ATOMIC_WRITE = steps_module.atomic_write


@pytest.fixture(scope="module")
def server_urls():
    servers = [EmbeddedServer(mode="instant") for _ in range(2)]
    yield [s.start() for s in servers]
    for s in servers:
        s.stop()


def write_config(path: Path, run_dir: Path, urls: list[str], *, dataset: Path | None = None, bad_rows: str = "fail",
                 max_steps: int = 2, **values) -> Path:
    fields = {"max_context": MAX_CONTEXT, "max_tokens": MAX_TOKENS, "group_size": GROUP_SIZE, **values}
    path.write_text(CONFIG.format(
        run_dir=run_dir, max_steps=max_steps, bad_rows=bad_rows, urls=", ".join(f'"{u}"' for u in urls),
        env_args=f'args = {{dataset = "{dataset}"}}' if dataset else "", **fields))
    return path


def run_cli(monkeypatch, *argv: str) -> tuple[int, str]:
    """`beam-rl ARGV` in this process; returns the exit status and what it printed (unwrapped)."""
    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, width=10_000, color_system=None))
    status = cli.main(list(argv))
    return status, out.getvalue()


def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `directory`: its bytes and modification time (a rewrite with the same bytes shows)."""
    if not directory.exists():
        return {}
    return {str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def temp_files(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.name.startswith(".") and ".tmp" in p.name]


def dataset_dir(root: Path, *lines: bytes | str, split: str = "train") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{split}.jsonl").write_bytes(
        b"".join((line if isinstance(line, bytes) else line.encode()) + b"\n" for line in lines))
    return root


def text_row(text: str) -> str:
    return json.dumps({"text": text})


@pytest.fixture(scope="module")
def prompt_length():
    env = make_env("reverse_text", load_tokenizer("tiny"))
    return lambda text: len(env.render_prompt({"text": text}))


@pytest.fixture(scope="module")
def committed_run(server_urls, tmp_path_factory) -> Path:
    """A run directory with steps 1 and 2 committed by a good run (the bundled reverse_text rows,
    16 groups), made once; tests use copies."""
    root = tmp_path_factory.mktemp("committed")
    config = write_config(root / "good.toml", root / "run", server_urls)
    with pytest.MonkeyPatch.context() as mp:
        status, out = run_cli(mp, "rollouts", "--config", str(config))
    assert status == 0, out
    assert RunDir(root / "run").committed_steps() == [1, 2]
    return root / "run"


@pytest.fixture
def run_copy(committed_run, tmp_path) -> Path:
    shutil.copytree(committed_run, tmp_path / "run")  # copy2: contents and mtimes
    return tmp_path / "run"


# -- dataset rows ----------------------------------------------------------------------------------

def too_long_text(prompt_length) -> str:
    text = "word " * 300
    assert prompt_length(text) > MAX_CONTEXT
    return text


BAD_ROWS = {
    # kind: (line bytes, field named, message fragment)
    "missing field": (b'{"txt": "hello"}', "text", "missing"),
    "mistyped field": (b'{"text": 42}', "text", "valid string"),
    "empty prompt": (b'{"text": "   "}', "text", "empty prompt"),
    "invalid UTF-8": (b'{"text": "caf\xe9"}', "text", "invalid UTF-8 at byte 13"),
    "prompt longer than max_context": (None, "text",
                                       f"leaving no room to generate under model.max_context ({MAX_CONTEXT})"),
}


def bad_line(kind: str, prompt_length) -> bytes:
    line = BAD_ROWS[kind][0]
    return line if line is not None else text_row(too_long_text(prompt_length)).encode()


@pytest.mark.parametrize("command", ["rollouts", "run"])
@pytest.mark.parametrize("kind", list(BAD_ROWS))
def test_a_bad_row_fails_naming_file_line_and_field_and_touches_nothing(
        server_urls, run_copy, tmp_path, monkeypatch, prompt_length, kind, command):
    data = dataset_dir(tmp_path / "data", text_row("left"), text_row("two"), bad_line(kind, prompt_length),
                       text_row("pie"))
    config = write_config(tmp_path / "c.toml", run_copy, server_urls, dataset=data)
    before = snapshot(run_copy)
    args = ["rollouts", "--config", str(config)] if command == "rollouts" else ["run", str(config)]
    status, out = run_cli(monkeypatch, *args)

    _, field, fragment = BAD_ROWS[kind]
    assert status == 2, out
    assert f"{data / 'train.jsonl'}:3: " in out
    assert f"field '{field}'" in out and fragment in out
    assert "Traceback" not in out
    assert snapshot(run_copy) == before


def test_a_bad_dataset_does_not_create_the_run_directory(server_urls, tmp_path, monkeypatch):
    data = dataset_dir(tmp_path / "data", text_row("left"), '{"text": "unclosed"')
    config = write_config(tmp_path / "c.toml", tmp_path / "fresh-run", server_urls, dataset=data)
    status, out = run_cli(monkeypatch, "rollouts", "--config", str(config))
    assert status == 2 and f"{data / 'train.jsonl'}:2: bad JSON" in out
    assert not (tmp_path / "fresh-run").exists()


def test_skipped_rows_are_counted_and_the_run_proceeds_on_the_rest(
        server_urls, run_copy, tmp_path, monkeypatch, prompt_length):
    # A prompt that fits but leaves fewer than max_tokens: it runs, with its budget cut to the room left.
    tight = next(t for n in range(MAX_CONTEXT)
                 if MAX_CONTEXT - MAX_TOKENS < prompt_length(t := "word " * n) < MAX_CONTEXT)
    room = MAX_CONTEXT - prompt_length(tight)
    lines = [text_row(GOOD_ROWS[0])]
    for kind in BAD_ROWS:  # bad rows on lines 2..6
        lines.append(bad_line(kind, prompt_length))
    lines += [text_row(t) for t in GOOD_ROWS[1:]] + [text_row(tight)]
    data = dataset_dir(tmp_path / "data", *lines)
    fresh = tmp_path / "fresh-run"
    config = write_config(tmp_path / "c.toml", fresh, server_urls, dataset=data, bad_rows="skip", max_steps=10)
    status, out = run_cli(monkeypatch, "rollouts", "--config", str(config))

    assert status == 0, out
    kept = len(GOOD_ROWS) + 1
    assert f"reverse_text (train): skipped {len(BAD_ROWS)} bad rows, kept {kept}" in out
    run = RunDir(fresh)
    (record,) = [m["dataset"] for m in run.read_metrics() if "dataset" in m]
    assert record["skipped_rows"] == len(BAD_ROWS) and record["rows"] == kept
    assert [re.search(r"train\.jsonl:(\d+):", e).group(1) for e in record["errors"]] == ["2", "3", "4", "5", "6"]
    # Only the kept rows were dispatched, each as one whole group in one step.
    steps = run.committed_steps()
    assert steps == list(range(1, len(steps) + 1))
    windows = [run.read_window(s).to_pylist() for s in steps]
    groups = Counter(r["group_id"] for w in windows for r in w)
    assert len(groups) == kept and set(groups.values()) == {GROUP_SIZE}
    tight_group = [r for w in windows for r in w if r["group_id"] == f"reverse_text/e0-i{kept - 1}"]
    assert all(r["status"] == "ok" and 1 <= r["completion_tokens"] <= room for r in tight_group), tight_group
    assert room < MAX_TOKENS


# -- configs ---------------------------------------------------------------------------------------

BAD_CONFIGS = {
    # kind: (text replaced, replacement, key path named, message fragment)
    "unknown key": ("max_steps = 2", "max_step = 2", "run.max_step", "unknown key (did you mean 'max_steps'?)"),
    "wrong type": ("seq_len = 256", 'seq_len = "256"', "batch.seq_len", "valid integer"),
    "group_size < 1": ("group_size = 4", "group_size = 0", "envs[0].group_size", "greater than or equal to 1"),
    "batch not a multiple of group_size": ("rollouts_per_step = 8", "rollouts_per_step = 10",
                                           "batch.rollouts_per_step", "10 is not a multiple of envs[0].group_size"),
    "seq_len below max_context": ("seq_len = 256", "seq_len = 128", "batch.seq_len",
                                  "128 is below model.max_context (256)"),
    "unknown environment": ('name = "reverse_text"', 'name = "reverse_txt"', "envs[0].name",
                            "unknown environment 'reverse_txt'"),
    "unknown environment argument": ("limit = 16", "limit = 16\nargs = {datset = \"x\"}", "envs[0].args",
                                     "unexpected keyword argument 'datset'"),
    "not TOML": ("[batch]", "[batch", "", "not valid TOML"),
    "invalid UTF-8": ("[batch]", "# caf\udce9\n[batch]", "", "not valid UTF-8 (line {line})"),
}


@pytest.mark.parametrize("kind", list(BAD_CONFIGS))
def test_a_bad_config_fails_naming_file_and_key_and_touches_nothing(
        server_urls, run_copy, tmp_path, monkeypatch, kind):
    old, new, key, fragment = BAD_CONFIGS[kind]
    good = write_config(tmp_path / "good.toml", run_copy, server_urls).read_text()
    assert old in good
    config = tmp_path / "bad.toml"
    config.write_bytes(good.replace(old, new, 1).encode("utf-8", "surrogateescape"))
    fragment = fragment.format(line=good[:good.index(old)].count("\n") + 1)  # the line of the edit
    before = snapshot(run_copy)
    status, out = run_cli(monkeypatch, "rollouts", "--config", str(config))
    assert status == 2, out
    assert f"invalid config {config}" in out and fragment in out
    assert key == "" or f" {key}: " in out
    assert snapshot(run_copy) == before


def test_missing_and_unreadable_config_files(tmp_path, monkeypatch):
    status, out = run_cli(monkeypatch, "rollouts", "--config", str(tmp_path / "nope.toml"))
    assert status == 2 and f"invalid config {tmp_path / 'nope.toml'}:" in out and "file not found" in out
    (tmp_path / "dir.toml").mkdir()
    status, out = run_cli(monkeypatch, "run", str(tmp_path / "dir.toml"))
    assert status == 2 and "unreadable: Is a directory" in out
    status, out = run_cli(monkeypatch, "run", "--resume", str(tmp_path))
    assert status == 2 and "holds no config.json: not a beam-rl run directory" in out


def test_missing_and_unreadable_datasets(server_urls, run_copy, tmp_path, monkeypatch):
    before = snapshot(run_copy)
    missing = tmp_path / "no-data"
    config = write_config(tmp_path / "c.toml", run_copy, server_urls, dataset=missing)
    status, out = run_cli(monkeypatch, "rollouts", "--config", str(config))
    assert status == 2 and f"{missing}: no such file or directory" in out

    no_split = dataset_dir(tmp_path / "eval-only", text_row("left"), split="eval")
    config = write_config(tmp_path / "c.toml", run_copy, server_urls, dataset=no_split)
    status, out = run_cli(monkeypatch, "rollouts", "--config", str(config))
    assert status == 2 and f"{no_split}: split 'train' is missing" in out

    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "train.parquet").write_bytes(b"not parquet at all")
    config = write_config(tmp_path / "c.toml", run_copy, server_urls, dataset=garbage)
    status, out = run_cli(monkeypatch, "rollouts", "--config", str(config))
    assert status == 2 and f"{garbage / 'train.parquet'}: unreadable Parquet file" in out

    # A parquet file whose prompt column has the wrong type: named by row index, 0-based.
    typed = tmp_path / "typed"
    typed.mkdir()
    pq.write_table(pa.table({"text": pa.array(["left", None, "pie"])}), typed / "train.parquet")
    config = write_config(tmp_path / "c.toml", run_copy, server_urls, dataset=typed)
    status, out = run_cli(monkeypatch, "rollouts", "--config", str(config))
    assert status == 2 and f"{typed / 'train.parquet'}: row 1: field 'text'" in out
    assert snapshot(run_copy) == before


# -- the run directory -----------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["rollouts", "run"])
def test_an_unwritable_run_directory_fails_before_anything_starts(server_urls, tmp_path, monkeypatch, command):
    # As root, permissions do not stop writes; a path under a regular file cannot be created by anyone.
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    config = write_config(tmp_path / "c.toml", blocker / "run", server_urls)
    args = ["rollouts", "--config", str(config)] if command == "rollouts" else ["run", str(config)]
    status, out = run_cli(monkeypatch, *args)
    assert status == 2, out
    assert f"run directory {blocker / 'run'} is not writable" in out and "Not a directory" in out
    assert blocker.read_text() == "not a directory"


def _enospc_on(file_name: str, step: int, snapshot_at_failure: dict):
    """An `atomic_write` that runs out of disk space writing `file_name` of `step`, after some bytes."""
    real = steps_module.atomic_write

    def atomic_write(path: Path, write, fsync_dir: bool = True):
        if path.name == file_name and path.parent.name == f"step_{step}":
            snapshot_at_failure.update(snapshot(path.parent.parent.parent))

            def full_disk(f):
                f.write(b"partial bytes")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            return real(path, full_disk, fsync_dir)
        return real(path, write, fsync_dir)

    return atomic_write


def _small_batch(step: int) -> TrainBatch:
    ids = np.arange(6, dtype=np.int32)
    sample = Sample(input_ids=ids, loss_mask=ids > 2, logprobs=np.zeros(6, np.float32),
                    advantages=np.ones(6, np.float32), temperatures=np.ones(6, np.float32),
                    rollout_id="g/0", group_id="g", policy_version=0)
    return TrainBatch(step=step, micro_batches=[[MicroBatch([sample])]], group_ids=["g"], window={"rollouts": 1})


@pytest.mark.parametrize("file_name", ["rank_0.arrow", "window.arrow", "COMMIT.json"])
def test_a_full_disk_while_writing_a_step_commits_nothing_and_keeps_earlier_steps(tmp_path, monkeypatch, file_name):
    run = RunDir(tmp_path)
    run.write_step(_small_batch(1))
    before: dict = {}
    monkeypatch.setattr(steps_module, "atomic_write", _enospc_on(file_name, 2, before))
    with pytest.raises(RunDirError, match=r"step_2: step 2 is not committed: writing it failed: \[Errno 28\] No space"):
        run.write_step(_small_batch(2))
    assert run.committed_steps() == [1] and not run.is_committed(2)
    assert temp_files(tmp_path) == []
    step_1 = {k: v for k, v in snapshot(tmp_path).items() if k.startswith("rollouts/step_1/")}
    assert step_1 == {k: v for k, v in before.items() if k.startswith("rollouts/step_1/")} and step_1
    monkeypatch.undo()
    run.clean_uncommitted()
    run.write_step(_small_batch(2))  # the disk has room again: the same step commits
    assert run.committed_steps() == [1, 2]


def test_a_full_disk_mid_run_stops_the_cli_clearly_and_the_next_run_continues(
        server_urls, run_copy, tmp_path, monkeypatch):
    committed_before = snapshot(run_copy / "rollouts")
    at_failure: dict = {}
    # Steps 1-2 are committed; the disk fills while this run writes step 4's window. Step 4's files are written
    # beside step 3's commit (WriteStepFiles runs apart from CommitSteps), so step 3 is committed or not by then:
    # either way nothing committed changes, and the next run redoes what was not.
    monkeypatch.setattr(steps_module, "atomic_write", _enospc_on("window.arrow", 4, at_failure))
    config = write_config(tmp_path / "c.toml", run_copy, server_urls, max_steps=6)
    status, out = run_cli(monkeypatch, "rollouts", "--config", str(config))

    assert status == 1, out
    assert "the run stopped: RunDirError:" in out and "step 4 is not committed" in out, out
    assert "[Errno 28] No space left on device" in out and "Traceback" not in out, out
    run = RunDir(run_copy)
    committed = run.committed_steps()
    assert committed in ([1, 2], [1, 2, 3]) and f"steps 1..{committed[-1]} are committed" in out, out
    assert temp_files(run_copy) == []
    after = snapshot(run_copy / "rollouts")
    # Steps committed before this run, and a step 3 committed as it was when the disk filled, are byte-identical.
    assert {k: v for k, v in after.items() if k.startswith(("step_1/", "step_2/"))} == committed_before
    if 3 in committed:
        assert {k: v for k, v in after.items() if k.startswith("step_3/")} == {
            k.removeprefix("rollouts/"): v for k, v in at_failure.items() if k.startswith("rollouts/step_3/")}

    monkeypatch.setattr(steps_module, "atomic_write", _REAL_ATOMIC_WRITE)  # the disk has room again
    status, out = run_cli(monkeypatch, "rollouts", "--config", str(config))
    assert status == 0, out
    assert run.committed_steps() == list(range(1, 7))
    groups = Counter(r["group_id"] for s in run.committed_steps() for r in run.read_window(s).to_pylist())
    assert set(groups.values()) == {GROUP_SIZE}  # no group in two steps, none lost from a committed one
