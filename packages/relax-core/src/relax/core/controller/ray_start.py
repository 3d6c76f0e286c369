"""Starting Ray with nothing heavier than ``ray`` and ``yaml`` imported.

``relax run`` starts Ray before it loads the config, because loading the config imports torch and
every plugin (seconds on a small machine) and Ray's daemons take seconds to come up: the two
overlap. Only the ``ray:`` section is needed to start, and :func:`peek_settings` reads it from
the YAML and the overrides (:func:`peek_config`) without validating anything; the validated config
later says what Ray it needs (:func:`relax.core.controller.runtime.ray_settings`), and a start that
guessed wrong is restarted (:class:`relax.core.controller.startup.EarlyStart`). A colocate config
that may put every role in the driver (:func:`may_run_in_driver`) gets no early Ray: it may need none.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("relax")

RAY_ENV = {
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",  # uv-run drivers would otherwise rebuild a venv per worker
    "RAY_USAGE_STATS_ENABLED": "0",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
#: what the workers of a joined cluster must see as the driver does
FORWARDED_ENV = (
    *RAY_ENV,
    "RAY_AUTH_MODE",
    "WANDB_MODE",
    "RELAX_CACHE_DIR",
    "OMP_NUM_THREADS",
    "RELAX_PLUGINS",
    "RELAX_DISABLE_PLUGINS",
    "PYTHONPATH",
)
LOOPBACK = "127.0.0.1"
#: Ray replaces a loopback node address by the machine's network address unless it thinks it runs
#: on a single machine; this is its switch for that (named for the platforms where it is the default)
_SINGLE_MACHINE_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@dataclass(frozen=True)
class RaySettings:
    """What starting Ray depends on: a cluster ``address`` to join, or an embedded Ray's CPUs."""

    address: str | None = None
    node_ip_address: str | None = None
    num_cpus: int | None = None  # embedded only


def default_num_cpus() -> int:
    """An embedded Ray's CPUs when the config reserves no more: the machine's cores (at least 2)."""
    return max(2, os.cpu_count() or 2)


def peek_config(path: str | None, overrides: list[str]) -> dict[str, Any] | None:
    """A config file (the bundled quick-start when ``path`` is None) with its ``a.b=value``
    overrides applied, as plain YAML data without validation or defaults; None when it cannot be
    read (the config loader then reports why, and Ray starts after it)."""
    import yaml

    try:
        if path is None:
            from importlib import resources

            data = yaml.safe_load(resources.files("relax.core").joinpath("quickstart.yaml").read_text())
        else:
            data = yaml.safe_load(Path(path).read_text())
        data = dict(data or {})
        for item in overrides:
            key, _, value = item.partition("=")
            *parents, leaf = key.split(".")
            node = data
            for name in parents:
                node = node.setdefault(name, {})
                if not isinstance(node, dict):
                    return None
            node[leaf] = yaml.safe_load(value)
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError):
        return None
    return data


def peek_settings(data: dict[str, Any] | None) -> RaySettings | None:
    """The Ray that :func:`peek_config`'s ``ray:`` section asks for; None when it cannot be read."""
    if data is None:
        return None
    try:
        section = dict(data.get("ray") or {})
    except (TypeError, ValueError):
        return None
    address, node_ip, num_cpus = (
        section.get("address"),
        section.get("node_ip_address"),
        section.get("num_cpus"),
    )
    if not all(v is None or isinstance(v, str) for v in (address, node_ip)):
        return None
    if num_cpus is not None and (not isinstance(num_cpus, int) or num_cpus < 1):
        return None
    if address:
        return RaySettings(address, node_ip)
    return RaySettings(None, node_ip, num_cpus or default_num_cpus())


def may_run_in_driver(data: dict[str, Any]) -> bool:
    """Whether :func:`peek_config`'s data might put every role in the driver (``rollout.host``
    auto or driver, colocate mode, no cluster address): such a run may need no Ray at all, so none is
    started before the config is loaded (the loaded config decides: ``controller.hosting.in_driver``)."""

    def get(section: str, key: str, default: Any) -> Any:
        node = data.get(section) if section else data
        return node.get(key, default) if isinstance(node, dict) else default

    return (
        get("rollout", "host", "auto") in ("auto", "driver")
        and get("", "mode", "colocate") == "colocate"
        and not get("ray", "address", None)
    )


