"""What the GPU paths decide, checked on CPU: per-device server defaults, the device a ``sglang_distributed``
broadcast sends from, the SGLang version guards, the sglang-router command, and the wheel carrying what
``python: auto`` builds the server env from."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from relax.sglang.device_defaults import server_settings
from relax.sglang.params import SGLangEngineParams
from relax.sglang.router import RouterMissing, router_command, router_python
from relax.sglang.server import server_command
from relax.sglang.server_site import SITE_DIR
from relax.sglang.server_site.relax_sglang_version_guard import (
    PATCHED_FOR,
    SKIP_ENV,
    SGLangVersionError,
    check_patches,
    endpoints_problem,
    patches_problem,
    release,
)
from relax.sglang.transports import group_device, on_group_device

PACKAGE = Path(__file__).resolve().parents[1]


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_cpu_keeps_the_settings_the_cpu_tests_were_tuned_with():
    cpu = SGLangEngineParams()
    assert server_settings(cpu, "float32") == server_settings(cpu, "float32").__class__(
        dtype="float32", max_total_tokens=4096, deterministic=True, max_concurrency=64
    )
    cmd = server_command(cpu, "/m", 1, "float32")
    assert _flag(cmd, "--dtype") == "float32" and _flag(cmd, "--max-total-tokens") == "4096"
    assert "--enable-deterministic-inference" in cmd and _flag(cmd, "--mem-fraction-static") == "0.8"
    # the exact CPU command the suite has always started (unchanged by the per-device defaults)
    assert cmd == [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/m",
        "--host",
        "127.0.0.1",
        "--port",
        "1",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--mem-fraction-static",
        "0.8",
        "--tp-size",
        "1",
        "--skip-server-warmup",
        "--max-total-tokens",
        "4096",
        "--enable-deterministic-inference",
        "--attention-backend",
        "torch_native",
        "--sampling-backend",
        "pytorch",
        "--disable-cuda-graph",
        "--sleep-on-idle",
    ]
    assert server_settings(cpu, "bfloat16").dtype == "bfloat16"  # CPU serves the run's dtype


def test_cuda_defaults_are_sglangs_production_ones():
    gpu = SGLangEngineParams(device="cuda")
    settings = server_settings(gpu, "float32")
    assert settings.dtype == "bfloat16" and settings.max_total_tokens is None
    assert settings.deterministic is False and settings.max_concurrency == 1024
    assert server_settings(gpu, "float16").dtype == "float16"  # a half-precision run keeps its dtype
    cmd = server_command(gpu, "/m", 1, "float32")
    assert (
        _flag(cmd, "--dtype") == "bfloat16" and "--max-total-tokens" not in cmd
    )  # KV from mem_fraction_static
    assert "--enable-deterministic-inference" not in cmd and "--attention-backend" not in cmd
    # everything stays settable, on either device; max_total_tokens 0 means no cap
    asked = SGLangEngineParams(
        device="cuda:1", dtype="float32", max_total_tokens=8192, deterministic=True, max_concurrency=8
    )
    assert server_settings(asked, "bfloat16") == settings.__class__("float32", 8192, True, 8)
    assert server_settings(SGLangEngineParams(max_total_tokens=0), "float32").max_total_tokens is None
    assert server_settings(SGLangEngineParams(deterministic=False), "float32").deterministic is False
    assert "max_total_tokens" in " ".join(SGLangEngineParams(max_total_tokens=-1).validate())


def test_a_float32_cuda_server_gets_an_attention_backend_that_takes_float32():
    """SGLang's default attention on Hopper (FA3) takes fp16 / bf16 / fp8 only: a float32 CUDA server gets Triton's;
    a half-precision one keeps SGLang's default, the CPU its own, and an explicit choice in extra_args wins."""
    fp32 = SGLangEngineParams(device="cuda", dtype="float32")
    assert _flag(server_command(fp32, "/m", 1, "bfloat16"), "--attention-backend") == "triton"
    assert (
        _flag(
            server_command(SGLangEngineParams(device="cuda:1", dtype="fp32"), "/m", 1, "float32"),
            "--attention-backend",
        )
        == "triton"
    )
    assert "--attention-backend" not in server_command(
        SGLangEngineParams(device="cuda"), "/m", 1, "float32"
    )  # bf16
    assert "--attention-backend" not in server_command(SGLangEngineParams(device="cuda"), "/m", 1, "float16")
    assert (
        _flag(server_command(SGLangEngineParams(), "/m", 1, "float32"), "--attention-backend")
        == "torch_native"
    )
    chosen = SGLangEngineParams(
        device="cuda", dtype="float32", extra_args=["--attention-backend", "flashinfer"]
    )
    cmd = server_command(chosen, "/m", 1, "float32")
    assert cmd.count("--attention-backend") == 1 and _flag(cmd, "--attention-backend") == "flashinfer"


