#!/usr/bin/env bash
# Set up (see setup.sh) and run the main job: the tiny RL run (embedded servers, pipeline, trainer).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/beam-rl run configs/tiny.toml "$@"
