"""Ray start-up and the pieces every mode needs: model path, tokenizer, dataset, roles."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray

from relax.core.config import RelaxConfig
from relax.core.controller import ray_start

log = logging.getLogger("relax")


def init_ray(cfg: RelaxConfig) -> bool:
    """Start the Ray ``cfg`` asks for (see :func:`ray_start.start_ray`); True if we started it.
    A run whose roles all live in the driver (``rollout.host: driver``) starts none."""
    from relax.core.controller.hosting import in_driver

    return False if in_driver(cfg) else ray_start.start_ray(ray_settings(cfg))


def ray_settings(cfg: RelaxConfig) -> ray_start.RaySettings:
    """The Ray this config needs: its cluster, or an embedded one with :func:`embedded_num_cpus`."""
    if cfg.ray.address:
        return ray_start.RaySettings(cfg.ray.address, cfg.ray.node_ip_address)
    return ray_start.RaySettings(None, cfg.ray.node_ip_address, embedded_num_cpus(cfg))


def embedded_num_cpus(cfg: RelaxConfig) -> int:
    """Logical CPUs for an embedded Ray: the machine's cores, raised to what the config reserves
    (placement groups count logical CPUs; several roles may share a core, torch threads are
    limited per role). An explicit ``ray.num_cpus`` below the reservation is an error."""
    from relax.core.controller.placement import required_cpus

    need = required_cpus(cfg)
    if cfg.ray.num_cpus is not None:
        if cfg.ray.num_cpus < need:
            raise ValueError(
                f"ray.num_cpus: {cfg.ray.num_cpus} is less than the {need} CPUs the run reserves (trainer and "
                "engines, see trainer.backend_params / rollout.engine_params num_cpus and world_size); "
                "raise it or leave it null"
            )
        return cfg.ray.num_cpus
    return max(ray_start.default_num_cpus(), need)


def resolve_model_path(cfg: RelaxConfig) -> str:
    if cfg.model.path:
        if not Path(cfg.model.path).is_dir():
            raise FileNotFoundError(
                f"model.path: {cfg.model.path!r} is not a directory (HF-format model expected)"
            )
        return cfg.model.path
    from relax.core.quickstart_model import ensure_quickstart_model

    return ensure_quickstart_model()


def resolve_data_path(cfg: RelaxConfig, run_dir: Path) -> str:
    """``data.path``, or the quick-start task written into ``<run_dir>/data`` (without its ``data.task_heldout``
    held-out problems, written beside it: :func:`heldout_data_path`)."""
    if cfg.data.path:
        return cfg.data.path
    from relax.core.tasks.arithmetic import heldout_rows, write_arithmetic_jsonl

    d, held = cfg.data, cfg.data.task_heldout
    path = run_dir / "data" / (f"arithmetic_train_h{held}.jsonl" if held else "arithmetic.jsonl")
    _write_once(
        path,
        lambda part: write_arithmetic_jsonl(
            part, n=d.task_size, seed=cfg.seed, max_operand=d.task_max_operand, heldout=held
        ),
    )
    if held:
        rows = heldout_rows(held, cfg.seed, d.task_max_operand)
        _write_once(
            heldout_data_path(cfg, run_dir),
            lambda part: part.write_text("".join(json.dumps(r) + "\n" for r in rows)),
        )
    return str(path)


def heldout_data_path(cfg: RelaxConfig, run_dir: Path | None = None) -> Path:
    """The quick-start task's held-out split (``eval.sets.<name>.path: null``)."""
    return Path(run_dir or cfg.run_dir) / "data" / f"arithmetic_heldout_h{cfg.data.task_heldout}.jsonl"


def _write_once(path: Path, write: Callable[[Path], Any]) -> None:
    """``write(part)`` then rename to ``path``, unless it exists: a concurrent reader never sees a partial file."""
    if path.exists():
        return
    import threading

    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.part")
    write(part)
    os.replace(part, path)


def build_dataset(cfg: RelaxConfig, tokenizer: Any, data_path: str, model_path: str):
    from relax.core.dataset import DatasetConfig, PromptDataset

    d = cfg.data
    dataset_cfg = DatasetConfig(
        path=data_path,
        prompt_key=d.prompt_key,
        label_key=d.label_key,
        metadata_keys=tuple(d.metadata_keys),
        media_keys=tuple(d.media_keys),
        system_prompt=d.system_prompt,
        apply_chat_template=d.apply_chat_template,
        max_prompt_length=d.max_prompt_length,
        on_error=d.on_error,
        batch_size=cfg.rollout.prompts_per_step,
        shuffle=d.shuffle,
        seed=cfg.seed,
    )
    from relax.core.controller.contexts import build_plugin, processor_context

    processor = (
        build_plugin(cfg, "processor", processor_context(cfg, model_path)) if d.apply_chat_template else None
    )
    return PromptDataset(dataset_cfg, tokenizer, processor)


