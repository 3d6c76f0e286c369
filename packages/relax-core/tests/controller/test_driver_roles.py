"""``rollout.host: driver``: every role of a local colocate run in the driver's process, no Ray.

The calls keep the actor shape (``controller.local``); the run must give what the same run with a
trainer actor gives, and ``relax run`` must start no Ray for it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from relax.core.config import load_config
from relax.core.controller import faults, local
from relax.core.controller.hosting import driver_problems, in_driver, placement_of_engine

pytestmark = pytest.mark.timeout(600)


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def add(self, k: int) -> int:
        self.n += k
        return self.n

    def fail(self) -> None:
        raise ValueError("bad batch")


def test_a_local_handle_is_called_like_an_actor():
    handle = local.LocalHandle(_Counter())
    ref = handle.add.remote(2)
    assert isinstance(ref, local.LocalRef) and local.get(ref) == 2  # ran at .remote(), in order
    assert local.get([handle.add.remote(3), handle.add.remote(1)]) == [5, 6]
    assert local.wait([ref], num_returns=1, timeout=0) == ([ref], [])
    assert ref.future().result() == 2 and local.get(handle.__ray_ready__.remote()) is True
    with pytest.raises(ValueError, match="bad batch") as err:  # the role's own error, named like an actor's
        faults.wait(handle.fail.remote(), 1.0, "trainer", "train_step")
    assert "(raised by trainer in train_step)" in err.value.__notes__
    with pytest.raises(AttributeError):
        handle.missing.remote()
    assert faults.alive(handle, 0.1)


def test_auto_puts_every_role_in_the_driver_only_where_each_can_live_there():
    assert placement_of_engine(load_config(None)) == "driver" and in_driver(load_config(None))
    judged = load_config(None)
    judged = replace(judged, reward=replace(judged.reward, name="judge"))  # any reward but core's rule rewards
    assert placement_of_engine(judged) == "trainer"
    assert driver_problems(judged) == ["reward.name is 'judge', not a built-in rule reward (exact_match, numeric)"]
    trainer_cases = {
        "algorithm.kl.coef=0.01": "needs a reference model",
        "control.enabled=true": "control.enabled is true",
    }
    for override, problem in trainer_cases.items():
        cfg = load_config(None, [override])
        assert placement_of_engine(cfg) == "trainer", override  # still hosted, in its own actor
        with pytest.raises(ValueError, match=r"rollout.host: 'driver' is not possible here: .*" + problem):
            placement_of_engine(load_config(None, [override, "rollout.host=driver"]))
    async_cfg = load_config(None, ["mode=async", "max_staleness=1"])
    assert placement_of_engine(async_cfg) == "separate"
    with pytest.raises(ValueError, match="rollout.host: 'driver' is not possible here: mode is 'async'"):
        placement_of_engine(load_config(None, ["mode=async", "max_staleness=1", "rollout.host=driver"]))
    assert placement_of_engine(load_config(None, ["rollout.host=trainer"])) == "trainer"


SMALL = ["total_steps=2", "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=3",
         "data.task_size=100", "logging.progress=false", "logging.console=false", "logging.tensorboard=false",
         "logging.plot=false", "checkpoint.save_hf_final=false", "checkpoint.save_every=0"]


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_driver_run_matches_the_same_run_with_a_trainer_actor(ray_session, tmp_path):
    from relax.core.controller.run import run

    rows = {}
    for host in ("driver", "trainer"):
        run(load_config(None, [*SMALL, f"rollout.host={host}", f"run_dir={tmp_path / host}"]))
        rows[host] = _rows(tmp_path / host)
    assert [r["step"] for r in rows["driver"]] == [1, 2]
    for mine, theirs in zip(rows["driver"], rows["trainer"], strict=True):
        assert mine["policy_version"] == theirs["policy_version"]
        # same seeds and weights; only the torch thread count differs (all cores in the driver)
        assert mine["reward/mean"] == pytest.approx(theirs["reward/mean"], abs=2 / 16)
        assert mine["train/loss"] == pytest.approx(theirs["train/loss"], abs=1e-3)
        assert mine["response/length_mean"] == pytest.approx(theirs["response/length_mean"], abs=0.5)


def test_relax_run_starts_no_ray_when_every_role_is_in_the_driver(tmp_path):
    """A fresh process: the quick-start trains, checkpoints and saves, and Ray was never imported
    (``relax.core.lazy_ray``), let alone initialised."""
    script = (
        "import sys\n"
        "from relax.core import lazy_ray\n"
        "from relax.core.cli import main\n"
        "code = main(['run', *sys.argv[1:]])\n"
        "print('RAY_IMPORTED', lazy_ray.imported())\n"
        "sys.exit(code)\n"
    )
    env = {**os.environ, "RAY_ADDRESS": ""}
    out = subprocess.run([sys.executable, "-c", script, *SMALL, "checkpoint.save_hf_final=true", f"run_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "RAY_IMPORTED False" in out.stdout
    line = next(x for x in out.stdout.splitlines() if x.startswith("relax: first step"))
    assert "ray" not in line and "| tokenizer, data " in line and "| roles " in line, line
    assert "every role in this process: rollout.host=driver, no Ray" in out.stdout
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2]
    assert (tmp_path / "final_hf" / "config.json").exists() and (tmp_path / "checkpoints" / "step_000002").is_dir()
