"""Every port a run opens listens on loopback unless a setting opens it on purpose: the listeners of a real
`beam-rl run` on `direct` and `flink-local` (its process tree's, from /proc/net/tcp{,6}), the defaults
that put them there, and the warning a port opened beyond loopback logs."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest

from beam_rl.config import config_from_dict
from beam_rl.listeners import is_loopback, warn_if_open
from beam_rl.processes import free_port, tree_pids
from tests.support.proc_net import listeners
from tests.support.small_run import write_small_run_config


def _run_listeners(tmp_path, runner: str) -> set:
    """The listeners a one-step `beam-rl run` on `runner` held while it ran (Prometheus on, at its default
    host), polled until the run ends."""
    config = write_small_run_config(tmp_path / "run.toml", tmp_path / "run", max_steps=1, epochs=1)
    config.write_text(config.read_text() + f'[runner]\nname = "{runner}"\n[logging]\nprometheus_port = {free_port()}\n')
    output = tmp_path / "output.txt"  # a file, not a pipe nobody reads while the run goes on
    with open(output, "wb") as out:
        run = subprocess.Popen([sys.executable, "-m", "beam_rl.cli", "run", str(config)], stdout=out,
                               stderr=subprocess.STDOUT)
    seen = set()
    try:
        while run.poll() is None:
            seen |= listeners(tree_pids(run.pid))
            time.sleep(0.1)
    finally:
        if run.poll() is None:
            run.kill()
        run.wait()
    assert run.returncode == 0, output.read_text(errors="replace")[-3000:]
    return seen


@pytest.mark.parametrize("runner, job_service", [("direct", "prism"), ("flink-local", "java")])
def test_a_run_listens_on_loopback_only(tmp_path, runner, job_service):
    """Before: Prism's job service (`*:port`), Beam's LOOPBACK worker pool (`[::]:port`), Prometheus
    (0.0.0.0) and, on flink-local, ten ports of the job server's JVM (its job and artifact services, the
    workers' FnAPI servers, the embedded Flink's BLOB server and REST endpoint) listened on every interface."""
    seen = _run_listeners(tmp_path, runner)
    assert any(job_service in listener.owner for listener in seen), sorted(map(str, seen))  # the runner's seen
    assert any("beam_rl.cli" in listener.owner for listener in seen)  # the worker pool, Prometheus
    beyond = sorted(str(listener) for listener in seen if not listener.on_loopback)
    assert beyond == [], beyond


def test_every_port_setting_defaults_to_loopback():
    config = config_from_dict({"envs": [{"name": "reverse_text"}]})
    assert is_loopback(config.runner.bind_host)
    assert is_loopback(config.logging.prometheus_host)


@pytest.mark.parametrize("host, warned", [("127.0.0.1", False), ("localhost", False), ("::1", False),
                                          ("127.0.0.2", False), ("0.0.0.0", True), ("::", True),
                                          ("", True), ("10.1.2.3", True), ("node-7", True)])
def test_a_port_opened_beyond_loopback_warns_naming_it(caplog, host, warned):
    with caplog.at_level(logging.WARNING, logger="beam_rl.listeners"):
        warn_if_open(host, 9464, "Prometheus /metrics", "logging.prometheus_host")
    messages = [record.getMessage() for record in caplog.records]
    if warned:
        [message] = messages
        assert "port 9464" in message and "Prometheus /metrics" in message and "logging.prometheus_host" in message
        assert "\n" not in message
    else:
        assert messages == []
