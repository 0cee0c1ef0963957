"""Where the tests find the repository, their fixtures and the programs they run, wherever a test file sits."""

from __future__ import annotations

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
REPO = SUPPORT.parents[1]
FIXTURES = REPO / "tests" / "fixtures"
AGENTS = SUPPORT / "agents"
