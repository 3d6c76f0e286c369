#!/usr/bin/env bash
# The GPU check: on a machine with one (or two) NVIDIA GPUs, run every GPU path offline, one table row each.
#
#   bash scripts/gpu_check.sh --prepare   # once, with network: the CUDA envs from the locks, kernel caches warmed
#   bash scripts/gpu_check.sh             # offline, <= 15 minutes: the check (2 GPUs: the NCCL tests too)
#   bash scripts/gpu_check.sh --dry-run   # any machine, no GPU: checks all it can, lists every row it would run
#
# --prepare builds (network once; nothing else is downloaded later, the test models are built locally):
#   .venv-cuda ($RELAX_CUDA_VENV)  the workspace from uv.lock with CUDA torch: uv sync --frozen --group cuda
#   the SGLang server env          from packages/relax-sglang/server-cuda/uv.lock (SGLang's CUDA stack)
#   then, on a GPU, runs the SGLang GPU tests once so Triton / FlashInfer kernels are compiled into the caches.
# The check: a driver row (the driver the locks' CUDA needs), then each GPU test file as its own pytest under its
# own limit with a row per test (also when the limit cuts it off), SGLang files first; the weight-sync latency
# of each transport; 20 colocated GRPO steps (megatron bf16 + SGLang); the MFU and SGLang throughput benches.
# With 2 GPUs the files' NCCL tests run too (megatron TP/DP/PP, fsdp world 2, megatron/torch -> SGLang over
# NCCL, the NCCL broadcast, megatron CP 2 with Transformer Engine). Rows past the 15-minute budget are listed as not run. Output: $OUT or
# runs/gpu-check: a log per row and table.txt.
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
mode=check budget=${RELAX_GPU_CHECK_BUDGET_S:-900}
for arg in "$@"; do
  case "$arg" in
    --dry-run) mode=dry ;;
    --prepare) mode=prepare ;;
    *) echo "gpu_check.sh: unknown argument $arg (--prepare, --dry-run)" >&2; exit 2 ;;
  esac
done
out="${OUT:-$repo/runs/gpu-check}"
mkdir -p "$out"
: > "$out/rows.tsv"
export RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 \
  WANDB_MODE=offline TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

guard=packages/relax-sglang/src/relax/sglang/server_site/relax_sglang_version_guard.py
sglang_version="$(sed -n 's/^PATCHED_FOR = "\([^"]*\)".*/\1/p' "$guard")"
sglang_project=packages/relax-sglang/server-cuda
lock_hash="$(cat uv.lock "$sglang_project/uv.lock" | sha256sum | cut -c1-12)"
cuda_venv="${RELAX_CUDA_VENV:-$repo/.venv-cuda}"
sglang_env="${RELAX_SGLANG_GPU_ENV:-$HOME/.cache/relax/sglang-cuda-$sglang_version-$lock_hash}"
prepared="$cuda_venv/.relax-gpu-check-$lock_hash"
grpo_config=scripts/gpu_check/colocate_megatron_sglang.yaml
# each GPU test file and its limit (s), SGLang first: the likeliest to fail on a new machine
gpu_files=(
  "packages/relax-sglang/tests/test_gpu.py 240"
  "packages/relax-sglang/tests/test_multiturn.py 90"
  "packages/relax-megatron/tests/test_gpu.py 180"
  "packages/relax-megatron/tests/test_layer_specs.py 60"
  "packages/relax-core/tests/trainers/fsdp/test_fsdp_gpu.py 120"
  "packages/relax-core/tests/trainers/test_offload_gpu.py 90"
  "packages/relax-core/tests/trainers/test_real_lengths.py 90"
  "integration_tests/test_gpu.py 180"
)
# files whose every test needs 2 GPUs: run in 2-GPU mode only (on one GPU a row says why not)
two_gpu_files=(
  "packages/relax-sglang/tests/test_gpu_nccl.py 150"
  "packages/relax-core/tests/trainers/fsdp/test_fsdp_gpu_world2.py 120"
  "packages/relax-megatron/tests/test_gpu_cp.py 120"
)
per_test_limit=150  # pytest-timeout: one hung test fails alone and its file goes on

# CUDA release -> the oldest Linux driver that runs it (NVIDIA's CUDA toolkit release notes, table 3)
driver_for_cuda() {
  case "$1" in
    13.*) echo 580.65.06 ;; 12.9) echo 575.51.03 ;; 12.8) echo 570.124.06 ;; 12.6) echo 560.28.03 ;;
    12.4) echo 550.54.14 ;; 12.1) echo 530.30.02 ;; *) echo unknown ;;
  esac
}
# the CUDA line of the locks' torch: the cuda-toolkit the workspace lock pins (torch 2.13.0 from PyPI: 13.0)
lock_cuda="$(awk '/^name = "cuda-toolkit"$/{getline; gsub(/[^0-9.]/, ""); split($0, v, "."); print v[1] "." v[2]; exit}' uv.lock)"
need_driver="$(driver_for_cuda "$lock_cuda")"

row() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$out/rows.tsv"; }
deadline=$((SECONDS + budget))

# step NAME LIMIT_S CMD...: CMD under min(LIMIT, what is left of the budget), logged to $out/<NAME>.log; a row
# (the command's last "RESULT: " line, else passed / FAILED (exit N) / TIMED OUT); past the budget: not run
step() {
  local name="$1" limit="$2"; shift 2
  local start=$SECONDS rc result log left=$((deadline - SECONDS))
  log="$out/$(tr -c 'A-Za-z0-9_.-' '_' <<< "$name").log"
  if ((left < 20)); then row "$name" "not run: the check's ${budget}s budget is spent" 0; return 0; fi
  ((limit > left)) && limit=$left
  echo "== $name (limit ${limit}s): $*" >&2
  timeout --kill-after=20 "$limit" bash -c '"$@"' step "$@" > "$log" 2>&1
  rc=$?
  result="$(sed -n 's/^RESULT: //p' "$log" | tail -1)"
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then result="TIMED OUT after ${limit}s${result:+ ($result)}"
  elif [[ $rc -ne 0 ]]; then result="FAILED (exit $rc; $log)${result:+: $result}"
  else result="${result:-passed}"; fi
  row "$name" "$result" "$((SECONDS - start))"
  tail -2 "$log" >&2
  STEP_LIMIT=$limit
  return $rc
}

print_table() {
  python3 - "$out/rows.tsv" <<'EOF' | tee "$out/table.txt"
import sys
rows = [line.rstrip("\n").split("\t") for line in open(sys.argv[1]) if line.strip()]
head = ("test / bench", "result", "seconds")
w = [min(max(len(r[i]) for r in rows + [head]), 100) for i in range(2)]
print(f"{head[0]:<{w[0]}}  {head[1]:<{w[1]}}  {head[2]:>7}")
print(f"{'-' * w[0]}  {'-' * w[1]}  {'-' * 7}")
for name, result, secs in rows:
    print(f"{name:<{w[0]}}  {result:<{w[1]}}  {secs:>7}")
EOF
}

# driver_check: nvidia-smi's driver against the one the locks' CUDA needs
driver_check() {
  echo "locks: torch built for CUDA $lock_cuda (uv.lock cuda-toolkit); needs NVIDIA driver >= $need_driver"
  command -v nvidia-smi >/dev/null || { echo "RESULT: no nvidia-smi: not an NVIDIA GPU machine"; return 1; }
  local have
  have="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1 | tr -d ' ')"
  nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
  if [[ "$(printf '%s\n%s\n' "$need_driver" "$have" | sort -V | head -1)" != "$need_driver" ]]; then
    echo "RESULT: driver $have < $need_driver, which CUDA $lock_cuda needs: update the driver (or re-lock a torch for an older CUDA)"
    return 1
  fi
  echo "RESULT: driver $have >= $need_driver (CUDA $lock_cuda), $(nvidia-smi -L | wc -l) GPU(s)"
}

