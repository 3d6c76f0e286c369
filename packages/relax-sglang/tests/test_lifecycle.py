"""Server lifecycle: a bad interpreter is a clear error; stopping a server leaves no process of its group
and frees its port; a dead server is detected and named by ``health`` and restarts (restart on a stand-in
server; the session's real server is killed by the last test of the session, so it is launched once)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import textwrap

import pytest

from relax.core.protocols import GenerationRequest, SamplingParams
from relax.sglang.client import SGLangHTTPError
from relax.sglang.params import SGLangEngineParams
from relax.sglang.server import ServerError, ServerProcess, live_group_members

# stands in for sglang.launch_server where only process handling is under test: a real HTTP server on
# --port with a child process in its group, as SGLang's scheduler/detokenizer are
FAKE_LAUNCHER = textwrap.dedent("""
    import http.server, json, os, subprocess, sys
    port = int(sys.argv[sys.argv.index("--port") + 1])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"weight_version": "default", "version": os.environ.get("FAKE_SGLANG", "0.5.23")}).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
""")


def _generate(engine, n: int = 4):
    req = GenerationRequest("k", [4, 5, 6], SamplingParams(max_new_tokens=n, ignore_eos=True, seed=0))
    return asyncio.run(asyncio.wait_for(engine.generate([req]), 300))[0]


def _port_free(host: str, port: int) -> bool:
    """Bindable as a server binds it (SO_REUSEADDR: connections in TIME_WAIT do not count, a listener does)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            return True
        except OSError:
            return False


def test_a_missing_interpreter_is_a_clear_error(tmp_path):
    server = ServerProcess(
        SGLangEngineParams(python="/nonexistent/bin/python"), "/m", "float32", tmp_path / "s.log"
    )
    with pytest.raises(ServerError, match=r"cannot run engine_params.python '/nonexistent/bin/python'"):
        server.start()


def _fake_params(tmp_path, version: str = "0.5.23") -> SGLangEngineParams:
    pkg = tmp_path / "fake" / "sglang"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(FAKE_LAUNCHER)
    env = {"PYTHONPATH": str(tmp_path / "fake"), "FAKE_SGLANG": version}
    return SGLangEngineParams(python=sys.executable, env=env, startup_timeout_s=60)


def test_stop_leaves_no_process_and_frees_the_port(tmp_path):
    server = ServerProcess(_fake_params(tmp_path), "/m", "float32", tmp_path / "logs" / "s.log", index=1)
    server.start()
    pgid, port = server.proc.pid, server.port
    assert server.alive() and not _port_free("127.0.0.1", port)
    server.stop()
    assert live_group_members(pgid) == [], "processes of the server's group outlived stop()"
    assert _port_free("127.0.0.1", port), f"port {port} still bound after stop()"
    assert "sglang.launch_server" in (tmp_path / "logs" / "s.log").read_text()


def test_a_dead_launched_server_is_named_by_health_and_restarts(tmp_path, tiny_dirs):
    """The restart path on a cheap stand-in server (the real server's death is the last test below)."""
    from relax.sglang.engine import SGLangEngine

    engine = SGLangEngine(_fake_params(tmp_path), tiny_dirs[0], run_dir=str(tmp_path))
    try:
        first = engine.server.proc.pid
        os.killpg(first, signal.SIGKILL)
        engine.server.proc.wait(30)
        health = engine.health()
        assert (
            health["ok"] is False
            and f"sglang engine[0] at {engine.url} exited with code -9" in health["error"]
        )
        engine.restart()
        assert (
            engine.health()["ok"] is True and engine.server.proc.pid != first and engine.weight_version() == 0
        )
    finally:
        engine.close()
    assert live_group_members(engine.server.proc.pid) == []


def test_a_server_older_than_the_endpoints_relax_calls_is_refused_at_start_up(tmp_path, tiny_dirs):
    """A server reporting an SGLang release without /begin_weight_update etc. stops the engine's start (the
    message names both versions), and the engine does not leave it running."""
    from relax.sglang.engine import SGLangEngine

    with pytest.raises(ServerError, match=r"needs sglang >= 0\.5\.23 .* reports sglang 0\.4\.9") as err:
        SGLangEngine(_fake_params(tmp_path, "0.4.9"), tiny_dirs[0], run_dir=str(tmp_path))
    port = int(str(err.value).split("server at http://127.0.0.1:")[1].split(":")[0])
    assert _port_free("127.0.0.1", port), "the refused server was left running"


@pytest.mark.kills_shared_server
def test_killed_server_is_detected_and_named(sglang_engine):
    """Kills the session's real server for good: ordered after every other test (see conftest)."""
    engine = sglang_engine
    assert _generate(engine).finish_reason == "length"
    os.killpg(engine.server.proc.pid, signal.SIGKILL)
    engine.server.proc.wait(30)
    health = engine.health()
    assert health["ok"] is False and f"sglang engine[0] at {engine.url} exited" in health["error"], health
    with pytest.raises(SGLangHTTPError, match=r"sglang engine\[0\] at .*/generate failed"):
        _generate(engine)
