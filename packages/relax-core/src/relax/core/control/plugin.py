"""Core's control-plane hooks (registered with ``relax.core.builtin``): notifications at run start,
recovery, scaling and end (``logging.notify_urls``), the REST control plane when ``control.enabled``,
and the client subcommands. Imports Serve/Apprise only when configured."""

from __future__ import annotations

import logging
from typing import Any

from relax.core.hookspecs import hookimpl

log = logging.getLogger("relax")

#: the run this process drives now (hooks without a ``run`` parameter need it)
_SESSION: dict[str, Any] = {}
#: run_dir -> how the previous attempt in this process ended (a trainer restart starts a new attempt)
_ENDED: dict[str, str] = {}


def _notify(event: str, body: str) -> None:
    if (notifier := _SESSION.get("notifier")) is not None:
        notifier.send_later(event, body)


@hookimpl
def relax_on_run_start(run: Any) -> None:
    cfg = run.config
    _SESSION.clear()
    _SESSION.update(run=run, restarts=0.0)
    if cfg.logging.notify_urls:
        from relax.core.control.notify import Notifier

        _SESSION["notifier"] = Notifier(cfg.logging.notify_urls, cfg.name)
    if _ENDED.pop(str(run.run_dir), None) == "failed":
        _notify("recovered", f"restarted from step {run.step} after a trainer failure")
    else:
        _notify("started", f"{cfg.mode} run of {cfg.total_steps} steps in {run.run_dir}")
    if cfg.control.enabled:
        from relax.core.control.server import ControlPlane

        _SESSION["plane"] = ControlPlane(run, notify=_notify)


@hookimpl
def relax_on_step_end(step: int, metrics: dict[str, float]) -> None:
    restarts = metrics.get("fault/engine_restarts", 0.0)
    if "run" in _SESSION and restarts > _SESSION["restarts"]:
        _SESSION["restarts"] = restarts
        _notify("recovered", f"step {step}: a lost rollout engine was replaced ({restarts:.0f} so far)")


@hookimpl
def relax_on_run_end(run: Any, status: str) -> None:
    _ENDED[str(run.run_dir)] = status
    try:
        if (plane := _SESSION.get("plane")) is not None:
            plane.stop(status)
    finally:
        last = run.metrics
        _notify(
            status,
            f"at step {run.step} of {run.config.total_steps}; reward mean {last.get('reward/mean', float('nan')):.3f}",
        )
        if (notifier := _SESSION.get("notifier")) is not None:
            notifier.flush()
        _SESSION.clear()


@hookimpl
def relax_register_commands(register: Any) -> None:
    from relax.core.control.cli import register_commands

    register_commands(register)
