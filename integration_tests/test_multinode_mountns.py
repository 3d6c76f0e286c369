"""Nodes that share no files, as separate machines: the ``ray start`` path of test_multinode_cli.py with
the trainer's and the engine's nodes each in a mount namespace of its own (an empty ``/tmp`` and
``/dev/shm`` each; root needed, detected). What a role writes to its node's ``/tmp`` no other node sees;
a disk transport on such a path is detected with the transport's own error; a run whose weights cross
nodes by a cluster transport (``broadcast``) trains and checkpoints into a ``run_dir`` all nodes see.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from relax.core.testing.cluster import PRIVATE_MOUNTS, NodeSpec, RayStartCluster, mount_namespaces_unavailable

pytestmark = pytest.mark.slow

STEPS = 2
CONFIG = """\
mode: hybrid
max_staleness: 1
total_steps: {steps}
run_dir: runs/mountns        # relative: under the driver's directory, which every node sees
rollout: {{prompts_per_step: 2, n_samples_per_prompt: 4, max_new_tokens: 8, ignore_eos: true, host: separate,
           num_engines: 1, timeout_s: 120}}
trainer: {{micro_batch_size: 8}}
data: {{task_size: 100}}
weight_sync: {{transport: broadcast}}
logging: {{progress: false, tensorboard: false, plot: false}}
checkpoint: {{save_every: {steps}, save_hf_final: false, resume: never}}
ray: {{nodes: {{trainer: train, rollout: rollout}}}}
"""


def _private(path: Path) -> bool:
    """Whether ``path`` is under a mount a namespaced node has its own copy of (so the nodes miss it)."""
    return any(path.resolve().is_relative_to(mount) for mount in PRIVATE_MOUNTS)


@pytest.fixture
def shared_dir():
    """A directory every node sees: pytest's ``tmp_path`` is under ``/tmp``, private to each node, so
    ``/var/tmp`` (or the repo's ignored ``runs/`` where that is missing)."""
    base = Path("/var/tmp")
    if not (base.is_dir() and os.access(base, os.W_OK)) or _private(base):
        base = Path(__file__).resolve().parents[1] / "runs"
        base.mkdir(exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="relax-mountns-", dir=base))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _relax_run(
    cluster: RayStartCluster, cwd: Path, *overrides: str, timeout_s: float = 240
) -> tuple[int, str]:
    relax = str(Path(sys.executable).with_name("relax"))
    done = subprocess.run(
        [relax, "run", "cluster.yaml", *overrides, "--address", cluster.address],
        cwd=cwd,
        env=cluster.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout_s,
    )
    return done.returncode, done.stdout


def test_nodes_in_separate_mount_namespaces_share_no_files(shared_dir, monkeypatch):
    if reason := mount_namespaces_unavailable():
        pytest.skip(f"nodes in mount namespaces of their own: {reason}")
    if hidden := [p for p in (Path(sys.prefix), Path(__file__)) if _private(p)]:
        pytest.skip(
            f"nodes in mount namespaces of their own: {hidden[0]} is under {PRIVATE_MOUNTS}, which every "
            "namespaced node replaces with its own tmpfs, so its `ray start` could not run this venv; run "
            "from a checkout outside them"
        )
    from relax.core.quickstart_model import ensure_quickstart_model

    model = Path(ensure_quickstart_model())  # the driver resolves it and hands the path to every role
    if _private(model):  # e.g. RELAX_CACHE_DIR=/tmp/...: the same model, at a path the nodes see
        shutil.copytree(model, shared_dir / "cache" / model.name)
        monkeypatch.setenv("RELAX_CACHE_DIR", str(shared_dir / "cache"))
    driver_dir = shared_dir / "driver"
    driver_dir.mkdir()
    (driver_dir / "cluster.yaml").write_text(CONFIG.format(steps=STEPS))
    mark = f"relax-mountns-{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="rx") as short, RayStartCluster(short) as cluster:
        cluster.start(NodeSpec("head", 1))
        cluster.start(NodeSpec("train", 2), NodeSpec("rollout", 1), private_mounts=True)

        # 1. a file in one node's /dev/shm is its own: not the driver's (the head's), not another node's
        shm = Path("/dev/shm") / mark
        assert cluster.in_node("train", "touch", str(shm)).returncode == 0
        assert cluster.sees("train", shm) and not cluster.sees("rollout", shm) and not shm.exists()

        # 2. disk sync on a /tmp path: the trainer (a Ray actor on its node) writes the directory and a
        # probe; the engine's node cannot see it, and the transport says so before loading any weights
        weights = Path("/tmp") / mark / "weights"
        rc, output = _relax_run(
            cluster,
            driver_dir,
            "weight_sync.transport=disk",
            f"weight_sync.params.directory={weights}",
            "total_steps=1",
            "run_dir=runs/disk",
        )
        assert rc != 0, output[-4000:]
        assert (
            f"weight_sync.params.directory {weights} is not visible from this engine's node "
            f"({cluster.ips['rollout']})"
        ) in output, output[-4000:]
        assert cluster.sees("train", weights)  # the trainer wrote it, in its node's /tmp ...
        assert not cluster.sees("rollout", weights) and not weights.exists()  # ... and nobody else sees it

        # 3. weights cross nodes by a cluster transport: the run trains and checkpoints where all see
        rc, output = _relax_run(cluster, driver_dir)
        assert rc == 0, output[-4000:]
    assert "relax: done in" in output
    run_dir = driver_dir / "runs" / "mountns"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)) and rows[-1]["policy_version"] == STEPS
    assert all(r["weight_sync/bytes"] > 0 for r in rows)
    # the trainer, in its own namespace, saved into the driver's run_dir (a path outside /tmp and /dev/shm)
    assert (run_dir / "checkpoints" / f"step_{STEPS:06d}" / "manifest.json").is_file()
