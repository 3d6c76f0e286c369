"""The cluster path an operator takes, end to end: a head and worker nodes started with ``ray start``
(each on its own 127.0.0.x address, ports chosen free, every process stopped by the test), ``relax run
--address`` joining it from a directory only the driver uses (relative ``run_dir``), in hybrid mode with
the trainer and the rollout engines on different nodes; nodes joining mid-run are used by the
autoscaler and by ``relax scale-out``, each new engine placed on a node that joined and serving the
run's current weight version. ``relax engines`` shows every engine's node. The cluster runs Ray's token
authentication (as ``ray start --head`` turns it on where ``~/.ray/auth_token`` exists; the rest of the
suite disables it), and a driver without it is told so, with the export that fixes it.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from relax.core.control.cli import ControlClient
from relax.core.testing.cluster import NodeSpec, RayStartCluster, free_port

pytestmark = pytest.mark.slow

STEPS = 12
CONFIG = """\
mode: hybrid
max_staleness: 1
total_steps: {steps}
run_dir: runs/cli            # relative: the driver's directory, which no node's processes run in
rollout: {{prompts_per_step: 2, n_samples_per_prompt: 4, max_new_tokens: 8, ignore_eos: true, host: separate,
           num_engines: 1, timeout_s: 120}}
trainer: {{micro_batch_size: 8}}
data: {{task_size: 100}}
weight_sync: {{transport: broadcast}}
logging: {{progress: false, tensorboard: false, plot: false}}
checkpoint: {{save_every: 4, save_hf_final: false, resume: never}}
ray: {{nodes: {{trainer: train, rollout: rollout}}}}
control:
  enabled: true
  port: {port}
  publish_s: 0.2
  autoscaler: {{enabled: true, steps: 3, idle_frac: 0.0, starved_fill: 1.0, max_engines: 3, cooldown_s: 0}}
