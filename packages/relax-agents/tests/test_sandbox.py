"""The sandboxed ``python`` tool: every hostile program ends quickly with a clear error."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from relax.agents.config import SandboxLimits, ToolsEnvParams
from relax.agents.sandbox import describe_failure, run_python
from relax.agents.tools_env import ToolsEnvironment
from relax.core.data import Sample
from relax.core.protocols import ToolCall, Turn

LIMITS = SandboxLimits(wall_s=3.0, cpu_s=2, memory_mb=256, max_processes=8)


def _run(code: str, limits: SandboxLimits = LIMITS):
    started = time.monotonic()
    result = run_python(code, limits)
    return result, time.monotonic() - started


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split(") ")[1].startswith("Z")


def test_runs_code_in_a_fresh_directory():
    result, _ = _run(
        "import os, math\nopen('note.txt', 'w').write('hi')\nprint(sorted(os.listdir('.')), math.factorial(5))"
    )
    assert result.ok and result.stdout == "['main.py', 'note.txt'] 120\n"
    again, _ = _run("import os\nprint(os.listdir('.'))")  # nothing of the last call is left
    assert again.stdout == "['main.py']\n"


def test_an_endless_loop_is_killed_at_the_wall_time_limit():
    result, took = _run("while True:\n    pass", SandboxLimits(wall_s=1.0, cpu_s=30))
    assert result.timed_out and not result.ok and took < 6
    assert describe_failure(result, LIMITS).startswith("killed: wall-time limit of 3s exceeded")


def test_cpu_time_is_limited():
    result, took = _run("while True:\n    pass", SandboxLimits(wall_s=20, cpu_s=1))
    assert result.exit_code == -24 and not result.timed_out and took < 10  # SIGXCPU
    assert describe_failure(result, SandboxLimits(cpu_s=1)) == "killed: CPU-time limit of 1s exceeded"


def test_allocating_2gb_fails_with_memory_error():
    result, took = _run("x = bytearray(2 * 1024**3)\nprint(len(x))")
    assert result.exit_code == 1 and took < 10
    assert result.stderr.rstrip().endswith("MemoryError")


def test_a_fork_bomb_is_stopped_and_leaves_no_process():
    result, took = _run("import os\nwhile True:\n    os.fork()")
    assert not result.ok and took < 15
    assert result.isolation["processes"]
    assert "BlockingIOError" in result.stderr or result.timed_out
    assert _sandbox_processes() == []


def _sandbox_processes() -> list[int]:
    """Live processes still running the sandbox's child script (a fork bomb's survivors)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if b"sandbox_child.py" in open(f"/proc/{entry}/cmdline", "rb").read() and _alive(int(entry)):
                found.append(int(entry))
        except OSError:
            continue
    return found


def test_a_process_that_escapes_the_group_is_killed_too():
    code = (
        "import os, sys, time\nr, w = os.pipe()\nif os.fork() == 0:\n    os.setsid()\n    os.write(w, str(os.getpid()).encode())\n"
        "    time.sleep(60)\nelse:\n    print(os.read(r, 20).decode())"
    )
    result, _ = _run(code)
    assert result.ok
    if os.geteuid() != 0:
        pytest.skip(
            "only a root parent can kill every process of the call's own uid; see docs/agents-tools.md"
        )
    assert not _alive(int(result.stdout))


def test_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    try:
        result, took = _run(
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        )
        if not result.isolation.get("network"):
            pytest.skip(
                "no network namespace or Landlock TCP rules here: the network is not isolated (documented)"
            )
        assert not result.ok and "connected" not in result.stdout and took < 10
        assert any(
            e in result.stderr for e in ("PermissionError", "Network is unreachable", "ConnectionRefused")
        )
        namespace_only = run_python(
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)",
            SandboxLimits(restrict_files=False),
        )  # no Landlock: the empty namespace alone
        if namespace_only.isolation.get("network"):
            assert not namespace_only.ok and "Network is unreachable" in namespace_only.stderr
        allowed = run_python(
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')",
            SandboxLimits(network=True, restrict_files=False),
        )
        assert allowed.ok and allowed.stdout == "connected\n"  # the same code reaches it when allowed
    finally:
        server.close()


def test_files_outside_the_working_directory_cannot_be_read(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    secret.chmod(0o644)
    tmp_path.chmod(0o755)
    result, _ = _run(f"print(open({str(secret)!r}).read())")
    if not result.isolation.get("files"):
        pytest.skip("Landlock is not available here: world-readable files stay readable (documented)")
    assert not result.ok and "s3cret" not in result.stdout
    assert "PermissionError" in result.stderr
    listing, _ = _run("import os\nprint(os.listdir('/etc'))")
    assert "PermissionError" in listing.stderr


def test_output_is_bounded():
    result, _ = _run("print('x' * 100000)", SandboxLimits(max_output_bytes=1000))
    assert result.ok and len(result.stdout) < 1100 and result.stdout.endswith("[output truncated]")


def test_the_python_tool_turns_failures_into_error_observations():
    env = ToolsEnvironment(
        ToolsEnvParams(tools=["python"], sandbox=SandboxLimits(wall_s=30, memory_mb=256), tool_timeout_s=2.0)
    )
    codes = ["print(6*7)", "raise SystemExit('bye')", "while True: pass", "x = bytearray(2 * 1024**3)"]
    calls = [ToolCall("python", {"code": c}) for c in codes]
    started = time.monotonic()
    result = env.start(Sample(prompt_ids=[1], group_id=0, label="42")).step(Turn(0, "", [], calls, "stop"))
    assert time.monotonic() - started < 15
    texts = [o["content"] for o in result.observations]
    assert texts[0] == "42\n"
    assert texts[1].startswith("Error: tool 'python' failed: exit code 1") and "bye" in texts[1]
    assert texts[2].startswith(
        "Error: tool 'python' failed: killed: wall-time limit of 2s exceeded"
    )  # min(wall_s, tool_timeout_s)
    assert texts[3].startswith("Error: tool 'python' failed: exit code 1") and texts[3].rstrip().endswith(
        "MemoryError"
    )
    assert result.info["tool_calls_ok"] == 1.0 and result.info["tool_errors"] == 3.0
    schema = env.tool_schemas()[0]["function"]
    assert schema["name"] == "python" and schema["parameters"]["required"] == ["code"]
    assert json.dumps(schema)  # OpenAI-format, serialisable
