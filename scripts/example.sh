#!/usr/bin/env bash
# Installs batchgen into .venv and runs the example job on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
# setuptools warns on every editable install that a folder named like the package in the
# working directory shadows it on import: here that folder is the package itself.
PYTHONWARNINGS="ignore:Editable installation" bash scripts/install.sh
.venv/bin/batchgen run -i examples/chat.jsonl -o examples/out/chat.results.jsonl "$@"
echo "batchgen is in .venv/bin: \`source .venv/bin/activate\` puts it on your PATH" \
     "(e.g. \`batchgen status examples/out/chat.results.jsonl\`)"
