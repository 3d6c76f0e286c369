"""Importing this first points a bench at the simulated cluster (``plugins/sim_plugin.py``).

It must run before ``ray`` or ``relax`` are imported: Ray workers inherit ``PYTHONPATH`` and
``RELAX_PLUGINS`` from the driver's environment, so the sim plugin loads in every process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

PLUGINS = Path(__file__).resolve().parent / "plugins"

os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(PLUGINS), os.environ.get("PYTHONPATH", "")] if p)
os.environ["RELAX_PLUGINS"] = "sim_plugin"
for key, value in {
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "HF_HUB_OFFLINE": "1",
}.items():
    os.environ.setdefault(key, value)
sys.path.insert(0, str(PLUGINS))