def test_the_distributed_broadcast_sends_from_the_groups_device():
    """NCCL only moves CUDA tensors and the megatron trainer exports host tensors: the sender moves each
    tensor to the group's device (the trainer's GPU for NCCL, the host for gloo) before broadcasting."""
    assert group_device("nccl", 3) == torch.device("cuda", 3)
    assert group_device("gloo") == torch.device("cpu")
    host = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()  # not contiguous
    moved = on_group_device(host, torch.device("meta"))  # stands in for a GPU: the move happens
    assert moved.device.type == "meta" and moved.shape == (3, 2) and moved.is_contiguous()
    same = on_group_device(host.contiguous(), group_device("gloo"))
    assert same.data_ptr() == host.contiguous().data_ptr() or torch.equal(same, host)  # no needless copy
    assert on_group_device(host, group_device("gloo")).is_contiguous()


def test_nccl_weight_sync_in_colocate_is_refused_by_validation():
    """Colocate puts trainer rank 0 and engine 0 on one GPU and NCCL cannot have two ranks of a group on one device:
    ``relax validate`` refuses it (naming sglang_tensor) instead of an NCCL error at the first sync."""
    from relax.core.config import ConfigError, load_config

    base = ["rollout.engine=sglang", "weight_sync.transport=sglang_distributed"]
    with pytest.raises(ConfigError, match=r"backend: nccl in mode 'colocate'.*sglang_tensor"):
        load_config(None, [*base, "mode=colocate", "weight_sync.params={backend: nccl}"])
    assert (
        load_config(
            None, [*base, "mode=async", "weight_sync.params={backend: nccl}"]
        ).weight_sync.params.backend
        == "nccl"
    )
    assert load_config(None, [*base, "mode=colocate"]).weight_sync.params.backend == "gloo"


def test_sglang_tensor_stages_each_server_rank_on_its_own_gpu():
    """Launched server j's TP rank k runs on the engine's GPU j * tp_size + k (--base-gpu-id): its copy of a bucket is
    staged there, not every server's on GPU 0; a CPU server reads one host copy; attached servers the current GPU."""
    from relax.sglang.device_defaults import staging_devices
    from relax.sglang.weight_updates import staged_payloads

    cuda = torch.device
    assert staging_devices("cuda", 1, 1) == [[cuda("cuda", 0)]]
    assert staging_devices("cuda", 1, 2) == [[cuda("cuda", 0), cuda("cuda", 1)]]
    assert staging_devices("cuda", 3, 2) == [
        [cuda("cuda", 0), cuda("cuda", 1)],
        [cuda("cuda", 2), cuda("cuda", 3)],
        [cuda("cuda", 4), cuda("cuda", 5)],
    ]
    assert staging_devices("cuda", 2, 1, launched=False) == [[cuda("cuda")], [cuda("cuda")]]
    assert staging_devices("cpu", 2, 1) == [[cuda("cpu")], [cuda("cpu")]]
    # the assignment matches the GPUs the servers are launched on
    fleet = SGLangEngineParams(device="cuda", router="sglang", servers=3, tp_size=2)
    layout = staging_devices("cuda", 3, 2)
    assert [
        int(
            _flag(
                server_command(fleet, "/m", 1, "bfloat16", base_gpu=j * 2) + ["--base-gpu-id", "0"],
                "--base-gpu-id",
            )
        )
        for j in range(3)
    ] == [ranks[0].index for ranks in layout]
    # one staged copy per device (on CPU one host copy for both servers)
    payloads, alive = staged_payloads([("w", torch.arange(4.0))], staging_devices("cpu", 2, 1))
    assert len(alive) == 1 and [len(p) for p in payloads] == [1, 1]


