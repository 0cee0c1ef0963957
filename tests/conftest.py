"""Session-wide test hooks."""

from __future__ import annotations

import pytest

import children


@pytest.fixture(autouse=True)
def _mark_children():
    children.mark()
