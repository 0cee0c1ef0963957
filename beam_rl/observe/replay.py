"""Bit-exact replay of the train sink: each step's scoring, filtering, advantages and packing redone from the
recorded windows with the run's config, and compared with what the run committed.

Rewards are inputs here (they came from environments and judges and are not rerun). The packer's state
between steps is rebuilt from the windows: a window's rows are the groups the packer took since the
previous cut, in the order it took them, each group's rollouts together (BatchBuilder.add).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from beam_rl.config import RunConfig, config_from_dict
from beam_rl.packing.batches import BatchBuilder
from beam_rl.rundir import WINDOW_FILE, CommitRecord, RunDir, rank_file_name
from beam_rl.rundir.arrow import samples_to_table
from beam_rl.scoring.group import GroupScoring
from beam_rl.types import Rollout, RolloutStatus, TrainBatch, Turn
from schemas.commit_record import checksum
from schemas.fields import ROLLOUT_FIELDS
from schemas.train_batch import in_version

# The window columns the sink computes (the others are its inputs).
_REPLAYED_WINDOW_COLUMNS = ("advantage", "filtered")


class ReplayError(ValueError):
    """A step that cannot be replayed from what the run directory holds; the message says what is missing."""


@dataclass(frozen=True)
class Difference:
    """Where a replayed step first differs from a committed file: the file (relative to the run directory),
    the row and column (None where the difference is not in one), both values and what else locates it."""

    file: str
    row: int | None
    column: str | None
    committed: Any
    replayed: Any
    where: str = ""  # e.g. "rollout e0-i3/2, token 17"

    def __str__(self) -> str:
        at = "".join(
            [
                f" row {self.row}" if self.row is not None else "",
                f" column {self.column}" if self.column else "",
                f" ({self.where})" if self.where else "",
            ]
        )
        return f"{self.file}{at}: committed {_show(self.committed)}, replay {_show(self.replayed)}"


@dataclass
class StepReplay:
    """One replayed step: the first difference in each file that differs (in file order: the rank files,
    window.arrow, COMMIT.json), and the rank files whose bytes came out identical."""

    step: int
    differences: list[Difference] = field(default_factory=list)
    identical_files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the replay could not hold against the files

    @property
    def identical(self) -> bool:
        return not self.differences


@dataclass(frozen=True)
class ReplayParts:
    """What a replay runs with, built by the wiring (beam_rl/wiring.py:replay_parts): the run's config, how
    it scored a group, and how its packer starts at a step (checking staleness as the run did)."""

    config: RunConfig
    scoring: GroupScoring
    batch_builder: Callable[[int], BatchBuilder]  # (the step it cuts next) -> a builder holding no group


def run_config(run_dir: RunDir, config: RunConfig | None = None) -> RunConfig:
    """The config a run ran with: `config` when given, else the run directory's config.json."""
    if config is not None:
        return config
    if not run_dir.config_path.is_file():
        raise ReplayError(
            f"{run_dir.path} holds no config.json (a `beam-rl rollouts` run writes none): "
            "give the run's config (--config)"
        )
    return config_from_dict(run_dir.read_config(), source=str(run_dir.config_path))


def staleness_checked(run_dir: RunDir) -> bool:
    """Whether the run's packer checked staleness, as far as the run directory tells: the pipeline checks it
    when a trainer publishes weights (`beam-rl run`, which writes config.json), not for `beam-rl rollouts`
    (which writes none). The run directory records no more than that."""
    return run_dir.config_path.is_file()


def replay_steps(run_dir: RunDir, steps: Iterable[int], parts: ReplayParts) -> Iterator[StepReplay]:
    """Replay `steps` (committed ones) in order. The packer's state before the first is rebuilt from the
    latest step whose incoming state is provably empty (`_fresh_start`), replaying from there."""
    wanted = sorted(set(steps))
    committed = run_dir.committed_steps()
    missing = [s for s in wanted if s not in committed]
    if missing:
        have = f"{committed[0]}..{committed[-1]}" if committed else "none"
        raise ReplayError(f"{run_dir.path}: step {missing[0]} is not committed (committed steps: {have})")
    if not wanted:
        return
    replayer = _Replayer(run_dir, parts)
    start = _fresh_start(run_dir, wanted[0])
    last_committed = committed[-1]
    for step in range(start, wanted[-1] + 1):
        result = replayer.replay(step, final=step == last_committed)
        if step in wanted:
            yield result


