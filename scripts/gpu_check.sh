#!/usr/bin/env bash
# The prepared GPU check: on a machine with one NVIDIA GPU, build what the GPU paths need and run them all.
#
#   bash scripts/gpu_check.sh            # build (or reuse) the envs, run every step, print one table
#   bash scripts/gpu_check.sh --dry-run  # on any machine: list the steps, check their prerequisites, exit 0
#   bash scripts/gpu_check.sh --no-build # reuse $RELAX_CUDA_VENV and $RELAX_SGLANG_PYTHON as they are
#
# Steps (each under its own timeout; the whole check targets <= 9 minutes on an H200, warm package cache):
#   1. build   the workspace with CUDA torch (the lock's `cuda` group) into $RELAX_CUDA_VENV (.venv-cuda),
#              and a CUDA SGLang server env (sglang==<the release the server patches target> + sglang-router)
#              unless RELAX_SGLANG_PYTHON points at one
#   2. tests   every `-m gpu` test (tests needing 2 GPUs skip themselves), one table row each
#   3. grpo    20 colocated GRPO steps on the quick-start task: megatron trainer bf16 + SGLang engine +
#              sglang_tensor (scripts/gpu_check/colocate_megatron_sglang.yaml)
#   4. bench   bench/megatron.py (MFU on a Qwen3-0.6B-shaped model) and bench/sglang.py --device cuda
#              --qwen3-0.6b (SGLang vs HF engine tokens/s): their headline lines
# Output: $OUT (the device runner's folder) or runs/gpu-check: one log per step and table.txt.
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
dry_run=0 build=1
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry_run=1 ;;
    --no-build) build=0 ;;
    *) echo "gpu_check.sh: unknown argument $arg (--dry-run, --no-build)" >&2; exit 2 ;;
  esac
done
out="${OUT:-$repo/runs/gpu-check}"
mkdir -p "$out"
table="$out/table.txt"
: > "$out/rows.tsv"

export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 \
  WANDB_MODE=offline TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

