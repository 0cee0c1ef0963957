#!/usr/bin/env bash
# Idempotent, cached set-up of what a command needs; every step says what it does and what it took.
#   scripts/setup.sh [PART...]   the virtualenv .venv (beam-rl and its test extras) always, and:
#     prism     the Prism binary (Go), built while the virtualenv installs       (scripts/run-main.sh)
#     flink     the Flink job server (Maven) and a standalone Flink distribution
#               (PyPI apache-flink), for the tests and Flink runners             (scripts/test.sh)
#     sandbox   bubblewrap and a system python3 for the code environment's sandbox (scripts/test.sh)
# Runner binaries are cached under ~/.cache/beam-rl, downloads under ~/.cache/uv and ~/go.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
beam=$(sed -n 's/^BEAM_VERSION = "\(.*\)"$/\1/p' setup.py)  # setup.py's pin: the SDK the venv gets
start=$(date +%s)
say() { echo "[setup] $*" >&2; }
since() { echo "$(( $(date +%s) - $1 )) s"; }

sandbox() {
  if command -v bwrap > /dev/null && PATH=/usr/local/bin:/usr/bin:/bin command -v python3 > /dev/null; then
    return
  fi
  if [ "$(id -u)" != 0 ] || ! command -v apt-get > /dev/null; then
    say "install bubblewrap and python3 (the code sandbox needs them; its tests are skipped)"
    return
  fi
  local t; t=$(date +%s)
  say "sandbox: installing bubblewrap and python3-minimal (apt) ..."
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap python3-minimal > /dev/null
  say "sandbox: ready ($(since "$t"))"
}

venv() {
  local stamp=.venv/.beam-rl-installed want t
  want=$(cat setup.py scripts/overrides.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)
  [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && return
  t=$(date +%s)
  [ -x .venv/bin/python ] || "$python" -m venv .venv
  # uv downloads in parallel: 64 s instead of pip's 353 s for these ~3.5 GB on an empty cache.
  [ -x .venv/bin/uv ] || .venv/bin/pip install --quiet --disable-pip-version-check "uv>=0.13,<0.14"
  say "venv: installing beam-rl and its dependencies (~3.5 GB on an empty cache) ..."
  # --compile-bytecode, as pip does: otherwise each of the job's processes compiles torch and
  # transformers on its first import (13.7 s instead of 6.4 s here), and every time where Python may
  # not write bytecode.
  .venv/bin/uv pip install --python .venv/bin/python --override scripts/overrides.txt --compile-bytecode -e ".[test]"
  # A venv made before the override still holds triton: uv does not remove what it no longer needs.
  .venv/bin/uv pip uninstall --quiet --python .venv/bin/python triton
  echo "$want" > "$stamp"
  say "venv: ready ($(since "$t"))"
}

# The parts need nothing from the venv (bootstrap runs on the system python3), so they run beside it.
pids=()
for part in "$@"; do
  case $part in
    prism) "$python" -m runners.bootstrap prism --beam-version "$beam" & pids+=($!) ;;
    flink) "$python" -m runners.bootstrap flink-job-server flink-cluster --beam-version "$beam" & pids+=($!) ;;
    sandbox) sandbox & pids+=($!) ;;
    *) say "unknown part '$part' (prism, flink, sandbox)"; exit 2 ;;
  esac
done
venv
failed=0
for pid in "${pids[@]}"; do
  wait "$pid" || failed=1
done
[ "$failed" = 0 ] || { say "a part failed (above)"; exit 1; }
say "ready ($(since "$start"))"
