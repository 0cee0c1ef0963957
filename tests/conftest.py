"""Session-wide test hooks."""

from __future__ import annotations

import pytest

from tests.support import children


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


@pytest.fixture(scope="module")
def tok():
    """The tiny ChatML tokenizer (beam_rl.model.tokenizer.load_tokenizer("tiny"))."""
    from beam_rl.model.tokenizer import load_tokenizer

    return load_tokenizer("tiny")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A module's own model cache: its tiny models are built there, not in the user's cache."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def model_dir(cache_dir):
    """The tiny model (seed 0) as a model directory, in the module's cache."""
    from beam_rl.model.tiny import tiny_model_dir

    return tiny_model_dir(0, cache_dir=cache_dir)


@pytest.fixture
def start_embedded():
    """start_embedded(*args, **kwargs): a started EmbeddedServer(*args, **kwargs); every server it
    started is stopped after the test, in the order they were started."""
    from beam_rl.standin.server import EmbeddedServer

    started = []

    def start(*args, **kwargs):
        server = EmbeddedServer(*args, **kwargs)
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
