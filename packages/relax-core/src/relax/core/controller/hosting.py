"""``rollout.host``: where the run's roles live, decided from the config alone (pure predicates).

``driver``: the trainer, its hosted engine and the reward run in the driver's process (no Ray);
``trainer``: one actor (``controller.roles.HostRole``) is both the trainer and the run's only
rollout engine; ``separate``: every role in its own actor. ``auto`` takes the first the config
allows. Nothing here starts a role: ``controller.runtime`` starts them where these predicates say,
``relax validate`` and ``relax run`` refuse an impossible ``rollout.host`` with the same message
(:func:`placement_errors`), and the step reads only :func:`hosts_engine` where it matters.
"""

from __future__ import annotations

from typing import Any

from relax.core.algorithms import config_needs
from relax.core.controller.contexts import plugin_params
from relax.core.plugins import get_plugin_manager


def host_problems(cfg: Any) -> list[str]:
    """Why this config cannot host its engine in the trainer (empty: it can)."""
    r = cfg.rollout
    problems = []
    if cfg.mode != "colocate":
        problems.append(f"mode is {cfg.mode!r}, not 'colocate' (rollout and training must take turns)")
    if r.engine != "hf":
        problems.append(f"rollout.engine is {r.engine!r}, not the built-in 'hf'")
    if r.num_engines != 1:
        problems.append(f"rollout.num_engines is {r.num_engines}, not 1")
    if cfg.trainer.backend != "torch":
        problems.append(f"trainer.backend is {cfg.trainer.backend!r}, not the built-in 'torch'")
    if problems:
        return problems
    engine, trainer = plugin_params(cfg, "rollout_engine"), plugin_params(cfg, "trainer")
    if trainer.world_size != 1:
        problems.append(f"trainer.backend_params.world_size is {trainer.world_size}, not 1")
    if engine.device != trainer.device:
        problems.append(
            f"rollout.engine_params.device {engine.device!r} != trainer.backend_params.device "
            f"{trainer.device!r}"
        )
    if trainer.dtype not in (None, cfg.model.dtype):
        problems.append(f"trainer.backend_params.dtype {trainer.dtype!r} != model.dtype {cfg.model.dtype!r}")
    return problems


def driver_rewards(manager: Any = None) -> list[str]:
    """The registered rewards declared able to run in the driver (``register(..., in_driver=True)``):
    core's rule rewards and any plugin's, alike."""
    manager = manager or get_plugin_manager()
    return [n for n in manager.names("reward") if manager.registration("reward", n).in_driver]


def reward_in_driver(cfg: Any) -> bool:
    """Whether the configured reward declared it can be scored in the driver's process (an
    unregistered name cannot: the config loader reports it)."""
    return cfg.reward.name in driver_rewards()


def driver_problems(cfg: Any) -> list[str]:
    """Why this config cannot run its roles in the driver (``rollout.host: driver``), beyond
    :func:`host_problems`: every role must be one the driver can hold, and nothing may need Ray."""
    problems = []
    if not reward_in_driver(cfg):
        problems.append(
            f"reward.name is {cfg.reward.name!r}, not a reward declared in_driver=True "
            f"({', '.join(driver_rewards()) or 'none registered'})"
        )
    if roles := sorted({"reference", "teacher"} & set(config_needs(cfg.algorithm))):
        problems.append(f"the algorithm needs a {' and a '.join(roles)} model (its own actor)")
    if cfg.ray.address:
        problems.append(f"ray.address is {cfg.ray.address!r} (a cluster run)")
    if cfg.ray.nodes:
        problems.append(f"ray.nodes pins roles to cluster nodes ({', '.join(sorted(cfg.ray.nodes))})")
    if cfg.control.enabled:
        problems.append("control.enabled is true (the control plane is a Ray Serve app)")
    return problems


def placement_errors(cfg: Any) -> list[str]:
    """Why ``rollout.host`` cannot be honoured (empty: it can). The one check behind both
    ``relax validate`` and ``relax run`` (and :func:`placement_of_engine`, which raises it); also
    what ``ray.nodes`` asks that no cluster could honour (``relax.core.cluster.pin_errors``)."""
    from relax.core.cluster import pin_errors

    if pinned := pin_errors(cfg):
        return pinned
    host = cfg.rollout.host
    if host == "separate":
        return []
    problems = host_problems(cfg)
    if host in ("trainer", "driver") and problems:
        return [
            f"rollout.host: {host!r} is not possible here: "
            + "; ".join(problems)
            + " (use 'auto' or 'separate')"
        ]
    if host == "driver" and (in_driver := driver_problems(cfg)):
        return [
            "rollout.host: 'driver' is not possible here: "
            + "; ".join(in_driver)
            + " (use 'auto' or 'trainer')"
        ]
    if cfg.trainer.offload and not (host == "auto" and problems):
        where = host if host != "auto" else "trainer" if driver_problems(cfg) else "driver"
        return [
            f"trainer.offload: the engine runs on the trainer's own model (rollout.host {host!r}: in the {where}), "
            "so offloading the trainer would take the engine's weights along; set rollout.host: separate"
        ]
    return []


def placement_of_engine(cfg: Any) -> str:
    """``rollout.host`` resolved to ``driver`` | ``trainer`` | ``separate``: ``auto`` takes the first
    this config allows; ``driver`` or ``trainer`` where it is not allowed is an error naming why."""
    if errors := placement_errors(cfg):
        raise ValueError(errors[0])
    host = cfg.rollout.host
    if host == "separate" or (host == "auto" and host_problems(cfg)):
        return "separate"
    if host == "trainer":
        return host
    return "driver" if host == "driver" or not driver_problems(cfg) else "trainer"


def hosts_engine(cfg: Any) -> bool:
    """Whether the engine runs inside the trainer (in its actor, or with it in the driver)."""
    return placement_of_engine(cfg) != "separate"


def in_driver(cfg: Any) -> bool:
    """Whether every role runs in the driver's process, so the run needs no Ray."""
    return placement_of_engine(cfg) == "driver"


def host_threads(cores: int, driver: bool = False) -> int:
    """Torch threads of the hosted trainer. In its own actor: every core but one, which stays with
    the driver (reward, collation, logging) and Ray's daemons; on 2 cores that is 1 thread, and the
    quick-start's steps measured 0.20-0.23 s against 0.29-0.31 s with 2 threads contending with the
    driver. In the driver, whose own work runs between the trainer's calls: every core."""
    return cores if driver else max(1, cores - 1)
