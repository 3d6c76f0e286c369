"""The control plane end to end, over real HTTP on Ray Serve.

1. During an async quick-start run (real tiny HF model): pause, scale out 1 -> 3 engines (the new
   ones serve the current weight version), ``relax status``, resume, pause, scale in 3 -> 1,
   resume; the run completes and every prompt group is trained exactly once with all its samples.
2. In the simulated cluster (``bench/plugins/sim_plugin.py``, a ``relax run`` subprocess): the
   autoscaler scales out a starved trainer's rollout, steps run with the added engines, and a scale-in of
   a busy engine drains it (its in-flight requests finish; none is resubmitted). How much throughput the
   engines add is a timing, measured by ``bench/elastic.py`` (steps/s with 1, 2 and 3 engines in one run).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import requests

from relax.core.config import load_config
from relax.core.hookspecs import hookimpl
from relax.core.plugins import get_plugin_manager

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
P, N, STEPS = 4, 4, 8


@pytest.fixture(scope="module")
def serve_port(ray_session):
    """One Serve instance for the module (and whatever else in the session uses Serve)."""
    from relax.core.control.server import serve_address

    if serve_address() is None:
        from ray import serve

        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": _free_port()})
    return serve_address()[1]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Operator:
    """Driver-side test plugin: steers the run over HTTP from a thread, as an operator would."""

    def __init__(self, base: str) -> None:
        self.base, self.groups, self.log, self.error = base, [], {}, None
        self.thread: threading.Thread | None = None

    @hookimpl
    def relax_on_run_start(self, run):
        self.thread = threading.Thread(target=self._script, daemon=True)
        self.thread.start()

    @hookimpl
    def relax_filter_group(self, group):
        self.groups.append([(s.group_id, s.index_in_group) for s in group])
        return True

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        resp = requests.request(method, self.base + path, json=body, timeout=30)
        assert resp.ok, f"{method} {path}: HTTP {resp.status_code} {resp.text}"
        return resp.json()

    def wait_op(self, op: dict, timeout_s: float = 120) -> dict:
        deadline = time.monotonic() + timeout_s
        while op["state"] not in ("active", "done", "failed", "cancelled"):
            assert time.monotonic() < deadline, f"operation stuck: {op}"
            time.sleep(0.2)
            op = self.call("GET", f"/operations/{op['id']}")
        return op

    def wait_status(self, ok, timeout_s: float = 120) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                status = self.call("GET", "/status")
                if ok(status):
                    return status
            except (requests.RequestException, AssertionError):
                pass  # the app is still starting
            assert time.monotonic() < deadline, "status condition not reached"
            time.sleep(0.2)

    def _script(self) -> None:
        from relax.core.cli import main

        log = self.log
        try:
            self.wait_status(lambda s: s["state"] == "running")
            log["pause"] = self.wait_op(self.call("POST", "/pause"))
            log["scale_out"] = self.wait_op(self.call("POST", "/engines/scale_out", {"num_engines": 2}))
            log["status_scaled"] = self.wait_status(lambda s: len(s["engines"]) == 3)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                log["cli_rc"] = main(["status", "--address", self.base])
            log["cli_out"] = out.getvalue()
            log["resume"] = self.wait_op(self.call("POST", "/resume"))
            start = log["status_scaled"]["step"]
            log["status_running"] = self.wait_status(lambda s: s["step"] >= start + 2)
            self.wait_op(self.call("POST", "/pause"))
            log["scale_in"] = self.wait_op(self.call("POST", "/engines/scale_in", {"num_engines": 2}))
            log["status_in"] = self.wait_status(lambda s: len(s["engines"]) == 1)
            log["resume2"] = self.wait_op(self.call("POST", "/resume"))
        except BaseException as exc:  # reported by the test
            self.error = exc
            self.call("POST", "/resume")


def test_scale_out_and_in_during_an_async_quickstart_run(ray_session, serve_port, tmp_path):
    from relax.core.controller.run import run

    operator = Operator(f"http://127.0.0.1:{serve_port}")
    get_plugin_manager().pm.register(operator, name="control-test-operator")
    run_dir = tmp_path / "run"
    try:
        cfg = load_config(
            None,
            [
                f"rollout.prompts_per_step={P}",
                f"rollout.n_samples_per_prompt={N}",
                "rollout.max_new_tokens=3",
                "trainer.micro_batch_size=16",
                "data.task_size=200",
                f"total_steps={STEPS}",
                f"run_dir={run_dir}",
                "mode=async",
                "max_staleness=1",
                "logging.progress=false",
                "logging.console=false",
                "logging.tensorboard=false",
                "logging.plot=false",
                "checkpoint.save_hf_final=false",
                "checkpoint.resume=never",
                "control.enabled=true",
                f"control.port={serve_port}",
                "control.publish_s=0.2",
            ],
        )
        summary = run(cfg)
    finally:
        get_plugin_manager().pm.unregister(operator)
    operator.thread.join(timeout=30)
    assert operator.error is None, operator.error
    log = operator.log
    assert summary["steps"] == STEPS
    # scale out 1 -> 3: phases in order, new engines serving the run's current weight version
    out = log["scale_out"]
    assert out["state"] == "active" and out["engine_ids"] == [1, 2], out
    assert out["history"] == ["pending", "taken", "creating", "health-checking", "weight-syncing", "active"]
    scaled = log["status_scaled"]
    assert [(e["engine_id"], e["healthy"], e["weight_version"]) for e in scaled["engines"]] == [
        (i, True, scaled["weight_version"]) for i in range(3)
    ]
    assert [e["protected"] for e in scaled["engines"]] == [True, False, False]
    assert scaled["state"] == "paused"
    # relax status against the live run
    assert log["cli_rc"] == 0 and "paused (async)" in log["cli_out"] and "engine_id" in log["cli_out"]
    # scale in 3 -> 1: the two added engines drained and removed, the protected one kept
    scale_in = log["scale_in"]
    assert scale_in["state"] == "done" and scale_in["engine_ids"] == [1, 2], scale_in
    assert all(r["drained"] for r in scale_in["result"]["engines"].values())
    assert [e["engine_id"] for e in log["status_in"]["engines"]] == [0]
    # nothing lost or duplicated: every group trained once, with all of its samples
    groups = operator.groups
    assert sorted(g[0][0] for g in groups) == list(range(P * STEPS))
    assert all(sorted(i for _, i in g) == list(range(N)) and len({gid for gid, _ in g}) == 1 for g in groups)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert max(r["fault/engines_live"] for r in rows) == 3.0 and rows[-1]["fault/engines_live"] == 1.0


PROBE = """
import json, os, threading, time
import requests