def _fresh_start(run_dir: RunDir, step: int) -> int:
    """The latest step <= `step` before which the packer held no groups. It holds none before step 1,
    and none after a step whose window's clean rollouts were all trained (the counts in its commit
    record): a packer that cuts as soon as a batch is full takes every pending group into it."""
    for earlier in range(1, step):
        window = run_dir.read_commit(earlier).window
        clean = window.status.get(RolloutStatus.OK.value, 0) - sum(window.filtered.values())
        if clean != window.trained_rollouts:
            return earlier  # groups may have waited past this cut: replay from here
    return step


class _Replayer:
    """A BatchBuilder fed, step after step, the groups of each window, rescored from their records."""

    def __init__(self, run_dir: RunDir, parts: ReplayParts) -> None:
        self.run_dir = run_dir
        self.config = parts.config
        self._parts = parts
        self._builder: BatchBuilder | None = None

    def replay(self, step: int, final: bool) -> StepReplay:
        record = self.run_dir.read_commit(step)
        window = self.run_dir.read_window(step)
        if self._builder is None or self._builder.next_step != step:
            self._builder = self._parts.batch_builder(step)
        result = StepReplay(step)
        groups = _window_groups(window, self.config, self.run_dir.window_path(step))
        batches: list[TrainBatch] = []
        for i, rollouts in enumerate(groups):
            self.config.env(rollouts[0].env_name)  # one the config does not hold: a KeyError naming those it does
            scored = self._parts.scoring.score(rollouts)
            cut = self._builder.add(scored)
            if cut and i < len(groups) - 1:
                result.differences.append(
                    Difference(
                        self._relative(self.run_dir.commit_path(step)),
                        None,
                        "cut",
                        f"step {step} after the window's last group ({len(groups)} of {len(groups)})",
                        f"step {cut[0].step} after group {i + 1} ({rollouts[0].group_id})",
                        where=f"the packer's cuts; groups in {WINDOW_FILE} order",
                    )
                )
                return result
            batches += cut
        if not batches and final:
            flushed = self._builder.flush()  # the run's last step: the packer cut it at the end of input
            batches = [flushed] if flushed is not None else []
        if len(batches) != 1 or batches[0].step != step:
            made = ", ".join(f"step {b.step}" for b in batches) or "no batch"
            result.differences.append(
                Difference(
                    self._relative(self.run_dir.commit_path(step)),
                    None,
                    "cut",
                    f"step {step} after the window's last group",
                    made,
                )
            )
            return result
        self._compare(batches[0], record, window, result)
        if result.differences:
            result.notes += _reward_precision_note(window)
        return result

    def _compare(self, batch: TrainBatch, record: CommitRecord, window: pa.Table, result: StepReplay) -> None:
        step = batch.step
        commit_file = self._relative(self.run_dir.commit_path(step))
        if len(batch.micro_batches) != record.counts.ranks:
            result.differences.append(
                Difference(commit_file, None, "counts.ranks", record.counts.ranks, len(batch.micro_batches))
            )
        for rank, micro_batches in enumerate(batch.micro_batches[: record.counts.ranks]):
            path, name = self.run_dir.rank_path(step, rank), rank_file_name(rank)
            try:
                committed = path.read_bytes()  # as it is now, unverified: a damaged file is a difference
            except OSError as err:
                result.differences.append(Difference(self._relative(path), None, None, f"unreadable ({err})", "a file"))
                continue
            replayed = in_version(samples_to_table(micro_batches), record.schema_version)
            difference = _compare_rank_file(committed, replayed, self._relative(path))
            if difference is None:
                result.identical_files.append(name)
            else:
                result.differences.append(difference)
            if name in record.files and record.files[name].mismatch(committed):
                result.notes.append(f"{self._relative(path)} does not match its commit record's checksum")
        difference = _compare_window(window, batch, self._relative(self.run_dir.window_path(step)))
        if difference is not None:
            result.differences.append(difference)
        difference = _compare_commit(record, batch, commit_file)
        if difference is not None:
            result.differences.append(difference)

    def _relative(self, path: Path) -> str:
        return str(path.relative_to(self.run_dir.path))


