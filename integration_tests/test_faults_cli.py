"""``relax run`` as a user runs it: Ctrl-C (SIGINT to its process group), and what it listens on.

Each test starts ``relax run`` in its own session (so the signal reaches exactly that run's
process group, as a terminal's Ctrl-C does) with its own embedded Ray, records the Ray processes
that descend from it while it runs, and checks them -- never anyone else's Ray on this machine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from relax.core.controller.teardown import alive, ray_processes

pytestmark = pytest.mark.slow

RELAX = [sys.executable, "-m", "relax.core.cli", "run"]
ARGS = [
    "total_steps=400",
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=3",
    "trainer.micro_batch_size=16",
    "trainer.num_minibatches=1",
    "data.task_size=200",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "checkpoint.save_hf_final=false",
    "checkpoint.resume=never",
]
LOOPBACK = re.compile(r"^(127\.\d+\.\d+\.\d+|\[::ffff:127\.\d+\.\d+\.\d+\]|\[::1\]|localhost):\d+$")


class RelaxRun:
    """A ``relax run`` subprocess in its own process group, its output and its Ray processes."""

    def __init__(self, run_dir: Path, *extra: str) -> None:
        env = {
            k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"
        }  # Ray's default auth, as users get it
        env.update(
            RAY_ENABLE_UV_RUN_RUNTIME_ENV="0",
            RAY_USAGE_STATS_ENABLED="0",
            HF_HUB_OFFLINE="1",
            OMP_NUM_THREADS="1",
        )
        self.run_dir = run_dir
        self.proc = subprocess.Popen(
            [*RELAX, *ARGS, f"run_dir={run_dir}", *extra],
            env=env,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self.ray: dict[int, int] = {}  # every Ray process seen descending from the run: pid -> start time
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for_steps(self, n: int, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        metrics = self.run_dir / "metrics.jsonl"
        while time.monotonic() < deadline:
            self.ray.update(ray_processes(self.proc.pid))
            if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
                self.ray.update(ray_processes(self.proc.pid))
                return
            assert self.proc.poll() is None, f"relax run exited early:\n{self.output}"
            time.sleep(0.2)
        raise AssertionError(f"relax run did not reach step {n}:\n{self.output}")

    def interrupt(self, times: int = 1) -> float:
        """SIGINT to the run's process group (a terminal Ctrl-C); a second one once the run said it
        is stopping (so that it lands during the shutdown). Returns seconds until it exited."""
        started = time.monotonic()
        os.killpg(self.proc.pid, signal.SIGINT)
        if times > 1:
            deadline = time.monotonic() + 60
            while "received: stopping" not in self.output and time.monotonic() < deadline:
                time.sleep(0.01)
            os.killpg(self.proc.pid, signal.SIGINT)
        self.proc.wait(timeout=120)
        self._reader.join(timeout=10)
        return time.monotonic() - started

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in alive(self.ray):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def relax_run(tmp_path):
    runs: list[RelaxRun] = []

    def start(*extra: str) -> RelaxRun:
        runs.append(RelaxRun(tmp_path / f"run{len(runs)}", *extra))
        return runs[-1]

    yield start
    for r in runs:
        r.kill()


def _listeners(pids: set[int]) -> list[tuple[str, int]]:
    """(local address, pid) of every listening TCP socket owned by ``pids`` (``ss -ltnp``)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        for pid in map(int, re.findall(r"pid=(\d+)", line)):
            if pid in pids:
                found.append((fields[3], pid))
    return found


#: the quick-start's roles would all live in the driver (rollout.host auto -> driver), starting no Ray;
#: runs that check what happens to a Ray keep the trainer in its actor
WITH_RAY = "rollout.host=trainer"


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to list listening sockets")
@pytest.mark.parametrize("host", ["trainer", "driver"])
def test_ctrl_c_exits_with_a_message_saves_and_leaves_no_ray_process(relax_run, host):
    r = relax_run(WITH_RAY if host == "trainer" else "rollout.host=driver")
    r.wait_for_steps(3)
    listening = _listeners(set(alive(r.ray)))
    if host == "driver":  # one process, no Ray: nothing listens at all
        assert not r.ray and not _listeners({r.proc.pid}), (r.ray, _listeners({r.proc.pid}))
    else:
        assert len({pid for _, pid in listening}) >= 3, listening  # GCS, raylet, workers... were found
    exposed = [(addr, pid) for addr, pid in listening if not LOOPBACK.match(addr)]
    assert not exposed, f"Ray of this run listens beyond loopback: {exposed}"

    seconds = r.interrupt()
    out = r.output
    assert r.proc.returncode == 130, out
    assert seconds < 60, seconds  # within seconds; generous for a loaded 2-core machine
    assert "relax: SIGINT received: stopping" in out
    step = int(re.search(r"relax: stopped at step (\d+) of 400: interrupted by SIGINT", out).group(1))
    checkpoint = r.run_dir / "checkpoints" / f"step_{step:06d}"
    assert f"relax: resume from {checkpoint} with: relax run" in out and "checkpoint.resume=auto" in out
    assert (
        json.loads((checkpoint / "controller.json").read_text())["step"] == step
    )  # the emergency checkpoint
    assert "Traceback" not in out
    assert not alive(r.ray), f"Ray processes of the run left behind: {sorted(alive(r.ray))}"


def test_second_ctrl_c_skips_the_checkpoint_and_still_cleans_up(relax_run):
    r = relax_run()  # every role in the driver: the shutdown has no Ray to stop
    r.wait_for_steps(2)
    r.interrupt(times=2)
    out = r.output
    assert r.proc.returncode == 130, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    assert "again" in out  # the second signal was acknowledged
    assert not alive(r.ray), f"Ray processes of the run left behind: {sorted(alive(r.ray))}"


def test_an_invalid_config_is_reported_and_the_early_ray_shut_down(relax_run):
    """``relax run`` starts Ray before it loads the config (see ``EarlyStart.before_config``): a config
    that fails to load is reported as for any command, and that Ray goes away with the run."""
    r = relax_run("total_steps=-3", WITH_RAY)
    deadline = time.monotonic() + 120
    while r.proc.poll() is None and time.monotonic() < deadline:
        r.ray.update(ray_processes(r.proc.pid))
        time.sleep(0.1)
    r.proc.wait(timeout=10)
    r._reader.join(timeout=10)
    out = r.output
    assert r.proc.returncode == 2, out
    assert "relax: invalid config:" in out and "total_steps: must be > 0, got -3" in out
    assert "Started a local Ray instance" in out  # the early start did launch one ...
    assert "Traceback" not in out
    assert not alive(r.ray), f"Ray processes left behind: {sorted(alive(r.ray))}"  # ... and shut it down
