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
    worker_env = {k: os.environ[k] for k in (*RAY_ENV, "RAY_AUTH_MODE", "WANDB_MODE", "RELAX_CACHE_DIR", "OMP_NUM_THREADS") if k in os.environ}
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


def build_dataset(cfg: RelaxConfig, tokenizer: Any, data_path: str):
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
    return PromptDataset(dataset_cfg, tokenizer)


@dataclass
class Roles:
    trainer: Any
    reference: Any | None
    engines: list[Any]
    reward: Any


def start_roles(cfg: RelaxConfig, model_path: str) -> Roles:
    """Place trainer, optional reference, engines and reward as Ray actors (CPU: fractional CPUs)."""
    from relax.core.controller.roles import RewardRole, RolloutRole, TrainerRole

    threads = max(1, (os.cpu_count() or 2))
    trainer = TrainerRole.options(num_cpus=0).remote(cfg, model_path, num_threads=threads)
    reference = None
    if cfg.algorithm.kl.coef > 0:
        reference = TrainerRole.options(num_cpus=0).remote(cfg, model_path, reference=True, num_threads=threads)
    engines = [
        RolloutRole.options(num_cpus=0, max_concurrency=4).remote(cfg, model_path, i, num_threads=threads)
        for i in range(cfg.rollout.num_engines)
    ]
    reward = RewardRole.options(num_cpus=0).remote(cfg)
    # surface constructor errors (bad model dir, unknown plugin) before the loop starts
    ray.get([trainer.__ray_ready__.remote(), reward.__ray_ready__.remote(), *[e.__ray_ready__.remote() for e in engines]]
            + ([reference.__ray_ready__.remote()] if reference else []))
    return Roles(trainer, reference, engines, reward)