# -- the recorded window as the packer's input --------------------------------------------------------------


def _window_groups(window: pa.Table, config: RunConfig, source: Path) -> list[list[Rollout]]:
    """The window's rollouts as fresh trajectories (what the scoring stage was given: no advantage, no
    filter flag), grouped as the packer took them: each group's rows in a row."""
    rollouts = window_rollouts(window, config, source)
    groups: list[list[Rollout]] = []
    seen: set[str] = set()
    for rollout in rollouts:
        if groups and groups[-1][0].group_id == rollout.group_id:
            groups[-1].append(rollout)
            continue
        if rollout.group_id in seen:
            raise ReplayError(
                f"{source}: the rows of group {rollout.group_id} are not together: not a window the packer wrote"
            )
        seen.add(rollout.group_id)
        groups.append([rollout])
    return groups


_ROLLOUT_COLUMNS = tuple(f for f in ROLLOUT_FIELDS if f.source == "rollout")


def window_rollouts(window: pa.Table, config: RunConfig, source: Any = "<window>") -> list[Rollout]:
    """Every row of a window as the Rollout the scoring stage had: its recorded values and tokens, its
    advantage and filter flag cleared (the sink sets them)."""
    sizes = {env.name: env.group_size for env in config.envs}
    rows = window.select([*(f.name for f in _ROLLOUT_COLUMNS), "prompt_ids", "turns"]).to_pylist()
    rollouts = []
    for i, row in enumerate(rows):
        values = {f.attr: row[f.name] for f in _ROLLOUT_COLUMNS}
        if values["env_name"] not in sizes:
            raise ReplayError(
                f"{source} row {i}: env {values['env_name']!r} is not in the config (envs: {sorted(sizes)})"
            )
        status = RolloutStatus(values.pop("status"))
        if row["prompt_ids"] is None and status is RolloutStatus.OK:
            raise ReplayError(
                f"{source} row {i}: rollout {row['rollout_id']} has no recorded tokens "
                f"({'; '.join(values['errors']) or 'no error given'})"
            )
        values.update(advantage=0.0, filtered=None)
        rollouts.append(
            Rollout(
                **values,
                status=status,
                group_size=sizes[values["env_name"]],
                prompt_ids=row["prompt_ids"] or [],
                turns=[Turn(**turn) for turn in row["turns"] or []],
            )
        )
    return rollouts


# -- comparing ----------------------------------------------------------------------------------------------


