"""The declared columns as Markdown tables, kept in docs/trainer-api.md between two markers:
`python -m schemas.docs docs/trainer-api.md` rewrites them from schemas/fields.py."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pyarrow as pa

from schemas.fields import ROLLOUT_FIELDS, SAMPLE_FIELDS, TOKEN_FIELDS, TURN_FIELDS, numpy_dtype

DOC_BEGIN = "<!-- columns: generated from schemas/fields.py by `python -m schemas.docs docs/trainer-api.md` -->"
DOC_END = "<!-- end of the generated columns -->"


def columns_markdown() -> str:
    """Markdown tables of every declared column, for docs/trainer-api.md."""
    lines = [
        "`rank_<R>.arrow`, one row per sample; the reader's name for each column's values in a micro-batch:",
        "",
        "| column | type | reader | meaning |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{f.name}` | `{_type_name(f.arrow_type)}` | `{f.key}` | {f.meaning} |" for f in SAMPLE_FIELDS]
    lines += [
        f"| `{f.name}` | `list<{_type_name(f.arrow_type)}>` | `{f.name}`"
        f"{' (bool)' if f.dtype == np.bool_ else ''} | {f.meaning} |"
        for f in TOKEN_FIELDS
    ]
    lines += [
        "",
        "`window.arrow`, one row per rollout seen since the previous step:",
        "",
        "| column | type | meaning |",
        "|---|---|---|",
    ]
    lines += [
        f"| `{f.name}` | `{_type_name(f.arrow_type)}`{'' if f.nullable else ', not null'} | {f.meaning} |"
        for f in ROLLOUT_FIELDS
    ]
    lines += ["", "Each struct of `turns`:", "", "| field | type | meaning |", "|---|---|---|"]
    lines += [f"| `{f.name}` | `{_type_name(f.column_type)}` | {f.meaning} |" for f in TURN_FIELDS]
    return "\n".join(lines)


def with_columns(doc: str) -> str:
    """`doc` with the text between DOC_BEGIN and DOC_END replaced by columns_markdown()."""
    head, begin, rest = doc.partition(DOC_BEGIN)
    _, end, tail = rest.partition(DOC_END)
    if not (begin and end):
        raise ValueError(f"the document has no {DOC_BEGIN!r} ... {DOC_END!r} section")
    return f"{head}{DOC_BEGIN}\n{columns_markdown()}\n{DOC_END}{tail}"


def _type_name(arrow_type: pa.DataType) -> str:
    if pa.types.is_list(arrow_type):
        return f"list<{_type_name(arrow_type.value_type)}>"
    if pa.types.is_struct(arrow_type):
        return "struct"
    try:
        return numpy_dtype(arrow_type).name
    except KeyError:
        return str(arrow_type)


if __name__ == "__main__":
    for name in sys.argv[1:] or sys.exit("usage: python -m schemas.docs DOC.md ...  (rewrites its column tables)"):
        Path(name).write_text(with_columns(Path(name).read_text()))
