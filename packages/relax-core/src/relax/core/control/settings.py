"""The ``control`` config section (typed like every other section; validated by ``control_errors``)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class AutoscalerConfig:
    """Scale rollout out when the trainer starves, in when the queue stays full (off by default)."""

    enabled: bool = False
    min_engines: int = 1
    max_engines: int = 4
    # scale out by one engine when the trainer idled above idle_frac for `steps` consecutive steps
    # while the queue held less than starved_fill of its capacity
    idle_frac: float = 0.3
    starved_fill: float = 0.5
    # scale in by one engine when the queue held at least full_fill of its capacity for `steps` steps
    full_fill: float = 0.9
    steps: int = 3
    cooldown_s: float = 60.0  # no decision this long after a scale operation ends


@dataclass(frozen=True)
class ControlConfig:
    enabled: bool = False
    host: str = "127.0.0.1"  # anywhere but loopback requires a bearer token
    port: int = 8321
    token: str | None = None  # null off loopback: one is generated and printed once
    drain_timeout_s: float = 30.0  # scale-in waits this long for in-flight requests, then forces
    protect_initial_engines: bool = True  # engines present from the start are never scaled in
    publish_s: float = 0.5  # how often the driver publishes run state to the API
    autoscaler: AutoscalerConfig = field(default_factory=AutoscalerConfig)


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def notify_url_error(url: str) -> str | None:
    """Why an Apprise URL is unusable (None: looks usable); checked without importing Apprise."""
    parts = urlsplit(url)
    if not parts.scheme or not (parts.netloc or parts.path):
        return f"{url!r} is not an Apprise URL (expected schema://..., e.g. json://host:port/path)"
    return None


def control_errors(cfg: Any) -> list[str]:
    """Problems in ``control`` and ``logging.notify_urls``, each naming its field."""
    c, a, errors = cfg.control, cfg.control.autoscaler, []
    if not 1 <= c.port <= 65535:
        errors.append(f"control.port: must be in [1, 65535], got {c.port}")
    if not c.host:
        errors.append("control.host: must not be empty")
    if c.token is not None and len(c.token) < 16:
        errors.append("control.token: must be at least 16 characters (or null to generate one)")
    for path, value in [
        ("control.drain_timeout_s", c.drain_timeout_s),
        ("control.autoscaler.cooldown_s", a.cooldown_s),
    ]:
        if value < 0:
            errors.append(f"{path}: must be >= 0, got {value!r}")
    if c.publish_s <= 0:
        errors.append(f"control.publish_s: must be > 0, got {c.publish_s!r}")
    if a.min_engines < 1:
        errors.append(f"control.autoscaler.min_engines: must be >= 1, got {a.min_engines}")
    if a.max_engines < a.min_engines:
        errors.append(
            f"control.autoscaler.max_engines: {a.max_engines} is below min_engines ({a.min_engines})"
        )
    if a.steps < 1:
        errors.append(f"control.autoscaler.steps: must be >= 1, got {a.steps}")
    for name in ("idle_frac", "starved_fill", "full_fill"):
        if not 0 <= getattr(a, name) <= 1:
            errors.append(f"control.autoscaler.{name}: must be in [0, 1], got {getattr(a, name)!r}")
    if a.enabled and not c.enabled:
        errors.append("control.autoscaler.enabled: needs control.enabled: true")
    if a.enabled and cfg.mode == "colocate":
        errors.append(
            "control.autoscaler.enabled: needs mode 'async' or 'hybrid' (it reads the transfer queue)"
        )
    for i, url in enumerate(cfg.logging.notify_urls):
        if (why := notify_url_error(url)) is not None:
            errors.append(f"logging.notify_urls[{i}]: {why}")
    return errors
