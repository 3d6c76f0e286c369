"""Several Ray nodes on one machine, for tests and benches: Ray's own ``ray.cluster_utils.Cluster``
with each node on its own loopback address (127.0.0.1, 127.0.0.2, ...), its own CPUs and its own
``relax-node`` label, so placement by node, transports across nodes and node loss run for real.

Every listener binds to its node's 127.0.0.x address (the same single-machine switch as ``relax run``,
``controller.ray_start``), and the cluster's address is *not* written to Ray's well-known address
file: a ``ray.init()`` elsewhere on the machine (another test, another run) must never join it.
Each node has its own Ray session directory; they share the machine's file system and ``/dev/shm``
(what differs across real machines is checked by node id, not by path: see ``weight_sync``), except
``RayStartCluster`` nodes started with ``private_mounts=True``: each runs in its own mount namespace
with its own empty ``/tmp`` and ``/dev/shm`` (where root is available), as on separate machines.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from relax.core.cluster import NODE_LABEL

#: a lost node is declared dead after ~3 s (Ray's default waits longer: real networks hiccup); what a
#: loss triggers -- rescheduling its placement-group bundles, replacing its engines -- follows sooner
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}
#: what a node started with ``private_mounts`` does not share with the machine: an empty tmpfs of its own on each
PRIVATE_MOUNTS = ("/tmp", "/dev/shm")
#: how often a node that missed Ray's fixed registration window is started again (a loaded machine)
RETRIES = 3


@dataclass(frozen=True)
class NodeSpec:
    """One simulated machine: its name, its label value (``ray.nodes`` pins roles to it) and its CPUs."""

    name: str
    num_cpus: int = 1
    label: str | None = None  # its ``relax-node`` label; None: its name (several nodes may share a label)
    resources: dict[str, float] = field(default_factory=dict)


@contextmanager
def _quiet_address_file() -> Iterator[None]:
    """Ray records a started head in ``/tmp/ray/ray_current_cluster`` so that a bare ``ray.init()``
    joins it; a test cluster must not capture other processes' Ray, so nothing is written."""
    import ray._private.utils as ray_utils

    saved = ray_utils.write_ray_address
    ray_utils.write_ray_address = lambda *args, **kwargs: None
    try:
        yield
    finally:
        ray_utils.write_ray_address = saved