def arrow_file_bytes(table: pa.Table) -> bytes:
    """`table` as an Arrow IPC file, one record batch per chunk: the layout the run directory writes."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        for batch in table.to_batches():
            writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _compare_rank_file(actual: bytes, replayed: pa.Table, name: str) -> Difference | None:
    """None when the committed file holds exactly the replayed bytes; else its first difference, column by
    column (or the first differing byte when every column is equal)."""
    expected = arrow_file_bytes(replayed)
    if actual == expected:
        return None
    try:
        committed = pa.ipc.open_file(pa.py_buffer(actual)).read_all()
    except (pa.ArrowInvalid, pa.ArrowIOError) as err:
        return Difference(name, None, None, f"not a readable Arrow file ({err})", f"{len(expected)} bytes")
    difference = first_table_difference(committed, replayed, name)
    if difference is not None:
        return difference
    offset = next((i for i, (a, b) in enumerate(zip(actual, expected)) if a != b), min(len(actual), len(expected)))
    return Difference(
        name,
        None,
        None,
        f"{len(actual)} bytes (xxh3_128 {checksum(actual)})",
        f"{len(expected)} bytes (xxh3_128 {checksum(expected)})",
        where=f"every column equal; bytes differ from offset {offset}",
    )


def first_table_difference(committed: pa.Table, replayed: pa.Table, name: str) -> Difference | None:
    """The first row (then the first column in schema order) where two tables of a rank file's schema
    differ, floats compared bit for bit."""
    for i, (a, b) in enumerate(zip(committed.schema, replayed.schema)):
        if a.name != b.name or a.type != b.type:
            return Difference(name, None, f"#{i}", f"{a.name}: {a.type}", f"{b.name}: {b.type}")
    if len(committed.schema) != len(replayed.schema):
        return Difference(name, None, None, f"{len(committed.schema)} columns", f"{len(replayed.schema)} columns")
    rows = min(committed.num_rows, replayed.num_rows)
    first: tuple[int, int, str] | None = None  # (row, token or -1, column)
    for column in committed.schema.names:
        a, b = (_one_chunk(t.column(column)) for t in (committed, replayed))
        if a.slice(0, rows).equals(b.slice(0, rows)):
            continue  # NaNs compare unequal here: the bitwise check below decides
        found = _first_in_column(a, b, rows)
        if found is not None and (first is None or found[0] < first[0]):
            first = (*found, column)
    if first is None:
        if committed.num_rows != replayed.num_rows:
            return Difference(name, rows, None, f"{committed.num_rows} rows", f"{replayed.num_rows} rows")
        return None
    row, token, column = first
    a, b = (_one_chunk(t.column(column)) for t in (committed, replayed))
    where = [f"rollout {committed.column('rollout_id')[row].as_py()}"] if "rollout_id" in committed.schema.names else []
    if token >= 0:
        a_values, b_values = a[row].as_py(), b[row].as_py()
        if len(a_values) != len(b_values):
            return Difference(name, row, column, f"{len(a_values)} tokens", f"{len(b_values)} tokens", ", ".join(where))
        where.append(f"token {token}")
        return Difference(
            name,
            row,
            column,
            _typed(a_values[token], a.type.value_type),
            _typed(b_values[token], b.type.value_type),
            ", ".join(where),
        )
    return Difference(
        name, row, column, _typed(a[row].as_py(), a.type), _typed(b[row].as_py(), b.type), ", ".join(where)
    )


def _one_chunk(column: pa.ChunkedArray) -> pa.Array:
    return pa.concat_arrays(column.chunks) if column.num_chunks else pa.array([], column.type)


def _first_in_column(a: pa.Array, b: pa.Array, rows: int) -> tuple[int, int] | None:
    """(row, token) of the first difference among the first `rows` rows; token -1 for a scalar column
    or a row whose token count differs."""
    if pa.types.is_list(a.type):
        a_offsets, b_offsets = a.offsets.to_numpy(), b.offsets.to_numpy()
        a_values, b_values = _bits(a.values), _bits(b.values)
        for row in range(rows):
            x = a_values[a_offsets[row] : a_offsets[row + 1]]
            y = b_values[b_offsets[row] : b_offsets[row + 1]]
            if len(x) != len(y):
                return row, -1
            unequal = np.flatnonzero(x != y)
            if unequal.size:
                return row, int(unequal[0])
        return None
    x, y = _bits(a.slice(0, rows)), _bits(b.slice(0, rows))
    unequal = np.flatnonzero(np.asarray(x != y))
    return (int(unequal[0]), -1) if unequal.size else None


def _bits(array: pa.Array) -> np.ndarray:
    """Values to compare exactly: floats as their bit patterns (a NaN equals itself, -0.0 is not 0.0)."""
    if pa.types.is_floating(array.type):
        values = array.to_numpy(zero_copy_only=False)
        return values.view(np.dtype(f"u{values.dtype.itemsize}"))
    if pa.types.is_integer(array.type) or pa.types.is_boolean(array.type):
        return array.to_numpy(zero_copy_only=False)
    return np.array(array.to_pylist(), dtype=object)


def _compare_window(window: pa.Table, batch: TrainBatch, name: str) -> Difference | None:
    """The window columns the sink computes (advantage, filter flag), row by row in window order."""
    replayed = batch.rollouts
    committed_ids = window.column("rollout_id").to_pylist()
    replayed_ids = [r.rollout_id for r in replayed]
    for row, (committed_id, replayed_id) in enumerate(zip(committed_ids, replayed_ids)):
        if committed_id != replayed_id:
            return Difference(name, row, "rollout_id", committed_id, replayed_id)
    if len(committed_ids) != len(replayed_ids):
        return Difference(name, None, None, f"{len(committed_ids)} rows", f"{len(replayed_ids)} rows")
    values = {
        "advantage": (
            window.column("advantage").to_numpy().view(np.uint32),
            np.array([r.advantage for r in replayed], dtype=np.float32).view(np.uint32),
        ),
        "filtered": (
            np.array(window.column("filtered").to_pylist(), dtype=object),
            np.array([r.filtered for r in replayed], dtype=object),
        ),
    }
    first = None
    for column in _REPLAYED_WINDOW_COLUMNS:
        a, b = values[column]
        unequal = np.flatnonzero(a != b)
        if unequal.size and (first is None or unequal[0] < first[0]):
            first = (int(unequal[0]), column)
    if first is None:
        return None
    row, column = first
    committed = window.column(column)[row].as_py()
    replay = getattr(replayed[row], column)
    if column == "advantage":
        committed, replay = np.float32(committed), np.float32(replay)
    return Difference(name, row, column, committed, replay, where=f"rollout {committed_ids[row]}")


def _compare_commit(record: CommitRecord, batch: TrainBatch, name: str) -> Difference | None:
    """The groups trained, in packing order, then the window statistics the packer computed."""
    if record.group_ids != list(batch.group_ids):
        index = next(
            (i for i, (a, b) in enumerate(zip(record.group_ids, batch.group_ids)) if a != b),
            min(len(record.group_ids), len(batch.group_ids)),
        )
        return Difference(name, None, f"group_ids[{index}]", _at(record.group_ids, index), _at(batch.group_ids, index))
    stats = record.window.model_dump(mode="json")
    replayed = json.loads(json.dumps(batch.window))
    for key, value in replayed.items():
        if stats.get(key) != value:
            return Difference(name, None, f"window.{key}", stats.get(key), value)
    return None


def _reward_precision_note(window: pa.Table) -> list[str]:
    """A window of schema version 2 keeps rewards as float32 while the sink scored their float64 values: a
    reward such as 0.1 comes back as 0.10000000149011612, and advantages and reward means computed from it
    can differ in their last bit. Said when some recorded reward is not the float64 its shortest decimal
    spells (version 3 records float64 rewards: nothing to say)."""
    rewards = window.column("reward")
    if not pa.types.is_float32(rewards.type):
        return []
    rounded = next((r for r in rewards.to_numpy() if float(str(r)) != float(r)), None)
    if rounded is None:
        return []
    return [
        f"rewards are recorded as float32 (e.g. {rounded!s} is stored as {float(rounded)!r}) and the run scored "
        "their float64 values: advantages and reward means replayed from them can differ in the last bit"
    ]


def _at(values: Sequence[Any], index: int) -> Any:
    return values[index] if index < len(values) else "(none)"


def _typed(value: Any, arrow_type: pa.DataType) -> Any:
    """A float32 value as numpy's float32, so it prints with the digits that tell it from its neighbours."""
    if value is not None and pa.types.is_float32(arrow_type):
        return np.float32(value)
    return value


def _show(value: Any) -> str:
    if isinstance(value, np.floating):
        return f"{value!s} (0x{value.view(np.dtype(f'u{value.itemsize}')):0{2 * value.itemsize}x})"
    return repr(value) if isinstance(value, str) else str(value)
