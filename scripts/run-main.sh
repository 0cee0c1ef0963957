#!/usr/bin/env bash
# Set up what the main job needs (the venv and Prism: see setup.sh) and run it: the tiny RL run
# (embedded servers, pipeline on Prism, reference trainer).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh prism
exec .venv/bin/beam-rl run configs/tiny.toml "$@"
