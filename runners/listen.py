"""The address the ports a job opens listen on (`runner.bind_host`, loopback by default), handed to the
runner classes through the pipeline options, and the LOOPBACK environment's worker pool on it.

Beam 2.70 starts a LOOPBACK environment's worker pool (the SDK harness of the submitting process) on every
interface (`worker_pool_main.py`: `'[::]:%s'`); a pool hands out workers that run the pickled code they
are sent. `LoopbackOnHost` starts it with `runners.workers.start_pool` on `--bind_host` instead, for Prism
(`runners.prism.PrismPerJob`) and Flink (`FlinkOnHost`).
"""

from __future__ import annotations

import copy
import functools

from apache_beam.options.pipeline_options import DebugOptions, PipelineOptions, PortableOptions
from apache_beam.portability import python_urns
from apache_beam.runners.portability import flink_runner
from apache_beam.runners.worker import sdk_worker_main
from apache_beam.transforms import environments

from beam_rl.listeners import LOOPBACK
from runners.workers import start_pool


class ListenOptions(PipelineOptions):
    @classmethod
    def _add_argparse_args(cls, parser):  # type: ignore[no-untyped-def]
        parser.add_argument(
            "--bind_host",
            default=LOOPBACK,
            help="the address the job's ports (job service, worker pool) listen on; loopback unless "
            "a wider one is asked for",
        )


def bind_host(options: PipelineOptions) -> str:
    return options.view_as(ListenOptions).bind_host


class LoopbackOnHost:
    """A portable runner whose LOOPBACK environments' worker pool listens on `--bind_host`."""

    @staticmethod
    def start_and_replace_loopback_environments(pipeline, options):  # type: ignore[no-untyped-def]
        # Beam's PortableRunner method of this name, with the pool started by start_pool on bind_host.
        portable_options = copy.deepcopy(options.view_as(PortableOptions))
        debug = options.view_as(DebugOptions)
        cleanup_callbacks = []
        for env in pipeline.components.environments.values():
            if env.urn != python_urns.EMBEDDED_PYTHON_LOOPBACK:
                continue
            endpoint, server, _ = start_pool(
                bind_host(options),
                use_process=debug.lookup_experiment("use_loopback_process_worker", False),
                state_cache_size=sdk_worker_main._get_state_cache_size_bytes(options=options),
                data_buffer_time_limit_ms=sdk_worker_main._get_data_buffer_time_limit_ms(debug.experiments or []),
            )
            portable_options.environment_type = "EXTERNAL"
            portable_options.environment_config = endpoint
            external = environments.ExternalEnvironment.from_options(portable_options).to_runner_api(None)  # type: ignore[arg-type]  # no context: as Beam's own callers
            env.urn, env.payload = external.urn, external.payload
            cleanup_callbacks.append(functools.partial(server.stop, 1))
        return cleanup_callbacks


class FlinkOnHost(LoopbackOnHost, flink_runner.FlinkRunner):
    """Beam's FlinkRunner, its LOOPBACK worker pool on `--bind_host`."""
