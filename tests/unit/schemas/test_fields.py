"""The column declarations: the schemas, the domain classes, the reader and the docs follow them, and a
field added to them reaches the rank file, the reader and the window with no other change."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import textwrap

import pyarrow as pa

from beam_rl.types import Rollout, RolloutRecord, RolloutTokens, Sample, Turn
from schemas import ROLLOUT_RECORD_SCHEMA, TRAIN_BATCH_SCHEMA
from schemas.docs import columns_markdown, with_columns
from schemas.fields import (
    ROLLOUT_FIELDS,
    SAMPLE_FIELDS,
    SHARED_TOKEN_ARRAYS,
    TOKEN_FIELDS,
    TURN_FIELDS,
    TURNS_TYPE,
)
from tests.support.paths import REPO


def test_the_file_schemas_are_the_declarations():
    assert TRAIN_BATCH_SCHEMA.names == [f.name for f in SAMPLE_FIELDS] + [f.name for f in TOKEN_FIELDS]
    for f in TOKEN_FIELDS:
        assert TRAIN_BATCH_SCHEMA.field(f.name).type == pa.list_(f.arrow_type)
    assert ROLLOUT_RECORD_SCHEMA.names == [f.name for f in ROLLOUT_FIELDS]
    assert [(c.name, c.nullable) for c in ROLLOUT_RECORD_SCHEMA] == [(f.name, f.nullable) for f in ROLLOUT_FIELDS]
    assert [c.name for c in TURNS_TYPE.value_type] == [f.name for f in TURN_FIELDS]


def test_the_domain_classes_hold_the_declared_fields():
    sample = {f.name for f in dataclasses.fields(Sample)}
    assert sample == {f.name for f in TOKEN_FIELDS + SAMPLE_FIELDS if not f.written}
    record = {f.name for f in dataclasses.fields(RolloutRecord)}
    assert record == {f.attr for f in ROLLOUT_FIELDS if f.source in ("rollout", "record")} | {"tokens"}
    defaults = {f.name: f.default for f in dataclasses.fields(RolloutRecord)}
    assert defaults["tokens"] is None and defaults["t_packed"] is None  # "record" columns: None until set
    # What a Rollout must carry for its record, and what both compute.
    rollout = {f.name for f in dataclasses.fields(Rollout)}
    assert {f.attr for f in ROLLOUT_FIELDS if f.source == "rollout"} <= rollout
    for f in ROLLOUT_FIELDS:
        if f.source == "computed":
            assert isinstance(getattr(Rollout, f.attr), property), f.attr
            assert isinstance(getattr(RolloutRecord, f.attr), property), f.attr
    # A turn's fields are named as Turn's; its token arrays are RolloutTokens' (and a Sample's).
    assert {f.name for f in TURN_FIELDS} <= {f.name for f in dataclasses.fields(Turn)}
    tokens = {f.name for f in dataclasses.fields(RolloutTokens)}
    assert {f.source for f in TURN_FIELDS} <= tokens and set(SHARED_TOKEN_ARRAYS) <= sample


def test_the_trainer_api_doc_lists_every_declared_column():
    doc = (REPO / "docs" / "trainer-api.md").read_text()
    assert with_columns(doc) == doc, "regenerate the tables: python -m schemas.docs docs/trainer-api.md"
    listed = columns_markdown()
    for f in (*SAMPLE_FIELDS, *TOKEN_FIELDS, *ROLLOUT_FIELDS, *TURN_FIELDS):
        assert f"| `{f.name}` |" in listed and f.meaning in listed


def test_a_field_added_to_the_declarations_reaches_the_rank_file_the_reader_and_the_window(tmp_path):
    """A copy of the code with two lines added to schemas/fields.py, and nothing else changed: a per-token
    field a producer sets (and one it leaves to its fill value), and a per-rollout field set on the record."""
    for package in ("beam_rl", "schemas", "transforms"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    fields = tmp_path / "schemas" / "fields.py"
    source = fields.read_text()
    token_line = "TOKEN_FIELDS: tuple[TokenField, ...] = (\n"
    rollout_line = "ROLLOUT_FIELDS: tuple[RolloutField, ...] = (\n"
    assert source.count(token_line) == 1 and source.count(rollout_line) == 1
    source = source.replace(token_line, token_line + '    TokenField("kv_ages", np.int16, "test", fill=7),\n')
    source = source.replace(rollout_line, rollout_line + '    RolloutField("judge", pa.string(), "test", '
                                                          'source="record", nullable=True),\n')
    fields.write_text(source)
    script = textwrap.dedent("""
        import pickle, numpy as np
        from beam_rl.scoring.advantages import get_algorithm
        from beam_rl.trainer.reader import StepReader
        from beam_rl.rundir import RunDir
        from beam_rl.scoring.samples import samples_from_columns, samples_to_columns
        from beam_rl.scoring.group import score_group
        from beam_rl.types import MicroBatch, Rollout, TrainBatch, Turn
        from transforms import coders

        rollouts = [Rollout("g0", "e", a, 2, prompt_ids=[1, 2], turns=[Turn([3, 4, 5], [-0.5] * 3, "stop")],
                            reward=float(a)) for a in range(2)]
        scored = score_group(rollouts, get_algorithm("grpo"), [], temperature=1.0)
        first, second = scored.samples
        first.kv_ages = np.arange(5, dtype=np.int16)  # a producer that knows the field sets it
        # The coder's size estimate counts the new array too.
        assert coders._sample_bytes(first) == sum(a.nbytes for a in (
            first.input_ids, first.loss_mask, first.advantages, first.logprobs, first.temperatures,
            first.policy_versions, first.kv_ages))
        back = samples_from_columns(pickle.loads(pickle.dumps(samples_to_columns(scored.samples))))
        assert back[0].kv_ages.tolist() == [0, 1, 2, 3, 4] and back[1].kv_ages.tolist() == [7] * 5
        record = scored.rollouts[0]
        record.judge = "passed"
        run = RunDir("run")
        run.write_step(TrainBatch(1, [[MicroBatch(scored.samples)]], ["g0"], {}, rollouts=scored.rollouts))
        (mb,) = StepReader(run).read_step(1)
        assert mb["kv_ages"].tolist() == [0, 1, 2, 3, 4, 7, 7, 7, 7, 7] and mb["kv_ages"].dtype == np.int16
        assert not mb["kv_ages"].flags.writeable  # a view of the mapped file, like every token column
        assert run.read_window(1).column("judge").to_pylist() == ["passed", None]
        print("reached")
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                            env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("reached")
