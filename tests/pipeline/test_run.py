"""The main job (`beam_rl/job/run.py`): the live table at 80 and 160 columns; a rollout job left running by
a dead submitter followed instead of a second one submitted; the run observer fed while the job runs."""

from __future__ import annotations

import io
import re
import threading
import time

import httpx
import pytest
from rich.console import Console

from beam_rl.config import load_config
from beam_rl.observe import RunObserver
from beam_rl.observe.report import LIVE_COLUMNS, STEP_COLUMNS
from beam_rl.processes import free_port
from beam_rl.rundir import RunDir
from beam_rl.standin.server import EmbeddedServer
from beam_rl.job import live, run as job_module
from beam_rl.job.rollouts import start_rollouts
from tests.unit.observe.test_live_table import commit, dispatch, trainer

TINY = "configs/tiny.toml"


def _rendered(run: RunDir, width: int) -> list[str]:
    config = load_config(TINY)
    console = Console(file=io.StringIO(), width=width, color_system=None)
    observer = RunObserver(run, config)
    try:
        console.print(live.ProgressView(run, config, time.monotonic(), observer, console).render())
    finally:
        observer.close()
    return console.file.getvalue().splitlines()


def _headers(lines: list[str]) -> list[str]:
    """The column headers: the first row of cells under the table's top border."""
    top = next(i for i, line in enumerate(lines) if line.lstrip().startswith("┏"))
    return [cell.strip() for cell in lines[top + 1].strip().strip("┃").split("┃")]


@pytest.fixture
def run_with_steps(tmp_path):
    run = RunDir(tmp_path / "a-run-directory-with-a-long-name")
    for step in range(1, 15):
        dispatch(run, step % 4)
        commit(run, step)
        trainer(run, step, -1 / (step * 7))
    run.write_status({"policy_version": 13, "inflight": 64, "servers": [
        {"url": "http://127.0.0.1:40001", "inflight": 32, "running": 30, "waiting": 2},
        {"url": "http://127.0.0.1:40002", "inflight": 32, "running": 31, "waiting": 1}]})
    return run


def test_the_live_table_fits_80_columns_with_whole_headers_and_shows_more_at_160(run_with_steps):
    narrow, wide = _rendered(run_with_steps, 80), _rendered(run_with_steps, 160)
    for lines, width in ((narrow, 80), (wide, 160)):
        assert all(len(line) <= width for line in lines)
        assert not any("…" in line for line in lines), "\n".join(lines)
        headers = _headers(lines)
        assert headers == [h for h in STEP_COLUMNS if h in headers]  # whole, one line each, in order
        assert set(headers) == set(LIVE_COLUMNS[:len(headers)])  # the most wanted ones
    assert set(_headers(narrow)) < set(_headers(wide))
    assert len(_headers(narrow)) >= 6 and set(_headers(wide)) == set(LIVE_COLUMNS)
    # The last 12 steps, each on one line; the title and the servers' load are there too.
    steps = [int(m.group(1)) for line in narrow if (m := re.match(r"\s*│\s+(\d+)\s+│", line))]
    assert steps == list(range(3, 15))
    text = " ".join(line.strip() for line in narrow)
    assert "step 14 of 20" in text and "policy v13" in text and "127.0.0.1:40002: 32 in flight" in text


_CONFIG = """
[run]
dir = "{run_dir}"
max_steps = 3
[model]
max_context = 256
[inference]
urls = [{urls}]
max_tokens = 8
max_inflight = 32
[[envs]]
name = "reverse_text"
group_size = 4
epochs = 5
[batch]
rollouts_per_step = 16
seq_len = 256
[trainer]
kind = "none"
[logging]
prometheus_port = {port}
prometheus_host = "127.0.0.1"
[logging.tensorboard]
enabled = true
"""


def _scrape_then_resume(port: int, urls: list[str], seen: list[str], stop: threading.Event) -> None:
    """Scrape the run observer while the servers hold every request, then let the job go on: the job cannot
    end (and close the endpoint) before it was scraped, however slow or fast the machine."""
    deadline = time.monotonic() + 120
    try:
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1).text
                if "beam_rl_permits_capacity" in text:
                    seen.append(text)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    finally:
        for url in urls:
            httpx.post(f"{url}/resume", timeout=5).raise_for_status()


def test_a_job_left_running_is_followed_not_submitted_again_and_the_run_is_observed(tmp_path, monkeypatch):
    servers = [EmbeddedServer(mode="instant") for _ in range(2)]
    urls = [s.start() for s in servers]
    port, scraped, stop = free_port(), [], threading.Event()
    for url in urls:
        httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=5).raise_for_status()
    scraper = threading.Thread(target=_scrape_then_resume, args=(port, urls, scraped, stop))
    try:
        path = tmp_path / "run.toml"
        path.write_text(_CONFIG.format(run_dir=tmp_path / "run", urls=", ".join(f'"{u}"' for u in urls), port=port))
        config = load_config(str(path))
        # The job an earlier submitter left running (no trainer: it needs no published weights).
        left_running = start_rollouts(config, urls, str(config.run.dir), with_trainer=False)
        attached: list[str] = []

        def attach(config, run_dir, with_trainer=True, parts=None):
            attached.append(run_dir)
            return left_running

        def submit(*args, **kwargs):
            raise AssertionError("a second rollout job was submitted")

        monkeypatch.setattr(job_module, "attach_rollouts", attach)
        monkeypatch.setattr(job_module, "start_rollouts", submit)
        out = io.StringIO()
        scraper.start()
        run_dir = job_module.run_job(config, Console(file=out, width=120))
    finally:
        stop.set()
        for server in servers:
            server.stop()
    assert attached == [str(config.run.dir)]
    assert run_dir.committed_steps() == [1, 2, 3]
    assert "following the rollout job still running" in out.getvalue()
    # The run observer: Prometheus served from logging.prometheus_port while the job ran, and closed
    # with it; every committed step logged to TensorBoard.
    scraper.join(timeout=5)
    assert scraped and "beam_rl_permits_capacity 32.0" in scraped[0]
    assert re.search(r"^beam_rl_permits_in_use [1-9]", scraped[0], re.M), scraped[0]  # scraped mid-run
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir.path / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("rollouts/step")] == [1, 2, 3]


def test_a_run_whose_input_ends_before_max_steps_ends_with_every_step_trained(tmp_path):
    """8 prompts of 4 rollouts, 16 a step: the input ends with step 2 of max_steps 1000. `beam-rl run`
    returns (the reference trainer stops once it has trained the last step) instead of waiting for step 3."""
    import subprocess
    import sys

    from tests.support.small_run import write_small_run_config

    config = write_small_run_config(tmp_path / "run.toml", tmp_path / "run", max_steps=1000, epochs=1)
    config.write_text(config.read_text().replace('name = "reverse_text"\n', 'name = "reverse_text"\nlimit = 8\n'))
    done = subprocess.run([sys.executable, "-m", "beam_rl.cli", "run", str(config)], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = RunDir(tmp_path / "run")
    assert run.committed_steps() == [1, 2] and run.input_last_step() == 2
    assert run.stable_weight_steps() == [1, 2]
