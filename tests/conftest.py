"""Session-wide test hooks."""

from __future__ import annotations

import pytest

import children


@pytest.fixture(autouse=True)
def _mark_children():
    children.mark()


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules that train the tiny model: it gains nothing from intra-op threads, and on a busy
    machine their spin-waits make each forward/backward hundreds of times slower."""
    import torch  # here, not at the top: most test modules never need it

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