# ------------------------------------------------------------------------------------------ dry run
if [[ $mode == dry ]]; then
  py="${RELAX_PYTHON:-$repo/.venv/bin/python}"
  failed=0
  check() {  # check NAME CMD...: a prerequisite, one row
    local name="$1" start=$SECONDS; shift
    local log="$out/check-$name.log" said
    if "$@" > "$log" 2>&1; then said="$(sed -n 's/^RESULT: //p' "$log" | tail -1)"; row "check: $name" "ok${said:+ ($said)}" "$((SECONDS - start))"
    else row "check: $name" "FAILED ($log)" "$((SECONDS - start))"; failed=1; fi
  }
  files_exist() { local f; for f in "$@"; do [[ -e "$f" ]] || { echo "missing: $f"; return 1; }; done; }
  locks() {
    [[ -n "$lock_cuda" && "$need_driver" != unknown ]] || { echo "no CUDA line in uv.lock's cuda-toolkit"; return 1; }
    grep -q "^name = \"sglang\"" "$sglang_project/uv.lock" && grep -A1 '^name = "sglang"$' "$sglang_project/uv.lock" | grep -q "\"$sglang_version\"" ||
      { echo "$sglang_project/uv.lock does not lock sglang $sglang_version (the release the patches target)"; return 1; }
    local sgl_cuda
    sgl_cuda="$(awk '/^name = "cuda-toolkit"$/{getline; gsub(/[^0-9.]/, ""); split($0, v, "."); print v[1] "." v[2]; exit}' "$sglang_project/uv.lock")"
    [[ -z "$sgl_cuda" || "$(driver_for_cuda "$sgl_cuda")" == "$need_driver" ]] ||
      { echo "the SGLang env's CUDA $sgl_cuda needs another driver than the workspace's CUDA $lock_cuda"; return 1; }
    echo "RESULT: CUDA $lock_cuda in both locks: driver >= $need_driver"
  }
  budget_fits() {
    local total=0 f
    for f in "${gpu_files[@]}"; do total=$((total + ${f##* })); done
    echo "RESULT: test files' limits ${total}s of the ${budget}s budget; later rows get what is left"
    ((budget <= 900))
  }
  echo "gpu_check.sh --dry-run: what a GPU machine would run"
  echo "  prepare  UV_PROJECT_ENVIRONMENT=$cuda_venv uv sync --frozen --no-group cpu --group cuda"
  echo "  prepare  $sglang_env from $sglang_project/uv.lock (sglang $sglang_version, CUDA $lock_cuda)"
  echo "  check    driver >= $need_driver; then each file, its limit:"
  for f in "${gpu_files[@]}"; do echo "             ${f% *} (${f##* }s)"; done
  for f in "${two_gpu_files[@]}"; do echo "             ${f% *} (${f##* }s, 2 GPUs only)"; done
  echo "  check    weight-sync latency (bench/sglang.py --device cuda), grpo ($grpo_config), benches"
  check "files" files_exist "$grpo_config" bench/megatron.py bench/sglang.py "$guard" scripts/gpu_check/rows.py \
    "$sglang_project/pyproject.toml" "$sglang_project/uv.lock" ${gpu_files[@]%% *} ${two_gpu_files[@]%% *}
  check "locks name one CUDA line" locks
  driver_here() { if command -v nvidia-smi >/dev/null; then driver_check; else echo "RESULT: no GPU here; a GPU needs >= $need_driver"; fi; }
  prepared_here() {
    if [[ -f "$prepared" ]]; then echo "RESULT: envs prepared for these locks"
    else echo "RESULT: not prepared here (bash scripts/gpu_check.sh --prepare, on the GPU machine)"; fi
  }
  check "driver" driver_here
  check "prepared" prepared_here
  check "command line tools" bash -c 'command -v uv && command -v timeout && command -v python3'
  check "budget" budget_fits
  quick=${RELAX_GPU_CHECK_QUICK:-0}  # 1: leave out the two slow Python checks (the CPU test of this script)
  if [[ $quick == 1 ]]; then row "check: grpo config validates" "left out (RELAX_GPU_CHECK_QUICK=1)" 0
  else check "grpo config validates" "$py" -m relax.core.cli validate "$grpo_config" \
    "rollout.engine_params.python=$sglang_env/bin/python" "run_dir=$out/grpo"; fi
  check "benches compile" "$py" -m py_compile bench/megatron.py bench/sglang.py scripts/gpu_check/rows.py
  collect() {
    "$py" -m pytest --collect-only -q -m gpu -p no:cacheprovider ${gpu_files[@]%% *} ${two_gpu_files[@]%% *} 2>&1 | tee "$out/collect.txt" |
      grep -c "::" | sed 's/^/RESULT: /;s/$/ GPU test ids/'
    grep -q "::" "$out/collect.txt"
  }
  if [[ $quick == 1 ]]; then row "check: gpu test ids collect" "left out (RELAX_GPU_CHECK_QUICK=1)" 0
  else check "gpu test ids collect" collect; grep "::" "$out/collect.txt" | sed 's/^/  test    /'; fi
  print_table
  exit $failed
fi

# ------------------------------------------------------------------------------------------ prepare
if [[ $mode == prepare ]]; then
  build_cuda_venv() {
    UV_PROJECT_ENVIRONMENT="$cuda_venv" uv sync --frozen --no-group cpu --group cuda || return 1
    "$cuda_venv/bin/python" -c "
import torch, megatron.core
print(f'RESULT: torch {torch.__version__} (CUDA {torch.version.cuda}), megatron-core {megatron.core.__version__}')"
  }
  build_sglang_env() {
    if [[ ! -f "$sglang_env/.relax-ready" ]]; then
      rm -rf "$sglang_env.building"
      UV_PROJECT_ENVIRONMENT="$sglang_env.building" uv sync --frozen --no-install-project --project "$sglang_project" \
        --python 3.11 || return 1
      PYTHONDONTWRITEBYTECODE= "$sglang_env.building/bin/python" -c 'import sglang.srt.entrypoints.http_server' || return 1
      touch "$sglang_env.building/.relax-ready" && rm -rf "$sglang_env" && mv "$sglang_env.building" "$sglang_env"
      sed -i "s#$sglang_env.building#$sglang_env#g" "$sglang_env"/bin/activate* "$sglang_env"/bin/sglang* 2>/dev/null
    fi
    "$sglang_env/bin/python" -c "import sglang, sglang_router, torch; print(f'RESULT: sglang {sglang.__version__}, torch {torch.__version__} (CUDA {torch.version.cuda})')"
  }
  warm() {  # compile SGLang's kernels into the caches: the check itself then runs offline and warm
    RELAX_SGLANG_PYTHON="$sglang_env/bin/python" RELAX_SGLANG_ROUTER_PYTHON="$sglang_env/bin/python" \
      "$cuda_venv/bin/python" -m pytest -q -m gpu -p no:cacheprovider packages/relax-sglang/tests/test_gpu.py
  }
  export cuda_venv sglang_env sglang_project
  export -f build_cuda_venv build_sglang_env warm
  deadline=$((SECONDS + 3600))
  step "prepare: workspace (CUDA torch)" 1200 build_cuda_venv || { print_table; exit 1; }
  step "prepare: SGLang env (CUDA)" 1200 build_sglang_env || { print_table; exit 1; }
  if command -v nvidia-smi >/dev/null; then step "prepare: warm SGLang kernel caches" 900 warm; fi
  touch "$prepared"
  print_table
  exit 0
fi

# ------------------------------------------------------------------------------------------ the check
export lock_cuda need_driver
export -f driver_check
step "driver / CUDA" 30 driver_check || { print_table; exit 1; }
if [[ ! -f "$prepared" || ! -f "$sglang_env/.relax-ready" ]]; then
  row "prepared envs" "FAILED: missing for these locks: run bash scripts/gpu_check.sh --prepare (network, once)" 0
  print_table; exit 1
fi
export UV_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
py="$cuda_venv/bin/python"
export RELAX_SGLANG_PYTHON="$sglang_env/bin/python"
export RELAX_SGLANG_ROUTER_PYTHON="${RELAX_SGLANG_ROUTER_PYTHON:-$RELAX_SGLANG_PYTHON}"
gpus="$(nvidia-smi -L | wc -l)"
row "GPUs" "$gpus: $([[ $gpus -ge 2 ]] && echo "2-GPU mode, the NCCL tests run" || echo "1-GPU mode, the NCCL tests skip (need 2)")" 0
total_start=$SECONDS

# each test file its own pytest and limit; a row per test from its -v log, also when the limit cut it off
files=("${gpu_files[@]}")
if ((gpus >= 2)); then files+=("${two_gpu_files[@]}")
else for entry in "${two_gpu_files[@]}"; do row "$(sed 's#^packages/##; s#/tests/#/#' <<< "${entry% *}")" "skipped: needs 2 GPUs" 0; done; fi
for entry in "${files[@]}"; do
  file="${entry% *}" limit="${entry##* }"
  id="$(sed 's#^packages/##; s#/tests/#/#' <<< "$file")"
  STEP_LIMIT=""
  step "$id" "$limit" "$py" -m pytest -v -rs --durations=0 -m gpu -p no:cacheprovider --timeout="$per_test_limit" "$file"
  rc=$?
  log="$out/$(tr -c 'A-Za-z0-9_.-' '_' <<< "$id").log"
  [[ -f "$log" ]] && python3 scripts/gpu_check/rows.py "$log" "$id" \
    "$([[ $rc -eq 124 || $rc -eq 137 ]] && echo "$STEP_LIMIT")" >> "$out/rows.tsv"
done

# weight-sync latency: every sglang_* transport into a CUDA SGLang server (NCCL's too with 2 GPUs)
bench() {  # bench PATTERN SCRIPT ARGS...: the script's output, its lines matching PATTERN as results
  local pattern="$1"; shift
  "$py" "$@" 2>&1 | tee "$out/bench.tmp"
  local rc=${PIPESTATUS[0]}
  grep -E "$pattern" "$out/bench.tmp" | paste -sd ';' | sed 's/^/RESULT: /'
  return "$rc"
}
grpo() {
  "$py" -m relax.core.cli run "$grpo_config" "rollout.engine_params.python=$RELAX_SGLANG_PYTHON" "run_dir=$out/grpo" &&
    "$py" - "$out/grpo" <<'EOF'
import json, sys
from pathlib import Path
rows = [json.loads(line) for p in Path(sys.argv[1]).rglob("metrics.jsonl") for line in p.read_text().splitlines() if line.strip()]
rewards = [r[k] for r in rows for k in r if k == "reward/mean"]
syncs = [r["time/sync_s"] for r in rows if "time/sync_s" in r]
steps = max((r.get("step", 0) for r in rows), default=0)
print(f"RESULT: {int(steps)} steps" + (f", reward {rewards[0]:.2f} -> {rewards[-1]:.2f}" if rewards else "")
      + (f", weight sync {sorted(syncs)[len(syncs) // 2] * 1e3:.0f} ms median" if syncs else ""))
EOF
}
export py out grpo_config
export -f bench grpo
step "weight-sync latency (tiny model, CUDA SGLang)" 120 bench "ms per sync" bench/sglang.py --device cuda \
  --requests 16 --tokens 16 --repeats 3
step "grpo: megatron bf16 + sglang_tensor, 20 colocated steps" 180 grpo
step "bench: megatron (MFU)" 120 bench "^MFU" bench/megatron.py 5
step "bench: sglang (Qwen3-0.6B)" 120 bench "^sglang:" bench/sglang.py --device cuda --qwen3-0.6b --requests 64 \
  --tokens 128 --repeats 2

bad='FAILED\|TIMED OUT\|not run'
row "total" "$(grep -c "$bad" "$out/rows.tsv") failed, timed out or not run" "$((SECONDS - total_start))"
print_table
! grep -q "$bad" "$out/rows.tsv"
