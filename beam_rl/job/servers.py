"""The inference servers of a run: the configured vLLM URLs, or embedded servers started (and
stopped) here, one subprocess each so generation never competes with the pipeline for the GIL."""

from __future__ import annotations

import contextlib
import logging
import subprocess
from collections.abc import Iterator

from beam_rl.model.location import model_dir
from beam_rl.processes import stop_processes
from beam_rl.standin.launch import spawn_subprocess_server, wait_until_ready
from beam_rl.wiring import JobParts

_LOG = logging.getLogger(__name__)


@contextlib.contextmanager
def inference_servers(parts: JobParts) -> Iterator[list[str]]:
    """Yields the base URLs to dispatch to; embedded servers live exactly as long as the block, and
    die with this process however it ends."""
    config = parts.config
    inf = config.inference
    if inf.urls or inf.discovery == "dns":  # a DNS name is the fleet (beam_rl/job/fleet_keeper.py:initial_fleet)
        yield list(inf.urls)
        return
    model = model_dir(config)
    key = parts.api_key  # the run's key guards its embedded servers' API and control routes
    procs: list[subprocess.Popen] = []
    try:
        # All started before any is waited for: each spends seconds importing torch and loading the model.
        for _ in range(inf.embedded_servers):
            procs.append(
                spawn_subprocess_server(
                    model,
                    mode=inf.embedded_mode,
                    max_num_seqs=inf.embedded_max_num_seqs,
                    extra_args=(
                        "--served-model-name",
                        config.model.name,
                        *(("--enable-lora",) if config.trainer.lora is not None else ()),
                    ),
                    die_with_parent=True,
                    api_key=key,
                )
            )
        urls = [wait_until_ready(proc) for proc in procs]
        _LOG.info("started %d embedded inference servers: %s", len(urls), ", ".join(urls))
        yield urls
    finally:
        stop_processes(procs)
