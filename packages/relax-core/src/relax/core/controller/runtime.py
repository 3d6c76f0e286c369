"""Ray start-up and the pieces every mode needs: model path, tokenizer, dataset, roles."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from relax.core.config import RelaxConfig

log = logging.getLogger("relax")

RAY_ENV = {
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",  # uv-run drivers would otherwise rebuild a venv per worker
    "RAY_USAGE_STATS_ENABLED": "0",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def init_ray(cfg: RelaxConfig) -> bool:
    """Start an embedded local Ray (or join ``ray.address``). Returns True if we started it."""
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    if ray.is_initialized():
        return False
    forwarded = (*RAY_ENV, "RAY_AUTH_MODE", "WANDB_MODE", "RELAX_CACHE_DIR", "OMP_NUM_THREADS", "RELAX_PLUGINS",
                 "RELAX_DISABLE_PLUGINS", "PYTHONPATH")
    worker_env = {k: os.environ[k] for k in forwarded if k in os.environ}
    kwargs: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": True,
        "runtime_env": {"env_vars": worker_env},
    }
    if cfg.ray.address:
        kwargs["address"] = cfg.ray.address
    else:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        kwargs["num_cpus"] = cfg.ray.num_cpus or max(2, os.cpu_count() or 2)
    ray.init(**kwargs)
    return True


def resolve_model_path(cfg: RelaxConfig) -> str:
    if cfg.model.path:
        if not Path(cfg.model.path).is_dir():
            raise FileNotFoundError(f"model.path: {cfg.model.path!r} is not a directory (HF-format model expected)")
        return cfg.model.path
    from relax.core.quickstart_model import ensure_quickstart_model

    return ensure_quickstart_model()


def resolve_data_path(cfg: RelaxConfig, run_dir: Path) -> str:
    if cfg.data.path:
        return cfg.data.path
    from relax.core.tasks.arithmetic import write_arithmetic_jsonl

    path = run_dir / "data" / "arithmetic.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_arithmetic_jsonl(path, n=cfg.data.task_size, seed=cfg.seed, max_operand=cfg.data.task_max_operand)
    return str(path)


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

    processor = build_plugin(cfg, "processor", processor_context(cfg, model_path)) if d.apply_chat_template else None
    return PromptDataset(dataset_cfg, tokenizer, processor)


@dataclass
class Roles:
    trainer: Any  # policy (and critic, when algorithm.critic.enable)
    reference: Any | None
    engines: list[Any]
    reward: Any
    teacher: Any | None = None  # distillation teacher (frozen), when the algorithm reads teacher logprobs

    def handles(self) -> list[Any]:
        """Every actor handle, for shutdown."""
        return [h for h in (self.trainer, self.reference, self.teacher, self.reward, *self.engines) if h is not None]


def teacher_path(cfg: RelaxConfig, model_path: str) -> str | None:
    """The distillation teacher's directory, or None when no loss reads teacher logprobs."""
    from relax.core.algorithms.config import POLICY_INIT

    a = cfg.algorithm
    if not (a.policy_loss == "opd" or a.opd_coef > 0):
        return None
    return model_path if a.teacher_model_path == POLICY_INIT else a.teacher_model_path


def start_roles(cfg: RelaxConfig, model_path: str) -> Roles:
    """Place trainer (with its critic, if any), optional reference and teacher, engines and reward
    as Ray actors (CPU: fractional CPUs).

    The critic lives inside the trainer actor: it trains on the same batches right after the
    policy, so it saves a process (and a model copy in flight) and is checkpointed with the trainer.
    """
    from relax.core.controller import capabilities, contexts
    from relax.core.controller.roles import RewardRole, RolloutRole, TrainerRole

    threads = max(1, (os.cpu_count() or 2))
    trainer = TrainerRole.options(num_cpus=0).remote(cfg, contexts.trainer_context(cfg, model_path), num_threads=threads)
    reference = None
    if cfg.algorithm.kl.coef > 0:
        ctx = contexts.trainer_context(cfg, model_path, role="reference")
        reference = TrainerRole.options(num_cpus=0).remote(cfg, ctx, num_threads=threads)
    teacher = None
    if (path := teacher_path(cfg, model_path)) is not None:
        ctx = contexts.trainer_context(cfg, path, role="teacher")
        teacher = TrainerRole.options(num_cpus=0).remote(cfg, ctx, num_threads=threads)
    engines = [
        RolloutRole.options(num_cpus=0, max_concurrency=4).remote(
            cfg, contexts.engine_context(cfg, model_path, i), num_threads=threads
        )
        for i in range(cfg.rollout.num_engines)
    ]
    reward = RewardRole.options(num_cpus=0).remote(cfg, contexts.reward_context(cfg, model_path, engines))
    roles = Roles(trainer, reference, engines, reward, teacher)
    # surface constructor errors (bad model dir, unknown plugin) before the loop starts
    ray.get([h.__ray_ready__.remote() for h in roles.handles()])
    capabilities.check(cfg, {
        "trainer": (cfg.trainer.backend, ray.get(trainer.capabilities.remote())),
        "rollout": (cfg.rollout.engine, ray.get(engines[0].capabilities.remote())),
    })
    return roles
