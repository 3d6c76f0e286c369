#!/usr/bin/env bash
# One command for the whole test suite (installs first; extra args go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled \
       HF_HUB_OFFLINE=1 WANDB_MODE=offline OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false \
       PYTHONFAULTHANDLER=1  # a crash (even at interpreter exit, after pytest's own handler is gone) prints every thread's stack
exec uv run --frozen pytest "$@"