def start_ray(settings: RaySettings, log_to_driver: bool = True) -> bool:
    """Start an embedded local Ray (or join ``settings.address``). Returns True if we started it.

    Embedded: every Ray listener (GCS, raylet, object manager, agents, workers) binds to
    127.0.0.1 and the dashboard is off. Cluster: the driver binds ``node_ip_address`` (Ray's
    choice when null) and Ray's token authentication stays as the cluster runs it (never disabled
    here). Neither path sets ``RAY_AUTH_MODE``: Ray's default (token) applies unless the
    environment says otherwise.
    """
    import ray

    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": log_to_driver}
    if settings.address:
        # a cluster's daemons do not inherit our environment: the job's runtime env carries it
        kwargs["runtime_env"] = {"env_vars": {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}}
        kwargs["address"] = settings.address
        if settings.node_ip_address:
            kwargs["_node_ip_address"] = settings.node_ip_address
        if os.environ.get("RAY_AUTH_MODE") == "disabled":
            log.warning(
                "relax: RAY_AUTH_MODE=disabled while joining a cluster: anyone who reaches its ports can run code"
            )
        try:
            if _is_loopback(
                settings.address
            ):  # a cluster on this machine's loopback (`ray start` on 127.0.0.x):
                # the driver is on the head's machine and joins as that node (Ray would look for 127.0.0.1)
                if _host(settings.address) != "localhost" and not settings.address.startswith("ray://"):
                    kwargs.setdefault("_node_ip_address", _host(settings.address))
                with (
                    _single_machine()
                ):  # Ray would otherwise swap 127.0.0.1 for the machine's network address
                    ray.init(**kwargs)
            else:
                ray.init(**kwargs)
        except (ConnectionError, RuntimeError) as exc:
            raise ClusterJoinError(join_failure(settings.address, exc)) from exc
        return True
    # embedded: the daemons, and the workers they start, inherit this process's environment; a job
    # runtime env would only make each worker wait for Ray's runtime-env agent (~1 s per actor here)
    kwargs["num_cpus"] = settings.num_cpus or default_num_cpus()
    kwargs["_node_ip_address"] = settings.node_ip_address or LOOPBACK
    with _single_machine():
        ray.init(**kwargs)
    return True


class ClusterJoinError(ConnectionError):
    """``relax run --address`` could not join the cluster; the message names the likely cause and its fix."""


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen and len(seen) < 16:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def join_failure(address: str, exc: BaseException) -> str:
    """Why joining the Ray cluster at ``address`` failed, in one message that says what to do. Ray's
    own error is a bare "Failed to connect to Ray cluster"; the cause is deeper in the chain. The usual
    one: token authentication on one side only -- ``ray start --head`` turns it on by itself when
    ``~/.ray/auth_token`` exists (``RAY_AUTH_MODE`` unset), while ``ray start --address`` and a driver's
    ``ray.init(address=...)`` do not."""
    import ray

    chain = _chain(exc)
    text = " ".join(str(e) for e in chain)
    mode = os.environ.get("RAY_AUTH_MODE")
    auth = any(type(e).__name__ == "AuthenticationError" for e in chain) or "InvalidAuthToken" in text
    if auth or "Unauthenticated" in text:
        token = Path.home() / ".ray" / "auth_token"
        have = (
            ("RAY_AUTH_TOKEN" in os.environ and "$RAY_AUTH_TOKEN")
            or ("RAY_AUTH_TOKEN_PATH" in os.environ and "$RAY_AUTH_TOKEN_PATH")
            or (token.is_file() and str(token))
        )
        if mode != "token":
            fix = (
                f"the cluster runs Ray's token authentication and this driver does not (RAY_AUTH_MODE="
                f"{mode or 'unset'}): run `export RAY_AUTH_MODE=token` and relax again"
                + (
                    f" (Ray then reads the token from {have})"
                    if have
                    else " with the cluster's token in ~/.ray/auth_token or $RAY_AUTH_TOKEN"
                )
            )
        else:
            fix = (
                f"the cluster rejected this driver's token (RAY_AUTH_MODE=token, token from {have or 'nowhere'}): "
                "give it the cluster's token (the head's ~/.ray/auth_token, or $RAY_AUTH_TOKEN)"
            )
        why = f"authentication: {fix}"
    else:
        why = (
            f"is a Ray head running there (`ray status --address {address}`), reachable from here, and on the "
            f"same Ray version as this driver ({ray.__version__})? If the head runs token authentication (it turns "
            "it on when ~/.ray/auth_token exists), set RAY_AUTH_MODE=token here too"
        )
    lines = [line.strip() for e in chain for line in str(e).splitlines() if line.strip()]
    said = next(
        (line for line in reversed(lines) if "Error" in line), lines[-1] if lines else type(exc).__name__
    )
    return f"could not join the Ray cluster at {address}: {why} (Ray said: {said[:240]})"


def start_loopback_ray(num_cpus: int, log_to_driver: bool = False) -> bool:
    """An embedded Ray bound to 127.0.0.1 only, started as ``relax run`` starts it: for benches and
    tools that start Ray themselves. Returns True if it was started here (False: one was running)."""
    return start_ray(RaySettings(num_cpus=num_cpus), log_to_driver=log_to_driver)


def _host(address: str) -> str:
    return address.removeprefix("ray://").rsplit(":", 1)[0].strip("[]")


def _is_loopback(address: str) -> bool:
    import ipaddress

    host = _host(address)
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@contextmanager
def _single_machine() -> Iterator[None]:
    """Keep Ray on 127.0.0.1 while it starts: its daemons read the switch from the environment
    they inherit; this (already imported) driver reads the constant Ray computed from it at import."""
    from ray._private import ray_constants

    saved_env = {k: os.environ.get(k) for k in _SINGLE_MACHINE_ENV}
    saved_flag = ray_constants.ENABLE_RAY_CLUSTER
    os.environ.update(_SINGLE_MACHINE_ENV)
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
