#!/usr/bin/env bash
# Set up (see setup.sh) and run the main job: the tiny CPU run on embedded inference servers.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/beam-rl rollouts --config configs/tiny.toml "$@"
