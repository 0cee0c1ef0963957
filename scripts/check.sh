#!/usr/bin/env bash
# The static checks (docs/testing.md): ruff's lint and format check, then mypy, over beam_rl/, transforms/,
# runners/ and schemas/ with the settings in ruff.toml and mypy.ini. Needs the venv's test extras
# (scripts/setup.sh). Runs all three, each naming file and line; exits non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=.venv/bin
failed=0
"$bin/ruff" check --quiet --output-format concise . || failed=1
# tests/ and bench/: what breaks when run (syntax errors, undefined names), not the style rules above
"$bin/ruff" check --quiet --isolated --output-format concise --select E9,F63,F7,F82 tests bench || failed=1
"$bin/ruff" format --check --quiet --output-format concise . || { failed=1; echo "(ruff format . rewrites them)"; }
"$bin/mypy" || failed=1
exit "$failed"
