"""``scripts/gpu_check.sh --dry-run`` on CPU: it lists every step the GPU machine would run, its
prerequisites hold (files, the end-to-end config validates, the ``-m gpu`` test ids collect) and it exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_dry_run_lists_its_steps_and_its_prerequisites_hold(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "RELAX_PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for step in ("uv sync --frozen --no-group cpu --group cuda", "sglang==0.5.23", "pytest -m gpu",
                 "scripts/gpu_check/colocate_megatron_sglang.yaml", "bench/megatron.py", "bench/sglang.py --device cuda"):
        assert step in out, f"the dry run does not list {step!r}"
    table = (tmp_path / "table.txt").read_text()
    checks = [line for line in table.splitlines() if line.startswith("check: ")]
    assert len(checks) == 6 and all(" ok " in line for line in checks), table
    for test_id in ("packages/relax-sglang/tests/test_gpu.py::test_greedy_on_cuda_equals_the_hf_engine",
                    "packages/relax-sglang/tests/test_gpu.py::test_megatron_on_cuda_syncs_into_the_server_over_cuda_ipc",
                    "packages/relax-megatron/tests/test_gpu.py::", "integration_tests/test_gpu.py::"):
        assert test_id in out, f"{test_id} is not among the GPU tests the check would run"
