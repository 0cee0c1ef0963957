"""setup.py ships what exists: every package_data pattern matches files of its package."""

from __future__ import annotations

import ast

from tests.support.paths import REPO as ROOT


def _package_data() -> dict[str, list[str]]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "package_data":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no package_data")


def test_every_package_data_pattern_matches_a_file():
    data = _package_data()
    assert data
    empty = [f"{package}: {pattern}" for package, patterns in data.items() for pattern in patterns
             if not any((ROOT / package).glob(pattern))]
    assert empty == []
