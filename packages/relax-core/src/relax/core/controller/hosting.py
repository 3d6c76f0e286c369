"""``rollout.host``: whether the rollout engine runs inside the trainer's actor.

Hosted, one actor (:data:`HostRole`) is both the trainer and the run's only rollout engine: it
answers the trainer's calls and the engine's (``generate``, ``pause``, ``health``, ...), so the
router, the fleet and the weight sync reach it through the ordinary engine handle. The engine is
:class:`relax.core.engines.hosted.HostedHFEngine` over the trainer's module; the weight sync is
:class:`relax.core.weight_sync.hosted.HostedSync` (publish the version, move nothing).
"""

from __future__ import annotations

from typing import Any

from relax.core import lazy_ray
from relax.core.controller.capabilities import capabilities
from relax.core.controller.roles import RolloutRole, TrainerRole


def host_problems(cfg: Any) -> list[str]:
    """Why this config cannot host its engine in the trainer (empty: it can)."""
    from relax.core.controller.contexts import plugin_params

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
        problems.append(f"rollout.engine_params.device {engine.device!r} != trainer.backend_params.device "
                        f"{trainer.device!r}")
    if trainer.dtype not in (None, cfg.model.dtype):
        problems.append(f"trainer.backend_params.dtype {trainer.dtype!r} != model.dtype {cfg.model.dtype!r}")
    return problems


def driver_problems(cfg: Any) -> list[str]:
    """Why this config cannot run its roles in the driver (``rollout.host: driver``), beyond
    :func:`host_problems`: every role must be one the driver can hold, and nothing may need Ray."""
    from relax.core.algorithms import config_needs
    from relax.core.controller.driver_reward import DRIVER_REWARDS

    problems = []
    if cfg.reward.name not in DRIVER_REWARDS:
        problems.append(f"reward.name is {cfg.reward.name!r}, not a built-in rule reward ({', '.join(sorted(DRIVER_REWARDS))})")
    if roles := sorted({"reference", "teacher"} & set(config_needs(cfg.algorithm))):
        problems.append(f"the algorithm needs a {' and a '.join(roles)} model (its own actor)")
    if cfg.ray.address:
        problems.append(f"ray.address is {cfg.ray.address!r} (a cluster run)")
    if cfg.control.enabled:
        problems.append("control.enabled is true (the control plane is a Ray Serve app)")
    return problems


def placement_of_engine(cfg: Any) -> str:
    """``rollout.host`` resolved to ``driver`` | ``trainer`` | ``separate``: ``auto`` takes the first
    this config allows; ``driver`` or ``trainer`` where it is not allowed is an error naming why."""
    host = cfg.rollout.host
    if host == "separate":
        return host
    problems = host_problems(cfg)
    if host in ("trainer", "driver") and problems:
        raise ValueError(f"rollout.host: {host!r} is not possible here: " + "; ".join(problems)
                         + " (use 'auto' or 'separate')")
    if problems:
        return "separate"
    if host == "trainer":
        return host
    in_driver = driver_problems(cfg)
    if host == "driver" and in_driver:
        raise ValueError("rollout.host: 'driver' is not possible here: " + "; ".join(in_driver)
                         + " (use 'auto' or 'trainer')")
    return "trainer" if in_driver else "driver"


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


_Trainer = TrainerRole.__ray_actor_class__
_Rollout = RolloutRole.__ray_actor_class__


class _Host(_Trainer):
    """A ``TrainerRole`` that is also the run's rollout engine (engine methods as ``RolloutRole``'s)."""

    def __init__(self, cfg: Any, ctx: Any, engine_ctx: Any, num_threads: int | None = None):
        from relax.core.controller.contexts import plugin_params
        from relax.core.engines.hosted import hosted_engine

        super().__init__(cfg, ctx, num_threads=num_threads)
        self.engine = hosted_engine(self.trainer, plugin_params(cfg, "rollout_engine"), engine_ctx)
        self.engine_index = engine_ctx.index

    generate = _Rollout.generate
    update_weights = _Rollout.update_weights
    weight_version = _Rollout.weight_version
    weight_receiver = _Rollout.weight_receiver
    pause = _Rollout.pause
    resume = _Rollout.resume
    abort = _Rollout.abort
    release_memory = _Rollout.release_memory
    resume_memory = _Rollout.resume_memory
    health = _Rollout.health

    def capabilities(self) -> list[str]:
        """Both roles' optional methods (each start-up check looks for its own names)."""
        return sorted({*capabilities(self.trainer), *capabilities(self.engine)})

    def publish_version(self, version: int) -> int:
        """``HostedSync``'s endpoint: the weights as they are now are ``version``."""
        self.engine.end_weight_update(version)
        return self.engine.weight_version()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """A trainer method, else an engine method (inspection in tests and tools)."""
        target = self.trainer if hasattr(self.trainer, method) else self.engine
        return getattr(target, method)(*args, **kwargs)


HostRole = lazy_ray.remote(_Host)
