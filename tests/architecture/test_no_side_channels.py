"""No module-level mutable registry carries state or signals between pipeline stages: with workers in
several processes, as on any cluster, such a channel silently stops working. Stages talk through Beam
(elements, state) or the run directory. This scan finds every module-level container the product's code
mutates after binding it; each that exists is explained below (tables filled as modules import, read-only
after). A new one fails here until it is shown to be no channel."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import REPO

PACKAGES = ("beam_rl", "transforms", "runners", "schemas")
_MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "Counter", "deque", "WeakValueDictionary"}

_MUTATORS = {"append", "add", "update", "pop", "popitem", "setdefault", "clear", "extend", "insert", "remove",
             "discard", "__setitem__"}

# name -> why it is not a channel between stages
EXPLAINED = {
    "beam_rl/envs/registry.py:ENVIRONMENTS": "environment classes, registered by decorators as modules import",
    "beam_rl/scoring/advantages.py:ALGORITHMS": "advantage functions, registered by decorators as the module imports",
    "beam_rl/envs/sandbox.py:_netns_checked": "whether this machine allows network namespaces, learned once per "
                                          "process: a fact about the machine, the same in every worker",
}


def _module_level_mutables(path: Path) -> list[str]:
    """Module-level names bound to a mutable container that some statement of the module mutates."""
    tree = ast.parse(path.read_text())
    containers = set()
    for node in tree.body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
            isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", None)) in _MUTABLE_CALLS)
        if mutable:
            containers |= {t.id for t in targets if isinstance(t, ast.Name)}
    mutated = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            for target in getattr(node, "targets", None) or [node.target]:
                if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                    mutated.add(target.value.id)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS:
            if isinstance(node.func.value, ast.Name):
                mutated.add(node.func.value.id)
        elif isinstance(node, ast.Global):
            mutated |= set(node.names)
    return [f"{path.relative_to(REPO)}:{name}" for name in sorted(containers & mutated)]


def test_no_module_level_mutable_state_but_import_time_tables():
    found = [name for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))
             for name in _module_level_mutables(path)]
    unexplained = sorted(set(found) - set(EXPLAINED))
    assert not unexplained, f"module-level mutable containers: {unexplained}"
    assert set(EXPLAINED) <= set(found), "an explained container is gone: drop it from EXPLAINED"


def test_the_scan_finds_what_it_looks_for(tmp_path):
    probe = REPO / "transforms" / "_probe_for_test.py"
    try:
        probe.write_text("from collections import defaultdict\n_MIRRORS: dict = {}\nPACKED = defaultdict(int)\n"
                         "TABLE = {'a': 1}\nOK = (1, 2)\n\ndef note(run, n):\n    PACKED[run] = n\n"
                         "    _MIRRORS.setdefault(run, []).append(n)\n    return TABLE['a']\n")
        assert _module_level_mutables(probe) == ["transforms/_probe_for_test.py:PACKED",
                                                 "transforms/_probe_for_test.py:_MIRRORS"]
    finally:
        probe.unlink()