RECEIVER = """
import base64, gc, multiprocessing.reduction, sys
import torch.multiprocessing
torch.multiprocessing.set_sharing_strategy("file_system")
for line in sys.stdin:  # one payload a line, as one server rank after another receives it
    try:
        named = multiprocessing.reduction.ForkingPickler.loads(base64.b64decode(line))
        print(float(sum(t.sum() for _, t in named)), flush=True)
    except RuntimeError as exc:
        print(exc, flush=True)
    named = None
    gc.collect()  # as a server does once the weights are loaded: its reference goes
"""


def test_every_server_rank_gets_its_own_pickle_of_a_host_bucket():
    """torch counts a shared storage's references per pickle and each receiver drops one: two servers reading one
    pickle freed the storage under the trainer, and the next bucket on that storage found no shared memory (a CPU
    server died with 'unable to open shared memory object'). Two real receiver processes take the two servers'
    payloads, then one of them a later bucket's on the same storage."""
    from relax.sglang.device_defaults import staging_devices
    from relax.sglang.weight_updates import staged_payloads

    servers = [
        subprocess.Popen(
            [sys.executable, "-c", RECEIVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:

        def receive(server: subprocess.Popen, payload: str) -> str:
            server.stdin.write(payload + "\n")
            server.stdin.flush()
            return server.stdout.readline().strip()

        named = [("w", torch.arange(4.0))]
        payloads, _alive = staged_payloads(named, staging_devices("cpu", 2, 1))
        assert [receive(server, p[0]) for server, p in zip(servers, payloads, strict=True)] == ["6.0", "6.0"]
        later, _again = staged_payloads(
            named, staging_devices("cpu", 1, 1)
        )  # the next bucket on the same storage
        assert receive(servers[0], later[0][0]) == "6.0"
    finally:
        for server in servers:
            server.stdin.close()
            server.wait(60)


def test_version_guards_name_the_versions():
    assert (
        release("0.5.23.post2") == (0, 5, 23) and release("v0.6.0rc1") == (0, 6, 0) and release("dev") == ()
    )
    assert patches_problem(PATCHED_FOR) is None and patches_problem(PATCHED_FOR + ".post1") is None
    assert patches_problem(None) is None  # no SGLang in that interpreter: the patches never fire
    problem = patches_problem("0.5.24")
    assert "written for sglang 0.5.23" in problem and "has sglang 0.5.24" in problem
    with pytest.raises(SGLangVersionError, match=r"sglang 0\.4\.9"):
        check_patches("0.4.9")
    assert endpoints_problem("0.5.23") is None and endpoints_problem("0.6.1") is None
    old = endpoints_problem("0.4.10")
    assert "needs sglang >= 0.5.23" in old and "reports sglang 0.4.10" in old
    assert "reports sglang unknown" in endpoints_problem(None)


def _fake_sglang(root: Path, version: str) -> Path:
    dist = root / f"sglang-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    return root


def test_a_server_interpreter_with_another_sglang_stops_at_start_up(tmp_path):
    """The guard runs in every interpreter the patches reach (this one stands in for the server's: a
    distribution claiming another SGLang release sits after the patches on its path)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SITE_DIR), str(_fake_sglang(tmp_path, "0.4.0"))])}
    out = subprocess.run(
        [sys.executable, "-c", "print('served')"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0 and "served" not in out.stdout
    assert "written for sglang 0.5.23" in out.stderr and "has sglang 0.4.0" in out.stderr
    ok = subprocess.run(
        [sys.executable, "-c", "print('served')"],
        env={**env, SKIP_ENV: "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0 and ok.stdout.strip() == "served", ok.stderr


def test_the_sglang_router_command_fronts_every_server():
    params = SGLangEngineParams(
        router="sglang", servers=2, request_timeout_s=90, router_args=["--cache-threshold", "0.3"]
    )
    cmd = router_command(params, "/r/bin/python", ["http://127.0.0.1:1", "http://127.0.0.1:2"], 7)
    assert cmd[:3] == ["/r/bin/python", "-m", "sglang_router.launch_router"]
    assert cmd[cmd.index("--worker-urls") + 1 : cmd.index("--worker-urls") + 3] == [
        "http://127.0.0.1:1",
        "http://127.0.0.1:2",
    ]
    assert _flag(cmd, "--policy") == "cache_aware" and _flag(cmd, "--port") == "7"
    assert _flag(cmd, "--request-timeout-secs") == "90" and cmd[-2:] == ["--cache-threshold", "0.3"]
    assert router_python(SGLangEngineParams(router_python="/x/python")) == "/x/python"
    errors = " ".join(SGLangEngineParams(servers=2).validate())
    assert (
        "need router 'sglang'" in errors and SGLangEngineParams(router="sglang", servers=2).validate() == []
    )


def test_servers_behind_one_router_take_their_own_gpus():
    from relax.sglang.plugin import _resources

    fleet = SGLangEngineParams(device="cuda", router="sglang", servers=3, tp_size=2)
    assert (
        _resources(fleet).num_gpus == 6
        and _resources(SGLangEngineParams(device="cuda", tp_size=2)).num_gpus == 2
    )
    assert _resources(SGLangEngineParams(router="sglang", servers=3)).num_gpus == 0  # CPU
    assert _flag(server_command(fleet, "/m", 1, "bfloat16", base_gpu=4), "--base-gpu-id") == "4"
    assert "--base-gpu-id" not in server_command(fleet, "/m", 1, "bfloat16")
    assert "--base-gpu-id" not in server_command(SGLangEngineParams(), "/m", 1, "float32", base_gpu=2)  # CPU


def test_without_sglang_router_the_error_says_so(monkeypatch):
    from relax.sglang.router import ROUTER_ENV, has_router

    monkeypatch.delenv(ROUTER_ENV, raising=False)
    if has_router(sys.executable):
        pytest.skip("sglang-router is installed in this environment: nothing is missing")
    with pytest.raises(RouterMissing, match="sglang-router not installed") as err:
        router_python(SGLangEngineParams(router="sglang"), server_python="/nonexistent/python")
    assert "/nonexistent/python" in str(err.value) and sys.executable in str(err.value)


def test_the_wheel_ships_what_python_auto_builds_the_server_env_from(tmp_path, sglang_python):
    """``uv build`` the package and install the wheel in a fresh venv: ``python: auto``'s build script
    resolves inside the installed package and finds the same cached server env the source tree built (same
    lock, shims and patches, so the same hash)."""
    built = subprocess.run(
        ["uv", "build", "--wheel", "-q", "-o", str(tmp_path / "dist"), str(PACKAGE)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("relax_sglang-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = "relax/sglang/server_files/"
    for name in (
        "scripts/build_server_env.sh",
        "server/pyproject.toml",
        "server/uv.lock",
        "server/cpu_shims/relax_sglang_cpu_shims.py",
        "server/cpu_shims/relax_sglang_cpu_shims.pth",
        "server/cpu_shims/sgl_kernel/__init__.py",
    ):
        assert shipped + name in names, f"{name} is not in the wheel"
    for name in ("sitecustomize.py", "relax_sglang_server_patches.py", "relax_sglang_version_guard.py"):
        assert "relax/sglang/server_site/" + name in names
    venv = tmp_path / "venv"
    for cmd in (
        ["uv", "venv", "-q", "--python", sys.executable, str(venv)],
        [
            "uv",
            "pip",
            "install",
            "-q",
            "--offline",
            "--no-deps",
            "--python",
            str(venv / "bin" / "python"),
            str(wheel),
        ],
    ):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    own_env = bool(
        os.environ.get("RELAX_SGLANG_PYTHON")
    )  # then the CPU env is not built: do not build it here
    probe = "from relax.sglang import server_env as m; print(m.BUILD_SCRIPT)" + (
        "" if own_env else "; print(m.server_python())"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RELAX_SGLANG_PYTHON", "PYTHONPATH")}
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert where.returncode == 0, where.stderr[-3000:]
    script, *python = where.stdout.split()
    assert script.startswith(str(venv)) and script.endswith(shipped + "scripts/build_server_env.sh")
    assert own_env or python == [sglang_python]
