"""``rollout.host: driver``: every role of a local colocate run in the driver's process, no Ray.

The calls keep the actor shape (``controller.local``); the run must give what the same run with a
trainer actor gives, and ``relax run`` must start no Ray for it."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest

from relax.core import plugins
from relax.core.config import load_config
from relax.core.controller import faults, local
from relax.core.controller.hosting import (
    driver_problems,
    driver_rewards,
    in_driver,
    placement_of_engine,
    reward_in_driver,
)
from relax.core.data import Sample

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
    judged = replace(
        judged, reward=replace(judged.reward, name="judge")
    )  # any reward but core's rule rewards
    assert placement_of_engine(judged) == "trainer"
    declared = driver_rewards()  # core's rule rewards and every installed plugin's that declared it
    assert {"environment", "exact_match", "numeric"} <= set(declared) and "judge" not in declared
    assert driver_problems(judged) == [
        f"reward.name is 'judge', not a reward declared in_driver=True ({', '.join(declared)})"
    ]
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


SMALL = [
    "total_steps=2",
    "rollout.prompts_per_step=4",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=3",
    "data.task_size=100",
    "logging.progress=false",
    "logging.console=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "checkpoint.save_hf_final=false",
    "checkpoint.save_every=0",
]


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


RUN_SCRIPT = (
    "import sys\n"
    "from relax.core import lazy_ray\n"
    "from relax.core.cli import main\n"
    "code = main(['run', *sys.argv[1:]])\n"
    "print('RAY_IMPORTED', lazy_ray.imported())\n"
    "sys.exit(code)\n"
)


def test_relax_run_starts_no_ray_when_every_role_is_in_the_driver(tmp_path):
    """A fresh process: the quick-start trains, checkpoints and saves, and Ray was never imported
    (``relax.core.lazy_ray``), let alone initialised."""
    env = {**os.environ, "RAY_ADDRESS": ""}
    out = subprocess.run(
        [sys.executable, "-c", RUN_SCRIPT, *SMALL, "checkpoint.save_hf_final=true", f"run_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "RAY_IMPORTED False" in out.stdout
    line = next(x for x in out.stdout.splitlines() if x.startswith("relax: first step"))
    assert "ray" not in line and "| tokenizer, data " in line and "| roles " in line, line
    assert "every role in this process: rollout.host=driver, no Ray" in out.stdout
    assert [r["step"] for r in _rows(tmp_path)] == [1, 2]
    assert (tmp_path / "final_hf" / "config.json").exists() and (
        tmp_path / "checkpoints" / "step_000002"
    ).is_dir()


#: a third party's rule reward, registered twice: declared able to run in the driver, and not
RULE_PLUGIN = """
from dataclasses import dataclass


@dataclass(frozen=True)
class ContainsParams:
    bonus: float = 1.0


class Contains:
    def __init__(self, bonus):
        self.bonus = bonus

    async def score(self, sample):
        return self.bonus * float(str(sample.label) in (sample.response_text or ""))


def relax_register_rewards(register):
    factory = lambda params, ctx: Contains(params.bonus)
    register("contains_in_driver", factory, config=ContainsParams, in_driver=True)
    register("contains", factory, config=ContainsParams)
"""


@pytest.fixture
def rule_plugin(tmp_path, monkeypatch):
    """The plugin in the process-wide registry (as an installed one would be); its directory."""
    (tmp_path / "rule_reward_plugin.py").write_text(textwrap.dedent(RULE_PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("rule_reward_plugin")
    monkeypatch.delitem(sys.modules, "rule_reward_plugin")
    monkeypatch.setattr(plugins, "_MANAGER", plugins.RelaxPluginManager(extra_plugins={"rule": module}))
    return tmp_path


def test_a_plugin_reward_is_placed_by_its_declaration_like_a_builtin(rule_plugin):
    from relax.core.controller.contexts import reward_context
    from relax.core.controller.driver_reward import start_reward

    declared = load_config(None, ["reward.name=contains_in_driver"])
    assert reward_in_driver(declared) and placement_of_engine(declared) == "driver" and in_driver(declared)
    reward = start_reward(declared, reward_context(declared, None))
    assert isinstance(reward, local.LocalHandle)  # scored in this process: no reward actor
    answer = Sample(prompt_ids=[1], group_id=0, response_ids=[2], response_text="it is 12", label="12")
    scored, counts = local.get(reward.score.remote([answer]))
    assert scored[0].reward == 1.0 and counts["failures"] == 0.0

    undeclared = load_config(None, ["reward.name=contains"])  # today's layout: the reward in its own actor
    assert not reward_in_driver(undeclared) and placement_of_engine(undeclared) == "trainer"
    assert not in_driver(undeclared)
    assert "contains_in_driver" in driver_rewards() and "contains" not in driver_rewards()
    assert driver_problems(undeclared) == [
        f"reward.name is 'contains', not a reward declared in_driver=True ({', '.join(driver_rewards())})"
    ]
    with pytest.raises(
        ValueError, match="rollout.host: 'driver' is not possible here: reward.name is 'contains'"
    ):
        placement_of_engine(load_config(None, ["reward.name=contains", "rollout.host=driver"]))


def test_the_quickstart_with_a_driver_capable_plugin_reward_starts_no_ray(rule_plugin, tmp_path):
    """The plugin loaded the way a user loads one (``RELAX_PLUGINS``), in a fresh process: the
    quick-start keeps every role in the driver and never imports Ray, as with core's own rewards."""
    env = {
        **os.environ,
        "RAY_ADDRESS": "",
        "RELAX_PLUGINS": "rule_reward_plugin",
        "PYTHONPATH": os.pathsep.join([str(rule_plugin), os.environ.get("PYTHONPATH", "")]),
    }
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-c", RUN_SCRIPT, *SMALL, "reward.name=contains_in_driver", f"run_dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "every role in this process: rollout.host=driver, no Ray" in out.stdout
    assert "RAY_IMPORTED False" in out.stdout
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and all(0.0 <= r["reward/mean"] <= 1.0 for r in rows)
