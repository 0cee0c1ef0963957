#!/usr/bin/env bash
# A standalone Flink distribution matching the job server's Flink, cached (runners/bootstrap.py
# ensure_flink_distribution). Prints its directory (FLINK_HOME) on the last line of stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
"$python" -m runners.bootstrap flink-cluster >&2
exec "$python" -c "from runners.bootstrap import ensure_flink_distribution; print(ensure_flink_distribution())"