@dataclass
class Roles:
    trainer: Any  # policy (and critic, when algorithm.critic.enable); rank 0 when a worker group
    reference: Any | None
    engines: list[Any]
    reward: Any
    teacher: Any | None = None  # distillation teacher (frozen), when the algorithm reads teacher logprobs
    trainer_peers: list[Any] = field(default_factory=list)  # trainer ranks 1.. (led by ``trainer``)
    placement: Any | None = None  # relax.core.controller.placement.Placement; released at shutdown
    hosted: bool = False  # the trainer actor is also engines[0] (``rollout.host``, controller.hosting)

    def handles(self) -> list[Any]:
        """Every actor handle, for shutdown."""
        from relax.core.weight_sync.base import is_actor

        return [
            h
            for h in (
                self.trainer,
                *self.trainer_peers,
                self.reference,
                self.teacher,
                self.reward,
                *self.engines,
            )
            if is_actor(h)
        ]  # a role in the driver is none

    def release(self) -> None:
        """Kill every actor and release the placement groups (idempotent; Ray may already be gone)."""
        for handle in self.handles():
            try:
                ray.kill(handle)
            except Exception as exc:  # already dead, or Ray shut down
                log.debug("kill failed: %s", exc)
        if self.placement is not None:
            self.placement.remove()


def teacher_path(cfg: RelaxConfig, model_path: str) -> str | None:
    """The distillation teacher's directory, or None when the algorithm reads no teacher logprobs
    (what it reads is declared at registration: ``relax.core.algorithms.config_needs``)."""
    from relax.core.algorithms import config_needs
    from relax.core.algorithms.config import POLICY_INIT

    a = cfg.algorithm
    if "teacher" not in config_needs(a):
        return None
    return model_path if a.teacher_model_path == POLICY_INIT else a.teacher_model_path


def start_roles(cfg: RelaxConfig, model_path: str, placement_timeout_s: float | None = None) -> Roles:
    """Reserve the declared resources (``controller.placement``), then start trainer (with its
    critic, if any; a worker group of rank actors when the backend declares ``num_workers > 1``),
    engines on their bundles, and the reward, reference and teacher with no reservation (reference
    and teacher only when the algorithm needs them: ``relax.core.algorithms.config_needs``).
    On any start-up failure every actor is killed and every placement group released.

    The critic lives inside the trainer actor: it trains on the same batches right after the
    policy, so it saves a process (and a model copy in flight) and is checkpointed with the trainer.
    """
    from relax.core.controller import hosting, placement

    if hosting.in_driver(cfg):
        return start_local_roles(cfg, model_path)
    reserved = placement.reserve(
        placement.plan_for(cfg),
        timeout_s=placement.DEFAULT_TIMEOUT_S if placement_timeout_s is None else placement_timeout_s,
        fixed_cluster=not cfg.ray.address,
        run_name=cfg.name,
    )
    roles = Roles(None, None, [], None, placement=reserved)
    try:
        _start_actors(cfg, model_path, roles)
        _check_capabilities(cfg, roles)
    except BaseException:
        roles.release()
        raise
    return roles


def start_local_roles(cfg: RelaxConfig, model_path: str) -> Roles:
    """``rollout.host: driver``: the trainer (serving rollout with its own module, as a hosted
    actor would) and the built-in reward built in this process, behind ``controller.local`` handles.
    No actor and no Ray: see :func:`relax.core.controller.hosting.in_driver`."""
    from relax.core.controller import contexts, hosting
    from relax.core.controller.driver_reward import start_reward
    from relax.core.controller.local import LocalHandle
    from relax.core.controller.roles import HostRole

    threads = hosting.host_threads(max(1, os.cpu_count() or 2), driver=True)
    host = HostRole.__ray_actor_class__(
        cfg,
        contexts.trainer_context(cfg, model_path),
        contexts.engine_context(cfg, model_path, 0),
        num_threads=threads,
    )
    trainer = LocalHandle(host)
    roles = Roles(trainer, None, [trainer], None, hosted=True)
    roles.reward = start_reward(cfg, contexts.reward_context(cfg, model_path, roles.engines))
    _check_capabilities(cfg, roles)
    return roles


