#!/usr/bin/env bash
# Install everything (uv if missing, then the locked workspace with CPU torch) into ./.venv
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v uv >/dev/null 2>&1; then
  python3 -m pip install --quiet "uv==0.13.9"
fi
export UV_COMPILE_BYTECODE=1
uv sync --frozen "$@"
