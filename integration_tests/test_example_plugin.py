"""An out-of-tree plugin package, really installed: ``examples/plugins/relax-hello`` is built and
installed with ``uv pip install --target`` into a temporary site directory that only the ``relax``
subprocesses of this module see (so the rest of the suite keeps a plugin-free registry). It adds a
reward with a typed config section, an engine, a weight-sync transport, a run hook and a
subcommand; ``relax run`` uses them, its own conformance tests pass, and docs/plugins.md quotes its
files verbatim."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "examples" / "plugins" / "relax-hello"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    uv = shutil.which("uv")
    if uv is None:  # scripts/install.sh installs uv; without it this module cannot install a package
        pytest.fail("uv is not on PATH (run the suite through scripts/test.sh)")
    target = tmp_path_factory.mktemp("hello-site")
    subprocess.run(
        [uv, "pip", "install", "--quiet", "--no-deps", "--target", str(target), str(PACKAGE)],
        check=True,
        timeout=300,
        env={**os.environ, "VIRTUAL_ENV": sys.prefix},
    )
    return target


def relax(site: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(
        [sys.executable, "-m", "relax.core.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def test_plugins_lists_what_the_package_registered(site):
    proc = relax(site, "plugins")
    assert proc.returncode == 0, proc.stderr
    block = proc.stdout.split("hello (relax-hello 0.1.0)\n", 1)[1].split("\n\n")[0]
    for line in [
        "command: last-reward",
        "reward: length",
        "rollout_engine: counting",
        "trainer: sgd",
        "weight_sync: checksummed",
    ]:
        assert line in block


def test_plugin_config_section_is_typed_and_validated(site):
    proc = relax(
        site,
        "validate",
        "reward.name=length",
        "reward.params.target=four",
        "rollout.engine=counting",
        "rollout.engine_params.batch=3",
    )
    assert proc.returncode == 2
    assert "reward.params.target: expected int, got str 'four'" in proc.stderr
    assert "rollout.engine_params.batch: unknown key; allowed keys: max_batch_size, num_cpus" in proc.stderr
    assert "config OK" not in proc.stdout
    proc = relax(site, "validate", "--print", "reward.name=length", "reward.params.target=2e1")
    assert proc.returncode == 2 and "reward.params.target: expected int, got str '2e1'" in proc.stderr
    proc = relax(site, "validate", "--print", "reward.name=length", "rollout.engine=counting")
    assert proc.returncode == 0, proc.stderr
    resolved = json.loads(proc.stdout.split("\n", 1)[1])
    assert resolved["reward"]["params"] == {"target": 4}  # the plugin's defaults, shown
    assert resolved["rollout"]["engine_params"] == {"max_batch_size": 64, "num_cpus": 1.0}


def test_relax_run_uses_the_plugins_engine_reward_hook_and_command(site, tmp_path):
    run_dir = tmp_path / "run"
    proc = relax(
        site,
        "run",
        "total_steps=2",
        f"run_dir={run_dir}",
        "rollout.engine=counting",
        "reward.name=length",
        "reward.params.target=2",
        "weight_sync.transport=checksummed",
        "weight_sync.params.algorithm=adler32",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "trainer.micro_batch_size=16",
        "trainer.num_minibatches=1",
        "data.task_size=100",
        "logging.progress=false",
        "logging.plot=false",
        "logging.tensorboard=false",
        "checkpoint.save_hf_final=false",
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "hello_summary.json").read_text())  # written by the run-end hook
    assert summary["status"] == "completed" and summary["step"] == 2
    assert summary["engines"][0]["weight_version"] == 2  # synced through the checksummed transport
    assert summary["engines"][0]["tokens_generated"] > 0  # the counting engine generated the rollouts
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["reward/mean"] <= 0 for r in rows)  # length reward: -|len - 2| / 2
    proc = relax(site, "last-reward", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    assert re.fullmatch(r"step 2: reward/mean -?\d\.\d{3}\n", proc.stdout)


def test_the_packages_own_conformance_tests_pass(site):
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(PACKAGE),
            str(PACKAGE / "tests"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=PACKAGE,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert re.search(r"\d+ passed", proc.stdout) and "failed" not in proc.stdout


def test_docs_plugins_quotes_the_package_verbatim():
    """Every ``# file: <path>`` block in docs/plugins.md is the package's file, byte for byte."""
    text = (REPO / "docs" / "plugins.md").read_text()
    blocks = re.findall(r"```(?:python|toml)\n# file: (\S+)\n(.*?)```", text, flags=re.S)
    assert {path for path, _ in blocks} >= {
        "pyproject.toml",
        "src/relax_hello/reward.py",
        "src/relax_hello/engine.py",
        "src/relax_hello/transport.py",
        "src/relax_hello/command.py",
        "src/relax_hello/hooks.py",
        "src/relax_hello/trainer.py",
        "tests/test_conformance.py",
    }
    for path, body in blocks:
        assert (PACKAGE / path).read_text() == body, f"docs/plugins.md is out of date for {path}"