BASE, OUT = os.environ["PROBE_BASE"], os.environ["PROBE_OUT"]
RECORD = {"decisions": {}}
SCALED, DONE = threading.Event(), threading.Event()

def _get(path):
    for _ in range(600):  # the control plane starts after this plugin's run-start hook
        try:
            resp = requests.get(BASE + path, timeout=30)
            if resp.ok:
                return resp.json()
        except requests.ConnectionError:
            pass
        time.sleep(0.1)
    raise TimeoutError(BASE + path)

def _script():
    try:
        while True:  # the autoscaler scales the starved rollout out to max_engines=3
            s = _get("/status")
            for d in (s.get("autoscaler") or {}).get("decisions", []):
                RECORD["decisions"][str(d["step"])] = d
            serving = [e for e in s["engines"] if not e["draining"]]
            if len(serving) == 3 and s["operation"] is None:
                break
            time.sleep(0.1)
        RECORD["scaled_at_step"] = s["step"]
        SCALED.set()
        while True:  # scale in the busiest added engine while it has requests in flight
            busy = [e for e in _get("/engines")["engines"] if not e["protected"] and e["load"] > 0]
            if busy:
                target = max(busy, key=lambda e: e["load"])
                resp = requests.post(BASE + "/engines/scale_in", json={"engine_ids": [target["engine_id"]],
                                     "drain_timeout_s": 60}, timeout=30)
                if resp.status_code == 202:
                    break
            time.sleep(0.05)
        RECORD["drained_engine"], RECORD["load_at_scale_in"] = target["engine_id"], target["load"]
        op = resp.json()
        while op["state"] not in ("active", "done", "failed", "cancelled"):
            time.sleep(0.1)
            op = _get("/operations/" + op["id"])
        RECORD["scale_in"] = op
    except BaseException as exc:
        RECORD["error"] = repr(exc)
    finally:
        SCALED.set()
        DONE.set()

