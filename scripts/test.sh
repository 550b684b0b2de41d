#!/usr/bin/env bash
# Installs everything into .venv, checks the import layers and runs the test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
# The import contracts in pyproject.toml ([tool.importlinter]): a crossed layer fails the run.
.venv/bin/lint-imports --no-cache
set +e
# Two processes (pytest-xdist): most tests wait on the jobs they start, so two keep a 2-core
# machine busy; the slowest tests are named: the suite must stay ~20 min.
.venv/bin/pytest -q -n 2 --durations=15 "$@"
rc=$?
set -e
# pytest's "no tests collected" (5) must never pass as green.
[ "$rc" -eq 5 ] && { echo "no tests were collected: failing"; exit 1; }
exit "$rc"
