"""Streaming-foundation figures per runner: bootstrap time (first and cached), pipeline start-up,
element -> batch-file latency (p50/p99), and elements/s through the keyed stateful DoFn.

    python -m bench.throughput.streaming_foundation [--runners direct,flink-local] [--count 20000]

"First" bootstrap builds into an empty $BEAM_RL_CACHE (Go and Maven download caches as they are).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import apache_beam as beam
import numpy as np

from runners import bootstrap
from runners.options import pipeline_options
from bench.throughput.streaming_demo import build_streaming_demo, read_batch_files


def _bootstrap_seconds() -> dict[str, float]:
    figures = {}
    with tempfile.TemporaryDirectory() as cache:
        previous = os.environ.get("BEAM_RL_CACHE")
        os.environ["BEAM_RL_CACHE"] = cache
        try:
            for name, ensure in (("prism", bootstrap.ensure_prism), ("flink_job_server", bootstrap.ensure_flink_job_server)):
                for attempt in ("first", "cached"):
                    started = time.monotonic()
                    ensure()
                    figures[f"{name}_{attempt}_s"] = round(time.monotonic() - started, 3)
        finally:
            if previous is None:
                os.environ.pop("BEAM_RL_CACHE")
            else:
                os.environ["BEAM_RL_CACHE"] = previous
    return figures


def _run(runner: str, count: int, interval_s: float, groups_per_batch: int) -> dict[str, float]:
    out = tempfile.mkdtemp(prefix=f"stream-{runner}-")
    pipeline = beam.Pipeline(options=pipeline_options(runner))
    build_streaming_demo(pipeline, out, count=count, interval_s=interval_s, group_size=4,
                         groups_per_batch=groups_per_batch)
    submitted = time.time()
    pipeline.run().wait_until_finish()
    files = read_batch_files(out)
    emitted = np.concatenate([t.column("emitted_at").to_numpy() for _, t in files])
    written = np.concatenate([np.full(t.num_rows, os.stat(f).st_mtime) for f, t in files])
    latency = written - emitted
    return {
        "startup_s": round(float(emitted.min() - submitted), 3),
        "latency_p50_ms": round(float(np.percentile(latency, 50) * 1e3), 1),
        "latency_p99_ms": round(float(np.percentile(latency, 99) * 1e3), 1),
        "elements_per_s": round(count / float(written.max() - emitted.min()), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runners", default="direct,flink-local")
    parser.add_argument("--count", type=int, default=20000, help="elements for the throughput run")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    figures: dict[str, dict] = {"bootstrap": _bootstrap_seconds()}
    for runner in args.runners.split(","):
        # Paced, one group per file: the latency is the pipeline's, not time spent filling a batch.
        latency = _run(runner, count=200, interval_s=0.02, groups_per_batch=1)
        throughput = _run(runner, count=args.count, interval_s=0.0, groups_per_batch=50)
        figures[runner] = {**latency, "elements_per_s": throughput["elements_per_s"]}
    print(json.dumps(figures, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