def relax_on_run_start(run):
    threading.Thread(target=_script, daemon=True).start()

def relax_on_step_end(step, metrics):
    steps = int(os.environ["PROBE_STEPS"])  # the run must outlast the script on a slow machine:
    if step == steps - 10:
        SCALED.wait(180)  # engine start-up takes seconds; leave steps (busy engines) for the scale-in
    if step == steps - 1:
        DONE.wait(120)
    try:
        for d in (_get("/status").get("autoscaler") or {}).get("decisions", []):
            RECORD["decisions"][str(d["step"])] = d
    except Exception:
        pass

def relax_on_run_end(run, status):
    RECORD["status"] = status
    with open(OUT, "w") as f:
        json.dump(RECORD, f)
"""

SIM = [
    "rollout.engine=sim",
    "trainer.backend=sim",
    "reward.name=sim",
    "rollout.num_engines=1",
    "rollout.engine_params.slots=2",
    "rollout.engine_params.token_s=0.003",
    "rollout.engine_params.mean_len=30",
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "trainer.recompute_old_logprobs=false",
    "mode=async",
    "max_staleness=1",
    "logging.progress=false",
    "logging.console=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "checkpoint.save_hf_final=false",
    "checkpoint.resume=never",
    "data.task_size=2000",
    "control.enabled=true",
    "control.publish_s=0.2",
    "control.autoscaler.enabled=true",
    "control.autoscaler.max_engines=3",
    "control.autoscaler.steps=2",
    "control.autoscaler.cooldown_s=1",
]


def test_autoscaler_scales_out_a_starved_trainer_and_scale_in_drains_a_busy_engine(tmp_path):
    (tmp_path / "ctl_probe.py").write_text(textwrap.dedent(PROBE))
    port, out, run_dir = _free_port(), tmp_path / "probe.json", tmp_path / "run"
    env = {
        **os.environ,
        "RAY_ADDRESS": "",
        "RELAX_PLUGINS": "sim_plugin,ctl_probe",
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "bench" / "plugins"), str(tmp_path), os.environ.get("PYTHONPATH", "")]
        ),
        "PROBE_BASE": f"http://127.0.0.1:{port}",
        "PROBE_OUT": str(out),
        "PROBE_STEPS": "40",
    }
    args = [*SIM, "total_steps=40", f"run_dir={run_dir}", f"control.port={port}"]
    proc = subprocess.run(
        [sys.executable, "-m", "relax.core.cli", "run", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert "error" not in record, record["error"]
    # the autoscaler saw the starved trainer and scaled out, saying why
    outs = [d for d in record["decisions"].values() if d["action"] == "scale_out"]
    assert len(outs) >= 2 and all("rollout is the bottleneck" in d["reason"] for d in outs), record[
        "decisions"
    ]
    assert "autoscaler: step" in proc.stderr
    # steps ran with one engine, then with the three the autoscaler asked for (the throughput they add is
    # bench/elastic.py's: on the 2-core CI machine a one-step mean at 3 engines came out at 1.2x a 20-step one at 1)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    live = [r["fault/engines_live"] for r in rows]
    assert live[0] == 1 and 3 in live, live
    # scale-in of a busy engine drained it: its in-flight requests finished there, none resubmitted
    scale_in = record["scale_in"]
    assert record["load_at_scale_in"] > 0 and scale_in["state"] == "done", scale_in
    assert scale_in["result"]["engines"] == {
        str(record["drained_engine"]): {"drained": True, "forced_requests": 0}
    }
    assert scale_in["history"][:3] == ["pending", "taken", "draining"]
    assert rows[-1]["fault/resubmitted_requests"] == 0 and len(rows) == 40