guard=packages/relax-sglang/src/relax/sglang/server_site/relax_sglang_version_guard.py
sglang_version="$(sed -n 's/^PATCHED_FOR = "\([^"]*\)".*/\1/p' "$guard")"
router_version="0.3.2"
grpo_config=scripts/gpu_check/colocate_megatron_sglang.yaml
cuda_venv="${RELAX_CUDA_VENV:-$repo/.venv-cuda}"
sglang_env="${RELAX_SGLANG_GPU_ENV:-$HOME/.cache/relax/sglang-gpu-$sglang_version}"
gpu_test_files=$(grep -rlE "mark\.gpu" packages/*/tests integration_tests --include='*.py' | sort)

row() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$out/rows.tsv"; }

# step NAME TIMEOUT_S CMD...: run CMD (a command or an exported function) with a timeout, log to
# $out/<NAME>.log, add a row (result: the last line the command prints that starts with "RESULT: ", else
# passed / FAILED (exit N) / TIMED OUT)
step() {
  local name="$1" limit="$2"; shift 2
  local start=$SECONDS rc result log
  log="$out/$(tr -c 'A-Za-z0-9_.-' '_' <<< "$name").log"
  echo "== $name: $*" >&2
  timeout --kill-after=20 "$limit" bash -c '"$@"' step "$@" > "$log" 2>&1
  rc=$?
  result="$(sed -n 's/^RESULT: //p' "$log" | tail -1)"
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then result="TIMED OUT after ${limit}s${result:+ ($result)}"
  elif [[ $rc -ne 0 ]]; then result="FAILED (exit $rc; $log)${result:+: $result}"
  else result="${result:-passed}"; fi
  row "$name" "$result" "$((SECONDS - start))"
  tail -3 "$log" >&2
  return $rc
}

print_table() {
  python3 - "$out/rows.tsv" <<'EOF' | tee "$table"
import sys
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1]) if line.strip()]
head = ("test / bench", "result", "seconds")
w = [max(len(r[i]) for r in rows + [head]) for i in range(2)]
print(f"{head[0]:<{w[0]}}  {head[1]:<{w[1]}}  {head[2]:>7}")
print(f"{'-' * w[0]}  {'-' * w[1]}  {'-' * 7}")
for name, result, secs in rows:
    print(f"{name:<{w[0]}}  {result:<{w[1]}}  {secs:>7}")
EOF
}

# ------------------------------------------------------------------------------------------ dry run
if [[ $dry_run -eq 1 ]]; then
  py="${RELAX_PYTHON:-}"
  pyrun() { if [[ -n "$py" ]]; then "$py" "$@"; else uv run --frozen python "$@"; fi; }
  failed=0
  check() {  # check NAME CMD...: a prerequisite, one row
    local name="$1" start=$SECONDS; shift
    if "$@" > "$out/check-$name.log" 2>&1; then row "check: $name" "ok" "$((SECONDS - start))"
    else row "check: $name" "FAILED ($out/check-$name.log)" "$((SECONDS - start))"; failed=1; fi
  }
  files_exist() { local f; for f in "$@"; do [[ -e "$f" ]] || { echo "missing: $f"; return 1; }; done; }
  echo "gpu_check.sh --dry-run: the steps a GPU machine would run"
  echo "  build   UV_PROJECT_ENVIRONMENT=$cuda_venv uv sync --frozen --no-group cpu --group cuda"
  echo "  build   ${RELAX_SGLANG_PYTHON:-$sglang_env/bin/python}: sglang==$sglang_version sglang-router==$router_version (CUDA)"
  echo "  tests   pytest -m gpu $(echo $gpu_test_files)"
  echo "  grpo    relax run $grpo_config (20 colocated steps: megatron bf16 + sglang + sglang_tensor)"
  echo "  bench   python bench/megatron.py 5   (MFU headline, Qwen3-0.6B-shaped)"
  echo "  bench   python bench/sglang.py --device cuda --qwen3-0.6b --requests 64 --tokens 128 --repeats 2"
  check "files" files_exist "$grpo_config" bench/megatron.py bench/sglang.py "$guard" \
    packages/relax-sglang/scripts/build_server_env.sh $gpu_test_files
  check "sglang version" test -n "$sglang_version"
  check "command line tools" bash -c 'command -v uv && command -v timeout && command -v python3'
  check "grpo config validates" pyrun -m relax.core.cli validate "$grpo_config" \
    "rollout.engine_params.python=$sglang_env/bin/python" "run_dir=$out/grpo"
  check "benches compile" pyrun -m py_compile bench/megatron.py bench/sglang.py
  collect() {
    local listing
    listing="$(pyrun -m pytest --collect-only -q -m gpu -p no:cacheprovider $gpu_test_files 2>&1)" || { echo "$listing"; return 1; }
    echo "$listing"
    grep -q "::" <<< "$listing"  # at least one test id
  }
  check "gpu test ids collect" collect
  grep "::" "$out/check-gpu test ids collect.log" | sed 's/^/  test    /'
  print_table
  exit $failed
fi

# ------------------------------------------------------------------------------------------ the check
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
  | sed 's/^/GPU: /' || { echo "gpu_check.sh: no nvidia-smi: this is not an NVIDIA GPU machine (use --dry-run)" >&2; exit 2; }
total_start=$SECONDS

build_cuda_venv() {
  if [[ $build -eq 1 ]]; then UV_PROJECT_ENVIRONMENT="$cuda_venv" uv sync --frozen --no-group cpu --group cuda || return 1; fi
  "$cuda_venv/bin/python" -c "
import torch, megatron.core
assert torch.cuda.is_available(), 'CUDA torch does not see the GPU'
print(f'RESULT: torch {torch.__version__} (CUDA {torch.version.cuda}), megatron-core {megatron.core.__version__}')"
}

build_sglang_env() {
  if [[ -n "${RELAX_SGLANG_PYTHON:-}" ]]; then
    "$RELAX_SGLANG_PYTHON" -c "import sglang; print(f'RESULT: sglang {sglang.__version__} (RELAX_SGLANG_PYTHON)')"
    return
  fi
  if [[ ! -f "$sglang_env/.relax-ready" && $build -eq 1 ]]; then
    rm -rf "$sglang_env.building"
    uv venv --python 3.11 "$sglang_env.building" &&
      uv pip install --python "$sglang_env.building/bin/python" "sglang==$sglang_version" \
        "sglang-router==$router_version" || return 1
    touch "$sglang_env.building/.relax-ready" && rm -rf "$sglang_env" && mv "$sglang_env.building" "$sglang_env"
    sed -i "s#$sglang_env.building#$sglang_env#g" "$sglang_env"/bin/activate* "$sglang_env"/bin/sglang* 2>/dev/null
  fi
  "$sglang_env/bin/python" -c "import sglang, sglang_router; print(f'RESULT: sglang {sglang.__version__}, sglang-router')"
}

export build cuda_venv sglang_env sglang_version router_version out grpo_config
export -f build_cuda_venv build_sglang_env
step "build: workspace (CUDA torch)" 240 build_cuda_venv || { print_table; exit 1; }
step "build: SGLang server env" 240 build_sglang_env || { print_table; exit 1; }
py="$cuda_venv/bin/python"
export RELAX_SGLANG_PYTHON="${RELAX_SGLANG_PYTHON:-$sglang_env/bin/python}"
export RELAX_SGLANG_ROUTER_PYTHON="${RELAX_SGLANG_ROUTER_PYTHON:-$RELAX_SGLANG_PYTHON}"

# 2. every -m gpu test, a row each (from pytest's junit report)
step "pytest -m gpu" 300 "$py" -m pytest -m gpu -q -p no:cacheprovider --junitxml="$out/gpu-tests.xml" \
  $gpu_test_files
python3 - "$out/gpu-tests.xml" >> "$out/rows.tsv" <<'EOF'
import sys, xml.etree.ElementTree as ET
try:
    cases = ET.parse(sys.argv[1]).getroot().iter("testcase")
except (OSError, ET.ParseError):
    cases = []
for case in cases:
    where = case.get("classname", "").replace("packages.", "").replace(".tests.", "/")  # relax-sglang/test_gpu
    name = f"  {where}::{case.get('name')}"
    kids = {child.tag: child for child in case}
    if "failure" in kids or "error" in kids:
        bad = kids.get("failure", kids.get("error"))
        result = "FAILED: " + (bad.get("message") or "").splitlines()[0][:80] if (bad.get("message") or "").strip() else "FAILED"
    elif "skipped" in kids:
        result = "skipped: " + (kids["skipped"].get("message") or "")[:80]
    else:
        result = "passed"
    print(f"{name}\t{result}\t{float(case.get('time', 0)):.0f}")
EOF

# 3. 20 colocated GRPO steps, megatron bf16 + SGLang + sglang_tensor
grpo() {
  "$py" -m relax.core.cli run "$grpo_config" "rollout.engine_params.python=$RELAX_SGLANG_PYTHON" "run_dir=$out/grpo" &&
    "$py" - "$out/grpo" <<'EOF'
import json, sys
from pathlib import Path
rows = [json.loads(line) for p in Path(sys.argv[1]).rglob("metrics.jsonl") for line in p.read_text().splitlines() if line.strip()]
rewards = [r[k] for r in rows for k in r if k.endswith("reward_mean") or k == "reward/mean"]
steps = max((r.get("step", 0) for r in rows), default=0)
print(f"RESULT: {int(steps)} steps" + (f", reward {rewards[0]:.2f} -> {rewards[-1]:.2f}" if rewards else ""))
EOF
}
export py
export -f grpo
step "grpo: megatron bf16 + sglang_tensor, 20 steps" 180 grpo

# 4. the GPU headlines
bench() {  # bench PATTERN SCRIPT ARGS...: the script's output, its lines matching PATTERN as results
  local pattern="$1"; shift
  "$py" "$@" 2>&1 | tee "$out/bench.tmp"
  local rc=${PIPESTATUS[0]}
  grep -E "$pattern" "$out/bench.tmp" | sed 's/^/RESULT: /'
  return "$rc"
}
export -f bench
step "bench: megatron (MFU)" 150 bench "^MFU" bench/megatron.py 5
step "bench: sglang (Qwen3-0.6B)" 150 bench "^sglang:" bench/sglang.py --device cuda --qwen3-0.6b --requests 64 --tokens 128 --repeats 2

row "total" "$(grep -c 'FAILED\|TIMED OUT' "$out/rows.tsv") failed" "$((SECONDS - total_start))"
print_table
! grep -q 'FAILED\|TIMED OUT' "$out/rows.tsv"
