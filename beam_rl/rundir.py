"""The run directory, the durable contract between orchestrator and trainer: committed steps, weights, metrics."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa

from beam_rl.types import Rollout, TrainBatch
from schemas.train_batch import (
    ROLLOUT_RECORD_SCHEMA,
    SCHEMA_VERSION,
    check_schema,
    rollouts_to_table,
    samples_to_table,
)

COMMIT_FILE = "COMMIT.json"
INPUT_EXHAUSTED_FILE = "INPUT_EXHAUSTED.json"
STABLE_FILE = "STABLE"
WINDOW_FILE = "window.arrow"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_MARK = ".tmp-"

Offset = tuple[str, int, int]  # (env, epoch, index): one prompt of one epoch, the unit the source resumes by


class RunDirError(OSError):
    """The run directory cannot be used (not writable, not a directory, disk full while writing a step, ...)."""


class StepAlreadyCommittedError(FileExistsError):
    """Writing a step that is already committed: steps are written exactly once."""


class StepNotCommittedError(FileNotFoundError):
    """Reading a step whose commit record does not exist (yet)."""


def rank_file_name(rank: int) -> str:
    return f"rank_{rank}.arrow"


class RunDir:
    """One run directory. Steps count from 1: step s trains policy s-1 into policy s.

    Layout (DESIGN.md section 5):
        config.json                       the run config (RunConfig.model_dump(mode="json"))
        metrics.jsonl                     one JSON object per line
        rollouts/step_<N>/rank_<R>.arrow  packed micro-batches of rank R (Arrow IPC file, TRAIN_BATCH_SCHEMA)
        rollouts/step_<N>/window.arrow    every rollout seen since the previous step (ROLLOUT_RECORD_SCHEMA)
        rollouts/step_<N>/COMMIT.json     written last: the step exists for readers only once this does
        weights/step_<N>/ + STABLE        published by the trainer; STABLE written last

    Every file is written under a hidden temporary name in its final directory, fsynced, renamed into place
    and the directory fsynced, so a crash leaves either the old state or the new one, plus temp files that
    `clean_uncommitted` removes. One orchestrator process writes a run directory's rollouts at a time.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.rollouts_dir = self.path / "rollouts"
        self.weights_dir = self.path / "weights"
        self.metrics_path = self.path / "metrics.jsonl"
        self.config_path = self.path / "config.json"

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def check_writable(self) -> None:
        """Fail before any work starts if the run directory cannot be created or written."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / f".write-probe{_TMP_MARK}{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise RunDirError(f"run directory {self.path} is not writable: {err}") from err

    # -- rollouts side: written by the orchestrator ---------------------------------------------------

    def step_dir(self, step: int) -> Path:
        return self.rollouts_dir / f"step_{step}"

    def rank_path(self, step: int, rank: int) -> Path:
        return self.step_dir(step) / rank_file_name(rank)

    def window_path(self, step: int) -> Path:
        return self.step_dir(step) / WINDOW_FILE

    def commit_path(self, step: int) -> Path:
        return self.step_dir(step) / COMMIT_FILE

    def is_committed(self, step: int) -> bool:
        return self.commit_path(step).is_file()

    def write_step(
        self,
        batch: TrainBatch,
        extra: dict[str, Any] | None = None,
        *,
        offsets: Iterable[Offset] = (),
        window: Sequence[Rollout] | pa.Table | None = None,
    ) -> Path:
        """Write and commit one step; returns its directory.

        `offsets` are the (env, epoch, index) prompts this step consumes: on resume the source skips
        exactly these. `window` overrides the observation window written as window.arrow (default:
        `batch.rollouts`, every rollout since the previous step). `extra` goes into
        the commit record; its "timings" dict is merged with the write timing, the rest kept under "extra".
        """
        if not isinstance(batch.step, (int, np.integer)) or batch.step < 0:
            raise ValueError(f"step must be a non-negative integer, got {batch.step!r}")
        step = int(batch.step)
        # Encode the caller's parts first: a value JSON cannot hold must fail before any file is written.
        window_stats = json.loads(json.dumps(batch.window, default=_json_default))
        extra = json.loads(json.dumps(extra or {}, default=_json_default))
        consumed = sorted([str(env), int(epoch), int(index)] for env, epoch, index in offsets)
        if self.is_committed(step):
            raise StepAlreadyCommittedError(f"{self.step_dir(step)}: step {step} is already committed")
        t0 = time.monotonic()
        step_dir = self.step_dir(step)
        if step_dir.exists():
            shutil.rmtree(step_dir)  # an uncommitted leftover of a crashed attempt at this step
        self.rollouts_dir.mkdir(parents=True, exist_ok=True)
        step_dir.mkdir()
        _fsync_dir(self.rollouts_dir)

        try:
            files: dict[str, int] = {}
            micro_batches, samples, tokens, trained_tokens = [], 0, 0, 0
            for rank, rank_micro_batches in enumerate(batch.micro_batches):
                table = samples_to_table(rank_micro_batches)
                path = self.rank_path(step, rank)
                _atomic_write(path, lambda f, t=table: _write_arrow_file(f, t), fsync_dir=False)
                files[path.name] = path.stat().st_size
                micro_batches.append(len(rank_micro_batches))
                samples += table.num_rows
                tokens += sum(mb.num_tokens for mb in rank_micro_batches)
                trained_tokens += sum(
                    int(np.count_nonzero(s.loss_mask)) for mb in rank_micro_batches for s in mb.samples)

            window_table = _window_table(batch.rollouts if window is None else window)
            _atomic_write(self.window_path(step), lambda f: _write_arrow_file(f, window_table), fsync_dir=False)
            files[WINDOW_FILE] = self.window_path(step).stat().st_size
            # One directory fsync makes every rename above durable before the commit record can exist.
            _fsync_dir(step_dir)

            timings = {**extra.pop("timings", {}), "write_s": round(time.monotonic() - t0, 6)}
            record = {
                "step": step,
                "schema_version": SCHEMA_VERSION,
                "committed_at": time.time(),
                "group_ids": list(batch.group_ids),
                "offsets": consumed,
                "counts": {
                    "ranks": len(batch.micro_batches),
                    "micro_batches": micro_batches,
                    "samples": samples,
                    "tokens": tokens,
                    "trained_tokens": trained_tokens,
                    "groups": len(batch.group_ids),
                    "window_rollouts": window_table.num_rows,
                },
                "timings": timings,
                "files": files,
                "window": window_stats,
                "extra": extra,
            }
            _atomic_write(self.commit_path(step), _json_writer(record))
        except OSError as err:
            if self.is_committed(step):
                raise  # the commit record exists: only its directory fsync failed; the step stands
            # A full disk (ENOSPC) or an I/O error mid-step: say which step did not make it. Files
            # already renamed into the step dir stay uncommitted; `clean_uncommitted` removes them.
            raise RunDirError(f"{step_dir}: step {step} is not committed: writing it failed: {err}") from err
        return step_dir

    @property
    def input_exhausted_path(self) -> Path:
        return self.path / INPUT_EXHAUSTED_FILE

    def mark_input_exhausted(self, last_step: int) -> None:
        """Every group of the run's input is in a committed step up to `last_step`: the run is over."""
        _atomic_write(self.input_exhausted_path, _json_writer({"last_step": last_step, "at": time.time()}))

    def run_over(self, max_steps: int) -> bool:
        """max_steps are committed, or the input is exhausted: the job may be ended."""
        return self.input_exhausted_path.is_file() or (self.last_committed_step() or 0) >= max_steps

    def committed_steps(self) -> list[int]:
        return sorted(step for step, path in self._step_dirs() if (path / COMMIT_FILE).is_file())

    def last_committed_step(self) -> int | None:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def next_step(self) -> int:
        """The step a (re)started orchestrator writes next."""
        last = self.last_committed_step()
        return 1 if last is None else last + 1

    def read_commit(self, step: int) -> dict[str, Any]:
        path = self.commit_path(step)
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            raise StepNotCommittedError(f"{path}: step {step} is not committed") from None

    def consumed_offsets(self, before_step: int | None = None) -> set[Offset]:
        """Every (env, epoch, index) some committed step (before `before_step`, if given) consumed:
        what a resumed source must skip."""
        return {
            (env, epoch, index)
            for step in self.committed_steps() if before_step is None or step < before_step
            for env, epoch, index in self.read_commit(step)["offsets"]
        }

    def read_window(self, step: int) -> pa.Table:
        if not self.is_committed(step):
            raise StepNotCommittedError(f"{self.commit_path(step)}: step {step} is not committed")
        with pa.memory_map(str(self.window_path(step))) as source:
            table = pa.ipc.open_file(source).read_all()
        check_schema(table.schema, ROLLOUT_RECORD_SCHEMA, str(self.window_path(step)))
        return table

    def clean_uncommitted(self) -> list[Path]:
        """Remove what a crash left behind: uncommitted step dirs and temp files; returns what was removed.

        Only the orchestrator's side: the weights side belongs to the trainer, which may be mid-publish.
        """
        removed: list[Path] = []
        for _, path in self._step_dirs():
            if not (path / COMMIT_FILE).is_file():
                shutil.rmtree(path)
                removed.append(path)
                continue
            for leftover in path.iterdir():
                if _is_temp(leftover):
                    _remove(leftover)
                    removed.append(leftover)
        for directory in (self.path, self.rollouts_dir):
            if directory.is_dir():
                for leftover in directory.iterdir():
                    if _is_temp(leftover):
                        _remove(leftover)
                        removed.append(leftover)
        return removed

    def _step_dirs(self) -> Iterator[tuple[int, Path]]:
        if not self.rollouts_dir.is_dir():
            return
        for path in self.rollouts_dir.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and path.is_dir():
                yield int(match.group(1)), path

    # -- run files ------------------------------------------------------------------------------------

    def write_config(self, config: dict[str, Any]) -> Path:
        self.path.mkdir(parents=True, exist_ok=True)
        _atomic_write(self.config_path, _json_writer(config, indent=2))
        return self.config_path

    def read_config(self) -> dict[str, Any]:
        return json.loads(self.config_path.read_text())

    def status_path(self, shard: int = 0) -> Path:
        return self.path / f"status-{shard}.json"

    def write_status(self, status: dict[str, Any], shard: int = 0) -> None:
        """A dispatch shard's live state (in flight, policy version, ...), replaced as it changes."""
        _atomic_write(self.status_path(shard), _json_writer(status), fsync_dir=False)

    def read_status(self) -> dict[str, Any]:
        """Every dispatch shard's live state, merged (see merge_status); {} before any is written."""
        shards = []
        for path in sorted(self.path.glob("status-*.json")):
            try:
                shards.append(json.loads(path.read_text()))
            except (FileNotFoundError, json.JSONDecodeError):
                continue
        return merge_status(shards)

    def append_metrics(self, metrics: dict[str, Any]) -> None:
        """Append one JSON line; numpy scalars and arrays are converted (metrics often come from numpy)."""
        self.path.mkdir(parents=True, exist_ok=True)
        line = json.dumps(metrics, default=_json_default, separators=(",", ":"))
        with self.metrics_path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")

    def read_metrics(self) -> list[dict[str, Any]]:
        """All metrics lines; a torn last line (a crash mid-append) is skipped, a torn earlier one is an error."""
        return MetricsTail(self.metrics_path).read_new()

    # -- weights side: published by the trainer -------------------------------------------------------

    def weights_path(self, step: int) -> Path:
        return self.weights_dir / f"step_{step}"

    def is_stable(self, step: int) -> bool:
        return (self.weights_path(step) / STABLE_FILE).is_file()

    @contextlib.contextmanager
    def publish_weights_dir(self, step: int) -> Iterator[Path]:
        """Yield an empty temp dir to save weights into; on success it becomes weights/step_<N>/ + STABLE.

        On an exception the temp dir is removed and nothing is published.
        """
        final = self.weights_path(step)
        if self.is_stable(step):
            raise StepAlreadyCommittedError(f"{final}: weights of step {step} are already published")
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.weights_dir / f".{final.name}{_TMP_MARK}{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        try:
            yield tmp
            for path in sorted(tmp.rglob("*")):
                if path.is_file():
                    _fsync_file(path)
            _fsync_dir(tmp)
            if final.exists():
                shutil.rmtree(final)  # unstable leftover of a crashed publish of this step
            os.replace(tmp, final)
            _fsync_dir(self.weights_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _atomic_write(final / STABLE_FILE, _json_writer({"step": step, "published_at": time.time()}))

    def stable_weight_steps(self) -> list[int]:
        if not self.weights_dir.is_dir():
            return []
        steps = []
        for path in self.weights_dir.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and (path / STABLE_FILE).is_file():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def latest_stable_weights(self) -> tuple[int, Path] | None:
        steps = self.stable_weight_steps()
        return (steps[-1], self.weights_path(steps[-1])) if steps else None


_SUMMED_STATUS = ("inflight", "max_inflight", "started", "ok", "errored", "cancelled", "groups_admitted",
                  "healthy_servers", "groups_out", "groups_in_transit", "groups_emitted", "cancelled_stale_groups")


def merge_status(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's live state from its shards': counts summed, servers listed together, the oldest policy
    version, waiting for the trainer if any shard is, the newest update time."""
    if not shards:
        return {}
    merged = dict(shards[0])
    for key in _SUMMED_STATUS:
        if any(key in s for s in shards):
            merged[key] = sum(s.get(key, 0) for s in shards)
    merged["servers"] = [server for s in shards for server in s.get("servers", [])]
    merged["policy_version"] = min(s.get("policy_version", 0) for s in shards)
    merged["waiting_for_trainer"] = any(s.get("waiting_for_trainer") for s in shards)
    merged["updated_at"] = max(s.get("updated_at", 0.0) for s in shards)
    merged["shards"] = len(shards)
    return merged


class MetricsTail:
    """Reads a metrics.jsonl incrementally: each `read_new` parses only the lines appended since the last.

    A last line without its newline (a writer mid-append) is left for a later call, and so is a last line
    that is not valid JSON (torn by a crash): it is an error only once a line follows it, as in
    `RunDir.read_metrics`. A file shorter than what was read was truncated or replaced: reading restarts.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0  # bytes read: just past the last line consumed
        self._line = 0  # lines consumed, to name a bad line by its number

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as f:
                if os.fstat(f.fileno()).st_size < self.offset:
                    self.offset = self._line = 0
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        *lines, unterminated = data.split(b"\n")
        records = []
        for index, line in enumerate(lines):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    if index == len(lines) - 1 and not unterminated:
                        break  # the file's last line
                    raise ValueError(f"{self.path}:{self._line + 1}: not valid JSON: {exc}") from None
            self.offset += len(line) + 1
            self._line += 1
        return records


def _window_table(window: Sequence[Rollout] | pa.Table) -> pa.Table:
    if isinstance(window, pa.Table):
        return window.select(ROLLOUT_RECORD_SCHEMA.names).cast(ROLLOUT_RECORD_SCHEMA)
    return rollouts_to_table(window)


def _write_arrow_file(f: BinaryIO, table: pa.Table) -> None:
    # IPC *file* format (not stream): it has a footer, so readers can memory-map it and seek to any batch.
    with pa.ipc.new_file(f, table.schema) as writer:
        for record_batch in table.to_batches():
            writer.write_batch(record_batch)


def _json_writer(obj: Any, indent: int | None = None) -> Callable[[BinaryIO], None]:
    data = json.dumps(obj, default=_json_default, indent=indent).encode()
    return lambda f: f.write(data)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def write_atomic(path: Path, data: bytes, overwrite: bool = True) -> None:
    """Write `data` to `path` crash-safely: a reader sees no file or the whole file."""
    if not overwrite and path.exists():
        raise FileExistsError(f"{path} already exists and must not be overwritten")
    _atomic_write(path, lambda f: f.write(data))


def _atomic_write(path: Path, write: Callable[[BinaryIO], Any], fsync_dir: bool = True) -> None:
    """Write via a hidden temp file in the same directory: readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}{_TMP_MARK}{uuid.uuid4().hex[:12]}")
    try:
        with tmp.open("wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync_dir:
        _fsync_dir(path.parent)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    # The rename is durable only once the directory entry is; without this a power loss can undo it.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_temp(path: Path) -> bool:
    # Ours are ".<name>.tmp-<hex>"; also catch ".<name>.<pid>.tmp" from other atomic writers.
    return path.name.startswith(".") and ".tmp" in path.name


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
