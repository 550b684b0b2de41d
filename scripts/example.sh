#!/usr/bin/env bash
# Installs batchgen into .venv and runs the example job on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/batchgen run --input examples/chat.jsonl --output examples/out/chat.results.jsonl "$@"
