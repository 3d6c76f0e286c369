"""Prometheus text exposition (format 0.0.4) of the run's latest metrics, for an existing
Prometheus / Grafana: every numeric metric becomes a gauge ``relax_<name>`` labelled with the run."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_BAD = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(key: str) -> str:
    """``queue/depth/sample`` -> ``relax_queue_depth_sample`` (Prometheus names are [a-zA-Z0-9_:])."""
    return "relax_" + _BAD.sub("_", key).strip("_")


def _label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _number(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def exposition(metrics: Mapping[str, object], run: str) -> str:
    """Gauges for every int/float/bool value in ``metrics`` (others are skipped), sorted by name;
    two keys that map to one name keep the first."""
    lines: list[str] = []
    seen: set[str] = set()
    for key in sorted(metrics):
        value = metrics[key]
        if not isinstance(value, int | float) or (name := metric_name(key)) in seen:
            continue
        seen.add(name)
        lines += [
            f"# HELP {name} Relax metric {key}",
            f"# TYPE {name} gauge",
            f'{name}{{run="{_label(run)}"}} {_number(float(value))}',
        ]
    return "\n".join(lines) + "\n"


def run_gauges(status: Mapping[str, object]) -> dict[str, float]:
    """Gauges derived from a status snapshot (engine count, draining engines, in-flight requests,
    paused), added to the step metrics so a dashboard sees them between steps too."""
    engines = status.get("engines") or []
    out = {
        "control/engines": float(len(engines)),
        "control/engines_healthy": float(sum(bool(e.get("healthy")) for e in engines)),
        "control/engines_draining": float(sum(bool(e.get("draining")) for e in engines)),
        "control/requests_in_flight": float(sum(e.get("load", 0) for e in engines)),
        "control/paused": float(status.get("state") == "paused"),
    }
    for key in ("step", "weight_version"):
        if isinstance(status.get(key), int | float):
            out[f"control/{key}"] = float(status[key])
    return out
