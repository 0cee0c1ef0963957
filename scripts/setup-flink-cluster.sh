#!/usr/bin/env bash
# Idempotent set-up of a standalone Flink distribution that matches the job server's Flink (1.19.0 for
# Beam 2.62.0), taken from the PyPI apache-flink wheel and cached under ~/.cache/beam-rl/flink-cluster.
# The wheel lives in its own virtualenv because apache-flink pins an older Beam; only its Java
# distribution (pyflink/{bin,lib,conf,opt,plugins}, from apache-flink-libraries) is used, so Python
# dependencies are not installed (--no-deps).
# Prints the distribution directory (FLINK_HOME) on the last line of stdout; timings go to stderr.
set -euo pipefail
FLINK_VERSION=${FLINK_CLUSTER_VERSION:-1.19.0}
root=${BEAM_RL_CACHE:-$HOME/.cache/beam-rl}/flink-cluster-$FLINK_VERSION
venv=$root/venv
stamp=$venv/.installed
python=${PYTHON:-python3}
start=$(date +%s)
say() { echo "[setup-flink-cluster] $* ($(( $(date +%s) - start )) s)" >&2; }

if [ ! -f "$stamp" ]; then
  mkdir -p "$root"
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps \
    "apache-flink==$FLINK_VERSION" "apache-flink-libraries==$FLINK_VERSION"
  say "apache-flink $FLINK_VERSION installed"
  home=$("$venv/bin/python" -c "import os, pyflink; print(os.path.dirname(pyflink.__file__))")
  [ -x "$home/bin/jobmanager.sh" ] && [ -x "$home/bin/taskmanager.sh" ] || chmod +x "$home"/bin/*
  ls "$home"/lib/flink-dist*.jar > /dev/null
  echo "$home" > "$stamp"
fi
say "ready"
cat "$stamp"