"""


def _cli(*args: str) -> tuple[int, str]:
    from relax.core.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(list(args))
    return rc, out.getvalue()


def _until(what: str, check, proc: subprocess.Popen, log: Path, timeout_s: float = 180):
    """Poll ``check()`` until it returns something truthy; fail naming ``what`` (and the run's output)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(Exception):
            if result := check():
                return result
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{what}: not reached (run exit code {proc.poll()}):\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


def _settled(client: ControlClient, engines: int) -> dict | None:
    """The paused run's status once it shows ``engines`` engines, each serving its weight version (a step
    in flight when the pause arrived has committed and synced)."""
    status = client.request("GET", "/status")
    engines = status["engines"] if len(status["engines"]) == engines else []
    in_sync = engines and all(
        e["healthy"] and e["weight_version"] == status["weight_version"] for e in engines
    )
    return status if status["state"] == "paused" and in_sync and status["operation"] is None else None


def test_relax_run_joins_a_ray_start_cluster_and_uses_nodes_that_join(tmp_path):
    driver_dir = tmp_path / "driver"  # the driver's current directory; the nodes run from elsewhere
    driver_dir.mkdir()
    port = free_port()
    (driver_dir / "cluster.yaml").write_text(CONFIG.format(steps=STEPS, port=port))
    stranger_dir = tmp_path / "stranger"  # a driver that does not run token auth
    stranger_dir.mkdir()
    (stranger_dir / "cluster.yaml").write_text(CONFIG.format(steps=STEPS, port=free_port()))
    with (
        tempfile.TemporaryDirectory(prefix="rx") as short,
        RayStartCluster(short, auth_token=uuid.uuid4().hex) as cluster,
    ):
        cluster.start(NodeSpec("head", 1))
        cluster.start(NodeSpec("train", 2), NodeSpec("rollout-a", 1, label="rollout"))
        log = tmp_path / "run.log"
        relax = str(Path(sys.executable).with_name("relax"))
        with log.open("w") as out:
            proc = subprocess.Popen(
                [relax, "run", "cluster.yaml", "--address", cluster.address],
                cwd=driver_dir,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=cluster.env(),
            )
        stranger = subprocess.Popen(
            [relax, "run", "cluster.yaml", "--address", cluster.address],
            cwd=stranger_dir,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**cluster.env(), "RAY_AUTH_MODE": "disabled"},
        )
        try:
            client = ControlClient(f"http://127.0.0.1:{port}", timeout_s=10)
            _until(
                "the control plane", lambda: client.request("GET", "/status")["state"] == "running", proc, log
            )
            assert (
                _cli("pause", "--wait", "--address", client.address)[0] == 0
            )  # holds after the step in flight
            # 1. two nodes join; the operator scales out with the CLI: Ray puts the engine on one of them
            joined = set(
                cluster.start(*(NodeSpec(f"rollout-{n}", 1, label="rollout") for n in "bc"), timeout_s=300)
            )  # a loaded machine
            rc, text = _cli("scale-out", "1", "--wait", "--json", "--address", client.address)
            cli_op = json.loads(text)
            assert rc == 0 and cli_op["state"] == "active" and cli_op["engine_ids"] == [1], text
            assert cli_op["history"][-2:] == ["weight-syncing", "active"]  # synced before it serves
            _until("the paused run settled", lambda: _settled(client, 2), proc, log)
            rc, text = _cli("engines", "--json", "--address", client.address)
            nodes = {e["engine_id"]: e["node"] for e in json.loads(text)["engines"]}
            assert rc == 0 and nodes[0] == cluster.ips["rollout-a"] and nodes[1] in joined, nodes
            # 2. the autoscaler (rollout the bottleneck for 3 steps) puts its engine on the other one
            assert _cli("resume", "--wait", "--address", client.address)[0] == 0
            op = _until(
                "an autoscaler scale-out",
                lambda: next(
                    (o for o in client.request("GET", "/operations") if o["source"] == "autoscaler"), None
                ),
                proc,
                log,
            )
            assert _cli("pause", "--wait", "--address", client.address)[0] == 0
            auto_op = _until(
                "the autoscaler's engine serving",
                lambda: (o := client.request("GET", f"/operations/{op['id']}"))["state"] == "active" and o,
                proc,
                log,
            )
            assert auto_op["kind"] == "scale_out" and auto_op["engine_ids"] == [2], auto_op
            assert auto_op["history"][-2:] == ["weight-syncing", "active"]
            status = _until("the paused run settled", lambda: _settled(client, 3), proc, log)
            assert {e["engine_id"]: e["node"] for e in status["engines"]} == {
                **nodes,
                2: (joined - {nodes[1]}).pop(),
            }
            assert _cli("resume", "--wait", "--address", client.address)[0] == 0
            assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]
            said = stranger.communicate(timeout=120)[0]
        finally:
            for p in (proc, stranger):
                if p.poll() is None:
                    p.terminate()
                    p.wait(timeout=60)
    assert stranger.returncode == 1, said[-3000:]
    assert (
        f"relax: stopped: ClusterJoinError: could not join the Ray cluster at {cluster.address}: authentication: "
        "the cluster runs Ray's token authentication and this driver does not (RAY_AUTH_MODE=disabled): run "
        "`export RAY_AUTH_MODE=token`"
    ) in said, said[-3000:]
    output = log.read_text()
    assert f"in hybrid mode for {STEPS} steps -> {driver_dir / 'runs' / 'cli'}" in output
    assert "relax: done in" in output
    run_dir = driver_dir / "runs" / "cli"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)) and rows[-1]["policy_version"] == STEPS
    live = [r["fault/engines_live"] for r in rows]
    assert 3 in live and rows[-1]["weight_sync/bytes"] > 0, live
    # after the last resume the autoscaler may scale in again (on a fast machine the queue stays full for its
    # 3 steps): only then, and saying why
    assert live[-1] == 3 or (
        "scale_in -- the queue stays full" in output and "removed (drained)" in output
    ), live
    # the trainer, on another node with another current directory, saved where the driver's run_dir is
    assert (run_dir / "checkpoints" / f"step_{STEPS:06d}" / "manifest.json").is_file()
