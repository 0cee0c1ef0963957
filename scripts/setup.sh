#!/usr/bin/env bash
# Idempotent set-up: a virtualenv at .venv with beam-rl and its test extras, the Prism binary and the
# Flink job server for the pinned Beam version (both cached under ~/.cache/beam-rl), and the Debian
# packages of the code sandbox (bubblewrap, and a system python3 for the programs it runs).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v bwrap > /dev/null || ! PATH=/usr/local/bin:/usr/bin:/bin command -v python3 > /dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap python3-minimal > /dev/null
  else
    echo "setup: install bubblewrap and python3 (the code sandbox needs them; its tests are skipped)" >&2
  fi
fi
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
