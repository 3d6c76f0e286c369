#!/usr/bin/env bash
# One command from a fresh clone: install, then run the bundled CPU quick-start (extra args go to `relax run`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 RAY_USAGE_STATS_ENABLED=0 HF_HUB_OFFLINE=1
exec uv run --frozen relax run "$@"