class LocalCluster:
    """``LocalCluster([NodeSpec("head"), NodeSpec("train", 2), NodeSpec("rollout", 2)])``: the first
    node is the head (the driver connects through it). ``connect()`` joins this process to it."""

    def __init__(self, nodes: list[NodeSpec], object_store_mb: int = 100) -> None:
        from ray.cluster_utils import Cluster

        from relax.core.controller.ray_start import RAY_ENV, _single_machine

        for key, value in RAY_ENV.items():
            os.environ.setdefault(key, value)
        self._store = object_store_mb << 20
        self._next_ip = 1
        self.nodes: dict[str, Any] = {}
        head, *workers = nodes
        with _single_machine(), _quiet_address_file():
            self.cluster = Cluster(
                initialize_head=True,
                shutdown_at_exit=True,
                head_node_args={
                    **self._node_args(head),
                    "include_dashboard": False,
                    "_system_config": HEALTH_CHECKS,
                },
            )
            self.nodes[head.name] = self.cluster.head_node
            for spec in workers:
                self.add_node(spec)

    def _node_args(self, spec: NodeSpec) -> dict[str, Any]:
        ip = f"127.0.0.{self._next_ip}"
        self._next_ip += 1
        return {
            "num_cpus": spec.num_cpus,
            "node_ip_address": ip,
            "labels": {NODE_LABEL: spec.label or spec.name},
            "resources": dict(spec.resources),
            "object_store_memory": self._store,
        }

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_node(self, spec: NodeSpec) -> Any:
        """Start one more node (a machine joining); returns Ray's node object."""
        from relax.core.controller.ray_start import _single_machine

        if spec.name in self.nodes:
            raise ValueError(f"node {spec.name!r} exists already")
        with _single_machine(), _quiet_address_file():
            node = self.cluster.add_node(**self._node_args(spec))
        self.nodes[spec.name] = node
        return node

    def remove_node(self, name: str) -> None:
        """Kill every process of node ``name`` (a machine lost: no graceful drain)."""
        self.cluster.remove_node(self.nodes.pop(name), allow_graceful=False)

    def node_id(self, name: str) -> str:
        return self.nodes[name].node_id

    def ip(self, name: str) -> str:
        return self.nodes[name].node_ip_address

    def connect(self, **init_kwargs: Any) -> None:
        """``ray.init`` this process into the cluster, through the head's loopback address."""
        import ray

        from relax.core.controller.ray_start import _single_machine

        with _single_machine():  # else Ray "resolves" the 127.0.0.1 address to the machine's network address
            ray.init(
                address=self.address,
                _node_ip_address=self.ip(next(iter(self.nodes))),
                include_dashboard=False,
                **{"log_to_driver": False, **init_kwargs},
            )

    def shutdown(self) -> None:
        """Disconnect this process (if connected) and stop every node."""
        import ray

        if ray.is_initialized():
            ray.shutdown()
        self.cluster.shutdown()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the caller binds it soon after)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RayStartCluster:
    """Nodes started as an operator starts them: ``ray start --block`` processes, each on its own
    loopback address (the head 127.0.0.2, then .3, .4, ...) with its own CPUs and ``relax-node`` label,
    every port chosen free, each with its own Ray temp dir under ``root`` (sockets and logs of nodes
    started together never collide; the machine's ``/tmp/ray/ray_current_cluster`` never points at it). Not 127.0.0.1: Ray rewrites that one address to
    the machine's network address, and its single-machine switch refuses worker nodes; any other
    127.0.0.x is an ordinary node address to it. ``stop()`` ends exactly the processes started here
    (each node is its own process group). ``auth_token``: every node and the driver run Ray's token
    authentication with this token (``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN``), as a cluster started
    where ``~/.ray/auth_token`` exists does; None: as the environment says."""

    HEAD_IP = "127.0.0.2"

    def __init__(
        self, root: str | os.PathLike[str], object_store_mb: int = 100, auth_token: str | None = None
    ) -> None:
        from pathlib import Path

        self.root = Path(root)  # keep it short: Ray's socket paths under it must fit in 107 bytes
        self._store = object_store_mb << 20
        self.procs: dict[str, Any] = {}
        self.ips: dict[str, str] = {}
        self.private: set[str] = set()  # nodes in a mount namespace of their own
        self.port = free_port(self.HEAD_IP)
        self.address = f"{self.HEAD_IP}:{self.port}"
        self.auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": auth_token} if auth_token else {}

    def env(self) -> dict[str, str]:
        """The environment of the nodes (and of a driver joining them): loopback-only Ray, with token
        authentication when the cluster has a token."""
        from relax.core.controller.ray_start import RAY_ENV

        return {**os.environ, **RAY_ENV, **self.auth}

    def command(self, spec: NodeSpec, ip: str, head: bool) -> list[str]:
        """The ``ray start`` command line of one node (what docs/cluster.md shows, plus free ports)."""
        import json
        import sys
        from pathlib import Path

        ray = str(Path(sys.executable).with_name("ray"))
        where = (
            [
                "--head",
                f"--port={self.port}",
                "--include-dashboard=false",
                f"--dashboard-port={free_port(ip)}",
                f"--ray-client-server-port={free_port(ip)}",
            ]
            if head
            else [f"--address={self.address}"]
        )
        return [
            ray,
            "start",
            "--block",
            *where,
            f"--node-ip-address={ip}",
            f"--num-cpus={spec.num_cpus}",
            f"--labels={NODE_LABEL}={spec.label or spec.name}",
            f"--temp-dir={self.root / ip}",
            f"--object-store-memory={self._store}",
            "--min-worker-port=0",
            "--max-worker-port=0",
            f"--dashboard-agent-listen-port={free_port(ip)}",
            "--disable-usage-stats",
            *([f"--resources={json.dumps(spec.resources)}"] if spec.resources else []),
        ]

    def private_command(self, spec: NodeSpec, ip: str, head: bool) -> list[str]:
        """``command`` run in a mount namespace of its own: an empty tmpfs over each of ``PRIVATE_MOUNTS``
        (its Ray temp dir lands in the private ``/tmp``), then ``exec ray start``; what the node's
        processes write there, no other node sees, and it is gone when the node stops."""
        mounts = " && ".join(
            f"mount -t tmpfs -o mode=1777 relax-{spec.name} {path}" for path in PRIVATE_MOUNTS
        )
        return [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f'{mounts} && mkdir -p "{self.root / ip}" && exec "$@"',
            "sh",
            *self.command(spec, ip, head),
        ]

    def start(self, *specs: NodeSpec, timeout_s: float = 120.0, private_mounts: bool = False) -> list[str]:
        """Start nodes ``specs`` together (the cluster's first node is the head: start it alone) and
        wait until each runs; returns their addresses. A node whose raylet missed Ray's fixed 30 s
        registration window (a loaded machine) is started again, up to ``RETRIES`` times. ``private_mounts``: each in a
        mount namespace of its own (``private_command``; see ``mount_namespaces_unavailable``), never
        the head (a driver joins through the head's sockets, in its temp dir)."""
        import time

        if private_mounts and not self.procs:
            raise ValueError("private_mounts: the head shares the driver's files; start it first, without")
        for spec in specs:
            if spec.name in self.procs:
                raise ValueError(f"node {spec.name!r} exists already")
            if private_mounts:
                self.private.add(spec.name)
            self._launch(spec, f"127.0.0.{len(self.procs) + 2}", head=not self.procs)
        deadline = time.monotonic() + timeout_s
        for spec in specs:
            retries = 0
            while "Ray runtime started" not in (log := self.root / f"{spec.name}.log").read_text():
                proc = self.procs[spec.name]
                if (
                    proc.poll() is not None
                    and retries < RETRIES
                    and "timed out during startup" in log.read_text()
                ):
                    retries += 1
                    self._launch(spec, self.ips[spec.name], head=spec.name == next(iter(self.procs)))
                elif proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"ray start of node {spec.name} ({self.ips[spec.name]}) failed:\n"
                        f"{log.read_text()[-3000:]}"
                    )
                time.sleep(0.2)
        return [self.ips[spec.name] for spec in specs]

    def _launch(self, spec: NodeSpec, ip: str, head: bool) -> None:
        import subprocess

        if (failed := self.procs.get(spec.name)) is not None:
            _kill_group(failed)
        with (self.root / f"{spec.name}.log").open("w") as out:
            cmd = (
                self.private_command(spec, ip, head)
                if spec.name in self.private
                else self.command(spec, ip, head)
            )
            self.procs[spec.name] = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True
            )
        self.ips[spec.name] = ip

    def in_node(self, name: str, *cmd: str) -> Any:
        """Run ``cmd`` as the processes of node ``name`` see the file system: ``nsenter`` into its mount
        namespace (its ``ray start`` process leads the node and lives as long as it)."""
        import subprocess

        return subprocess.run(
            ["nsenter", f"--target={self.procs[name].pid}", "--mount", *cmd],
            capture_output=True,
            text=True,
            timeout=30,
        )

    def sees(self, name: str, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` exists for the processes of node ``name``."""
        found = self.in_node(name, "test", "-e", str(path))
        if found.returncode not in (0, 1) or found.stderr:
            raise RuntimeError(f"nsenter into node {name}: {found.stderr.strip() or found.returncode}")
        return found.returncode == 0

    def stop(self) -> None:
        """Stop every node, workers included (newest first, the head last)."""
        import signal
        import subprocess

        for name, proc in reversed(list(self.procs.items())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    pass
            _kill_group(proc)  # whatever of its group outlived it
            del self.procs[name]

    def __enter__(self) -> RayStartCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def mount_namespaces_unavailable() -> str | None:
    """Why nodes cannot get mount namespaces of their own here (None: they can): it needs util-linux's
    ``unshare`` and ``nsenter`` and the right to mount (root); checked by mounting a tmpfs over ``/tmp``
    in a throwaway namespace, never assumed."""
    import shutil
    import subprocess

    if missing := [tool for tool in ("unshare", "nsenter") if shutil.which(tool) is None]:
        return f"{' and '.join(missing)} not found (util-linux)"
    try:
        probe = subprocess.run(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "mount",
                "-t",
                "tmpfs",
                "relax-probe",
                PRIVATE_MOUNTS[0],
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare failed: {exc}"
    if probe.returncode != 0:
        return (
            f"cannot mount in a new mount namespace (root needed; uid {os.getuid()}): {probe.stderr.strip()}"
        )
    return None


def _kill_group(proc: Any) -> None:
    """SIGKILL the process group ``proc`` leads (a node started here: its daemons and workers)."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
