"""``relax.core.lazy_ray``: a driver-only run's imports leave Ray unimported; first use imports it."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import inspect, sys
from relax.core import lazy_ray
lazy_ray.defer_import()
import torch  # registers operators through inspect.getmodule, which reads every module's __file__
import relax.core.controller.run, relax.core.controller.roles, relax.core.queue  # every module on the driver's path
inspect.getmodule(inspect)  # a sys.modules scan
assert not lazy_ray.imported(), "imported early"
role = relax.core.controller.roles.RewardRole
assert role.__ray_actor_class__.__name__ == "RewardRole" and not lazy_ray.imported()
import ray
assert ray.is_initialized() is False and lazy_ray.imported()  # the first attribute imported Ray
from ray.exceptions import RayTaskError
assert relax.core.controller.faults.ray.exceptions.RayTaskError is RayTaskError  # a bound stand-in forwards
assert type(role._remote()).__name__ == "ActorClass(RewardRole)"
print("OK")
"""


def test_ray_is_imported_only_when_first_used():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stdout[-2000:] + out.stderr[-3000:]
