"""``scripts/gpu_check.sh`` on CPU: its dry run lists every row the GPU machine would run and its prerequisites
hold; the check itself, on a machine with a (fake) GPU, gives each test file its row and limit, a row per test
(also for a file its limit cuts off), stays inside its time budget, and names the driver the locks need.

The GPU here is a fake (no NVIDIA GPU exists on this machine): an ``nvidia-smi`` script on PATH answering as
one H100 would, and a "prepared" CUDA env that is this venv; every ``-m gpu`` test then skips for want of CUDA,
which is what the rows must say."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
sys.path.insert(0, str(ROOT / "scripts" / "gpu_check"))
import rows  # noqa: E402  (scripts/gpu_check/rows.py: not a package)


def run(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "OUT": str(tmp_path / "out"), "RELAX_PYTHON": sys.executable, **env}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=ROOT, env=full, capture_output=True, text=True, timeout=600
    )


def table(tmp_path: Path) -> dict[str, str]:
    lines = (tmp_path / "out" / "rows.tsv").read_text().splitlines()
    return {name.strip(): result for name, result, _ in (line.split("\t") for line in lines)}


def test_dry_run_lists_every_row_and_checks_the_locks(tmp_path):
    done = run(["--dry-run"], tmp_path, RELAX_GPU_CHECK_QUICK="1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for step in (
        "uv sync --frozen --no-group cpu --group cuda",
        "packages/relax-sglang/server-cuda/uv.lock",
        "packages/relax-sglang/tests/test_gpu.py (240s)",
        "integration_tests/test_gpu.py (180s)",
        "packages/relax-megatron/tests/test_gpu_cp.py (120s, 2 GPUs only)",
        "weight-sync latency",
        "scripts/gpu_check/colocate_megatron_sglang.yaml",
    ):
        assert step in out, f"the dry run does not list {step!r}"
    assert out.index("relax-sglang/tests/test_gpu.py") < out.index(
        "relax-megatron/tests/test_gpu.py"
    )  # SGLang first
    rows_ = table(tmp_path)
    assert rows_["check: locks name one CUDA line"] == "ok (CUDA 13.0 in both locks: driver >= 580.65.06)"
    assert rows_["check: driver"] == "ok (no GPU here; a GPU needs >= 580.65.06)"
    assert all(r.startswith(("ok", "left out")) for r in rows_.values()), rows_


def test_the_gpu_check_config_validates():
    """The dry run's slow check, in process: the grpo row's config (megatron bf16 + SGLang, colocated)."""
    from relax.core.config import load_config

    cfg = load_config(ROOT / "scripts" / "gpu_check" / "colocate_megatron_sglang.yaml")
    assert cfg.mode == "colocate" and cfg.trainer.backend == "megatron" and cfg.rollout.engine == "sglang"


def test_without_a_gpu_the_check_stops_at_the_driver_row_naming_the_driver_needed(tmp_path):
    done = run([], tmp_path, PATH="/usr/bin:/bin")  # no nvidia-smi
    assert done.returncode == 1
    log = next((tmp_path / "out").glob("driver*.log")).read_text()
    assert "needs NVIDIA driver >= 580.65.06" in log and table(tmp_path)["driver / CUDA"].startswith("FAILED")


def test_on_a_fake_gpu_each_file_gets_its_rows_and_the_budget_holds(tmp_path):
    """One H100 (fake nvidia-smi), an old driver refused, then a new one: the files run in order, SGLang's first,
    a row per test with its skip reason; rows past the budget say so instead of running."""
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv-cuda"
    (venv / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    python = venv / "bin" / "python"  # the "CUDA" venv: this one
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    smi = bin_dir / "nvidia-smi"  # the fake GPU
    smi.write_text(
        '#!/bin/sh\ncase "$*" in *-L*) echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-fake)";; '
        '*driver_version*) echo "${FAKE_DRIVER}";; *) echo "0, NVIDIA H100 80GB HBM3, 81559 MiB";; esac\n'
    )
    smi.chmod(0o755)
    sglang_env = tmp_path / "sglang-env"
    sglang_env.mkdir()
    (sglang_env / ".relax-ready").touch()
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "RELAX_CUDA_VENV": str(venv),
        "RELAX_SGLANG_GPU_ENV": str(sglang_env),
    }
    done = run([], tmp_path, FAKE_DRIVER="570.124.06", **env)
    assert done.returncode == 1
    assert (
        table(tmp_path)["driver / CUDA"].startswith("FAILED (exit 1")
        and "570.124.06 < 580.65.06" in done.stdout
    )
    done = run([], tmp_path, FAKE_DRIVER="580.82.07", **env)
    assert (
        done.returncode == 1 and "run bash scripts/gpu_check.sh --prepare" in table(tmp_path)["prepared envs"]
    )
    subprocess.run(
        [
            "bash",
            "-c",
            f'touch "{venv}"/.relax-gpu-check-$(cat uv.lock packages/relax-sglang/server-cuda/uv.lock'
            " | sha256sum | cut -c1-12)",
        ],
        cwd=ROOT,
        check=True,
    )
    done = run([], tmp_path, FAKE_DRIVER="580.82.07", RELAX_GPU_CHECK_BUDGET_S="40", **env)
    assert done.returncode == 1  # rows not run count against the check
    got = table(tmp_path)
    names = list(got)
    assert got["driver / CUDA"] == "driver 580.82.07 >= 580.65.06 (CUDA 13.0), 1 GPU(s)"
    assert got["GPUs"].startswith("1: 1-GPU mode")
    assert (
        got["relax-sglang/test_gpu_nccl.py"]
        == got["relax-core/trainers/fsdp/test_fsdp_gpu_world2.py"]
        == got["relax-megatron/test_gpu_cp.py"]
        == ("skipped: needs 2 GPUs")
    )  # 2-GPU files: a row saying why, not a run
    first = names.index("relax-sglang/test_gpu.py")
    assert names[first + 1].startswith("relax-sglang/test_gpu.py::test_")  # its tests' rows follow it
    assert got[names[first + 1]].startswith("skipped: needs a CUDA GPU")
    assert int((tmp_path / "out" / "rows.tsv").read_text().splitlines()[-1].split("\t")[2]) <= 40 + 20
    # where the budget runs out depends on the machine's speed; a budget spent before the first file is not
    done = run([], tmp_path, FAKE_DRIVER="580.82.07", RELAX_GPU_CHECK_BUDGET_S="1", **env)
    assert done.returncode == 1
    got = table(tmp_path)
    assert (
        got["grpo: megatron bf16 + sglang_tensor, 20 colocated steps"]
        == "not run: the check's 1s budget is spent"
    )
    assert got["relax-sglang/test_gpu.py"] == "not run: the check's 1s budget is spent"


def test_rows_of_a_file_its_limit_cut_off():
    """pytest -v killed mid-file: finished tests keep their outcome, the running one is TIMED OUT, the rest
    are counted as not run (no junit report exists then)."""
    log = (
        "collecting ... collected 4 items\n"
        "packages/relax-sglang/tests/test_gpu.py::test_a PASSED [ 25%]\n"
        "packages/relax-sglang/tests/test_gpu.py::test_b SKIPPED [ 50%]\n"
        "packages/relax-sglang/tests/test_gpu.py::test_c "
    )
    got = rows.rows(log, "relax-sglang/test_gpu.py", 240)
    assert [r[:2] for r in got] == [
        ("  relax-sglang/test_gpu.py::test_a", "passed"),
        ("  relax-sglang/test_gpu.py::test_b", "skipped: "),
        ("  relax-sglang/test_gpu.py::test_c", "TIMED OUT (running when the 240s limit hit)"),
        ("  relax-sglang/test_gpu.py: 1 more", "not run (the file's time limit hit first)"),
    ]
    done = (
        log
        + "PASSED [ 75%]\n"
        + "packages/relax-sglang/tests/test_gpu.py::test_d FAILED [100%]\n"
        + (
            "0.52s call     packages/relax-sglang/tests/test_gpu.py::test_d\n"
            "SKIPPED [1] packages/relax-sglang/tests/test_gpu.py:12: needs 2 GPUs\n"
            "FAILED packages/relax-sglang/tests/test_gpu.py::test_d - AssertionError: 3 != 4\n"
        )
    )
    got = rows.rows(done, "relax-sglang/test_gpu.py")
    assert got[1][1] == "skipped: needs 2 GPUs" and got[2][1] == "passed"
    assert got[3] == ("  relax-sglang/test_gpu.py::test_d", "FAILED: AssertionError: 3 != 4", "1")
