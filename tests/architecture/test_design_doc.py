"""docs/design.md names real code, and nothing in the repository points outside it."""

from __future__ import annotations

import importlib
import re
import subprocess

import pytest

from tests.support.paths import REPO as ROOT

DESIGN = ROOT / "docs" / "design.md"
_NAME = re.compile(r"`([a-z_][\w.]*):([A-Za-z_][\w.]*)`")  # `module:qualname`


def _names(text: str) -> list[tuple[str, str]]:
    return _NAME.findall(text)


def _concept_table() -> dict[str, str]:
    """The last table of the design doc: concept -> `module:qualname` of the function that holds it."""
    section = DESIGN.read_text().split("## The article's concepts")[1]
    rows = [line.split("|")[1:-1] for line in section.splitlines() if line.startswith("| ")]
    return {cells[0].strip().strip("`"): cells[-1].strip() for cells in rows[1:]}


def _resolve(module: str, qualname: str) -> object:
    value = importlib.import_module(module)
    for part in qualname.split("."):
        value = getattr(value, part)
    return value


def test_every_concept_of_the_article_maps_to_one_function():
    table = _concept_table()
    assert set(table) == {"permits", "group affinity", "open groups first", "version stamps",
                          "exactly-once emission", "add", "process_rollout", "process_group", "process_batch"}
    for concept, cell in table.items():
        names = _names(cell)
        assert len(names) == 1, f"{concept}: {cell}"
        assert callable(_resolve(*names[0])), concept


@pytest.mark.parametrize("module,qualname", sorted(set(_names(DESIGN.read_text()))))
def test_every_name_in_the_design_doc_resolves(module, qualname):
    _resolve(module, qualname)


def test_the_dispatcher_functions_named_are_where_its_rule_comments_are():
    import inspect

    from beam_rl.dispatch import dispatcher

    table = _concept_table()
    for concept in ("permits", "group affinity", "open groups first", "version stamps", "exactly-once emission"):
        source = inspect.getsource(_resolve(*_names(table[concept])[0]))
        assert f"# Rule: {concept}" in source, concept
    assert inspect.getsource(dispatcher).count("# Rule:") == 6  # version stamps has its start and end


def test_every_path_in_the_design_doc_exists():
    paths = re.findall(r"`((?:beam_rl|transforms|runners|schemas|tests|docs|scripts|bench)/[\w./-]*?)(?::\w[\w.]*)?`",
                       DESIGN.read_text())
    assert paths
    missing = [p for p in paths if "<" not in p and not (ROOT / p).exists()]
    assert missing == []


# Built from pieces, so this file does not match itself.
_OUTSIDE = re.compile("|".join(re.escape(s) for s in ("DESIGN" + ".md", "../" + "shared", "shared/" + "seed",
                                                       "/work" + "/", "STYLE" + ".md")))


def test_nothing_in_the_repository_points_outside_it():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    hits = []
    for name in files.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # binary
        hits += [f"{name}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if _OUTSIDE.search(line)]
    assert hits == []
