#!/usr/bin/env bash
# Idempotent set-up: a virtualenv at .venv with beam-rl and its test extras, the Prism binary and the
# Flink job server for the pinned Beam version (both cached under ~/.cache/beam-rl).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
stamp=.venv/.beam-rl-installed
want=$(cat setup.py | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/pip install --quiet --upgrade pip
  .venv/bin/pip install --quiet -e ".[test]"
  echo "$want" > "$stamp"
fi
.venv/bin/python -m runners.bootstrap