def _check_capabilities(cfg: RelaxConfig, roles: Roles) -> None:
    """The optional methods the config needs of trainer and engine (``controller.capabilities``)."""
    from relax.core.controller import capabilities, local

    capabilities.check(
        cfg,
        {
            "trainer": (cfg.trainer.backend, local.get(roles.trainer.capabilities.remote())),
            "rollout": (cfg.rollout.engine, local.get(roles.engines[0].capabilities.remote())),
        },
    )


#: an engine's actor threads: generate calls of up to ``max_staleness + 1`` concurrent steps (two
#: chunks each, plus resubmissions) must leave threads free for pause/resume/health calls
ENGINE_CONCURRENCY = 32


def engine_starter(cfg: RelaxConfig, model_path: str, roles: Roles) -> Callable[..., Any]:
    """``start(index, slot, engine_params=None)``: how the fleet creates an engine for this run (a new
    one, a replacement, one attached by URL with its own ``rollout.engine_params`` fields)."""
    from relax.core.controller.fleet import with_engine_params

    def start(index: int, slot: int | None = None, engine_params: dict[str, Any] | None = None) -> Any:
        if roles.hosted:
            raise RuntimeError(
                "rollout.host: the run's engine lives in the trainer's process; more engines (or a "
                "replacement) need rollout.host=separate"
            )
        run_cfg = with_engine_params(cfg, engine_params) if engine_params else cfg  # e.g. attached by URL
        # a slot's reservation is on an alive node by now: the fleet waits for that (controller.places), never
        # starting an engine outside it while Ray re-places it -- the two would then compete for one node's room
        return start_engine(run_cfg, model_path, index, roles.placement, slot)

    return start


def start_engine(
    cfg: RelaxConfig, model_path: str, index: int, placement: Any | None, slot: int | None
) -> Any:
    """Create rollout engine ``index`` (returns at once; the actor loads in the background).

    ``slot``: which configured engine's reservation it runs on -- a replacement takes the slot of
    the engine it replaces; None (an engine added at run time) runs outside the reservation with
    the resources the engine declares."""
    from relax.core.cluster import actor_options, node_of
    from relax.core.controller import contexts
    from relax.core.controller.roles import RolloutRole

    if slot is not None and placement is not None:
        options = placement.engine_options(slot)
    else:
        declared = contexts.resources_for(cfg, "rollout_engine")
        workers = max(1, declared.num_workers)
        # on pinned rollout nodes (``ray.nodes``) it asks the CPUs a reserved engine holds, so Ray puts it where
        # there is room -- a node that joined -- or waits for one; unpinned, one machine's CPUs are all reserved
        cpus = declared.num_cpus * workers if node_of(cfg, "rollout") else 0
        options = {"num_cpus": cpus, "num_gpus": declared.num_gpus * workers, **actor_options(cfg, "rollout")}
    return RolloutRole.options(**options, max_concurrency=ENGINE_CONCURRENCY).remote(
        cfg, contexts.engine_context(cfg, model_path, index), num_threads=max(1, os.cpu_count() or 2)
    )


def build_weight_sync(cfg: RelaxConfig, model_path: str, hosted: bool) -> Any:
    """The run's transport: ``weight_sync.transport`` (checked against the engine and against the
    ``WeightSync`` protocol), or for a trainer-hosted engine the version-only ``HostedSync`` (nothing
    to move), which bypasses the configured transport: said once here."""
    from relax.core.controller.contexts import base_context, build_plugin
    from relax.core.protocols import WeightSync

    ctx = base_context(cfg, "weight_sync", model_path)
    if hosted:
        from relax.core.weight_sync.hosted import HostedSync

        chosen = cfg.weight_sync.transport
        log.info(
            "relax: weight_sync.transport %r is not used: rollout.host=%s runs the engine on the trainer's own "
            "module, so a weight sync only publishes the version (0 bytes move); use rollout.host=separate to "
            "send weights through %r",
            chosen,
            cfg.rollout.host,
            chosen,
        )
        return HostedSync(ctx=ctx)
    transport = build_plugin(cfg, "weight_sync", ctx)
    if not isinstance(transport, WeightSync):
        missing = [m for m in ("sync", "check_engine", "close") if not callable(getattr(transport, m, None))]
        raise TypeError(
            f"weight_sync.transport {cfg.weight_sync.transport!r}: {type(transport).__name__} is not a "
            f"WeightSync (relax.core.protocols); it lacks {', '.join(missing)}"
        )
    transport.check_engine(cfg.rollout.engine)  # the transport serves this engine?
    return transport


def _start_actors(cfg: RelaxConfig, model_path: str, roles: Roles) -> None:
    """Fill ``roles`` as actors start, so that a failure can release what was started."""
    from relax.core.algorithms import config_needs
    from relax.core.cluster import actor_options
    from relax.core.controller import contexts, hosting
    from relax.core.controller.driver_reward import start_reward
    from relax.core.controller.roles import HostRole, TrainerRole
    from relax.core.controller.worker_group import spawn

    cores = max(1, os.cpu_count() or 2)
    reserved = roles.placement
    roles.hosted = hosting.hosts_engine(cfg)
    if (
        "reference" in config_needs(cfg.algorithm) and cfg.trainer.lora is None
    ):  # by the estimator/loss, or kl.coef > 0
        ref_ctx = contexts.trainer_context(cfg, model_path, role="reference")
        roles.reference = TrainerRole.options(num_cpus=0, **actor_options(cfg, "reference")).remote(
            cfg, ref_ctx, num_threads=cores
        )
    if (path := teacher_path(cfg, model_path)) is not None:
        teacher_ctx = contexts.trainer_context(cfg, path, role="teacher")
        roles.teacher = TrainerRole.options(num_cpus=0, **actor_options(cfg, "teacher")).remote(
            cfg, teacher_ctx, num_threads=cores
        )
    trainer_opts = reserved.trainer_options()
    ctx = contexts.trainer_context(cfg, model_path)
    if roles.hosted:  # one process: the trainer serves rollout with its own module
        roles.trainer = HostRole.options(**trainer_opts[0], max_concurrency=ENGINE_CONCURRENCY).remote(
            cfg, ctx, contexts.engine_context(cfg, model_path, 0), num_threads=hosting.host_threads(cores)
        )
        roles.engines = [roles.trainer]
    else:
        roles.engines = [
            start_engine(cfg, model_path, i, reserved, slot=i) for i in range(cfg.rollout.num_engines)
        ]
    roles.reward = start_reward(
        cfg, contexts.reward_context(cfg, model_path, roles.engines)
    )  # maybe in the driver
    if roles.hosted:
        pass  # started above, as engine 0
    elif len(trainer_opts) == 1:
        roles.trainer = TrainerRole.options(**trainer_opts[0]).remote(cfg, ctx, num_threads=cores)
    else:  # a worker group: ranks start together (blocking until they rendezvous); rank 0 leads
        threads = max(1, cores // len(trainer_opts))

        def rank_args(info):
            rank_ctx = replace(
                ctx,
                index=info.rank,
                world_size=info.world_size,
                master_addr=info.master_addr,
                master_port=info.master_port,
            )
            return (cfg, rank_ctx), {"num_threads": threads}

        group = spawn(
            TrainerRole, "trainer", trainer_opts, rank_args, reserved.node_ids(reserved.plan.trainer)
        )
        roles.trainer, roles.trainer_peers = group.handles[0], group.handles[1:]
        ray.get(roles.trainer.lead.remote(group.peers()))
    if "reference" in config_needs(cfg.algorithm) and cfg.trainer.lora is not None:
        from relax.core.controller.reference import TrainerReference

        roles.reference = TrainerReference(roles.trainer)  # LoRA: the base inside the trainer, no second copy
    # surface constructor errors (bad model dir, unknown plugin) before the loop starts, naming the role
    _await_started(roles, max(cfg.rollout.timeout_s, cfg.trainer.timeout_s))


def _await_started(roles: Roles, timeout_s: float) -> None:
    import time

    from relax.core.controller import faults

    named = [("trainer", None, roles.trainer)]
    named += [("trainer rank", r + 1, h) for r, h in enumerate(roles.trainer_peers)]
    named += [
        (role, None, h)
        for role, h in [("reference", roles.reference), ("teacher", roles.teacher), ("reward", roles.reward)]
        if h is not None
    ]
    named += [("rollout engine", i, h) for i, h in enumerate(roles.engines)]
    refs = [(role, index, h.__ray_ready__.remote()) for role, index, h in named]
    deadline = time.monotonic() + timeout_s
    for role, index, ref in refs:
        faults.wait(ref, max(0.0, deadline - time.monotonic()), role, "start-up", index)
