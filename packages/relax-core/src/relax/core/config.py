"""Typed, frozen run config: YAML + dotted overrides -> validated dataclasses.

Validation happens before anything starts and raises one ``ConfigError`` listing every problem,
each naming the field path and, where there is a closed set, the allowed values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from relax.core.algorithms.config import AlgorithmConfig, KLConfig
from relax.core.algorithms.validate import algorithm_config_errors
from relax.core.config_build import build_dataclass, merge_trees, parse_overrides
from relax.core.config_cluster import ClusterConfig, cluster_errors
from relax.core.config_lengths import length_errors
from relax.core.config_plugins import (  # noqa: F401  (PLUGIN_SECTIONS, build_section: imported from here by plugins)
    PLUGIN_SECTIONS,
    build_section,
    derived_reward_timeout,
    plugin_errors,
    plugin_run_errors,
    typed_plugin_sections,
)
from relax.core.config_trainer import LoraConfig, TrainerConfig, lora_errors, offload_errors
from relax.core.control.settings import AutoscalerConfig, ControlConfig, control_errors
from relax.core.errors import ConfigError
from relax.core.evaluation.settings import eval_errors, eval_plugin_errors

__all__ = [
    "AlgorithmConfig",
    "AutoscalerConfig",
    "CheckpointConfig",
    "ConfigError",
    "ControlConfig",
    "DataConfig",
    "EvalConfig",
    "EvalSetConfig",
    "KLConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "QueueConfig",
    "RayConfig",
    "RelaxConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainerConfig",
    "WeightSyncConfig",
    "load_config",
]


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None  # HF-format directory; None = the locally built quick-start model
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


@dataclass(frozen=True)
class DataConfig:
    path: str | None = None  # local .jsonl/.parquet; None = generate the quick-start arithmetic task
    prompt_key: str = "prompt"
    label_key: str = "label"
    metadata_keys: list[str] = field(default_factory=list)
    media_keys: list[str] = field(default_factory=list)
    system_prompt: str | None = None
    apply_chat_template: bool = True
    max_prompt_length: int = 512
    shuffle: bool = True
    on_error: Literal["raise", "skip"] = "raise"
    processor: str = "text"  # registered processor name: turns a row's prompt into model inputs
    processor_params: Any = field(default_factory=dict)  # typed by the processor's registered config
    # quick-start task (used only when path is None)
    task_size: int = 2000
    task_max_operand: int = 9
    task_heldout: int = (
        0  # problems kept out of training, written as the held-out split (eval.sets.<name>.path: null)
    )


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = "hf"  # registered rollout_engine name
    num_engines: int = 1
    prompts_per_step: int = 16
    n_samples_per_prompt: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # benchmarks/tests: always generate max_new_tokens
    # async/hybrid: what happens to in-flight sequences when new weights arrive
    partial_rollout: Literal["in_place", "abort"] = "in_place"
    # faults: a generate call that takes longer than timeout_s, or a pause/resume/abort/health call
    # unanswered after control_timeout_s, evicts its engine (its requests go to the others); lost
    # engines are replaced (synced to the current weights) up to max_restarts times in all, waiting
    # restart_backoff_s first (doubled after each replacement that fails to start)
    timeout_s: float = 600.0
    control_timeout_s: float = 30.0
    max_restarts: int = 3
    restart_backoff_s: float = 1.0
    engine_params: Any = field(default_factory=dict)  # typed by the engine's registered config
    # where the engine runs: "trainer" = inside the trainer's actor, sampling with the trainer's own
    # module (no second process, model copy or weight transfer; colocate, one hf engine, one torch
    # trainer rank on the same device); "driver" = that, with the trainer and a reward declared in_driver in
    # the driver's own process (no actor, no Ray started; also no reference/teacher model, cluster or
    # control plane); "separate" = its own actor; "auto" = the first of driver, trainer, separate allowed
    host: Literal["auto", "driver", "trainer", "separate"] = "auto"
    # colocate: engines free their accelerator memory (weights, KV cache) after generating and take it back
    # before the weight sync, so the trainer gets the device to itself (the engine must implement it)
    release_memory: bool = False


@dataclass(frozen=True)
class EnvironmentConfig:
    """Multi-turn rollouts (``relax.core.agentic``): each sample is an episode of policy turns and
    observations. ``name: null`` keeps single-completion rollouts."""

    name: str | None = None  # registered environment name
    params: Any = field(default_factory=dict)  # typed by the environment's registered config
    tool_parser: str = "none"  # registered tool_parser: finds tool calls in a turn's text
    tool_parser_params: Any = field(default_factory=dict)
    max_turns: int = 4  # policy turns per episode
    max_total_tokens: int = 512  # response tokens per episode, observations included
    max_observation_tokens: int = 256  # one observation longer than this is cut (counted as truncated)
    turn_timeout_s: float = 30.0  # longest one episode call (a tool) may take; overrun ends the episode
    on_tool_error: Literal["observe", "end"] = (
        "observe"  # a failed or malformed tool call: error observation, or end the episode
    )


@dataclass(frozen=True)
class InputsConfig:
    """Inputs built on first use by a plugin (``relax_register_inputs``): fills the null ``model.path`` /
    ``data.path`` (...) it names; ``name: null`` = none (the quick-start's own are core's)."""

    name: str | None = None
    params: Any = field(default_factory=dict)


@dataclass(frozen=True)
class RewardConfig:
    name: str = "numeric"  # registered reward name
    params: Any = field(default_factory=dict)  # typed by the reward's registered config
    timeout_s: float = 30.0
    max_concurrency: int = 16
    on_error: Literal["raise", "zero"] = "raise"  # zero: a failed or timed-out sample scores fallback_score
    fallback_score: float = 0.0


@dataclass(frozen=True)
class WeightSyncConfig:
    transport: str = "object_store"  # registered weight_sync name
    timeout_s: float = 120.0
    bucket_mb: int = 64
    every_n_steps: int = 1
    params: Any = field(default_factory=dict)  # typed by the transport's registered config


@dataclass(frozen=True)
class QueueConfig:
    name: str = "ray"  # registered queue name (async/hybrid modes)
    timeout_s: float = 600.0  # longest a role waits for rows before failing with a clear error


@dataclass(frozen=True)
class CheckpointConfig:
    save_every: int = 0  # 0 = none during the run (the final one is save_final's)
    resume: str = "auto"  # "auto" | "never" | a checkpoint directory
    keep_last: int = 2
    save_hf_final: bool = True
    save_final: bool = True  # a trainer checkpoint after the last step (resume, relax convert); false: none


@dataclass(frozen=True)
class LoggingConfig:
    console: bool = True
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "relax"
    clearml: bool = False
    plot: bool = True
    progress: bool = True
    webhook_url: str | None = None  # JSON POST on completion/failure (kept; notify_urls covers more events)
    notify_urls: list[str] = field(
        default_factory=list
    )  # Apprise URLs: start, failure, recovery, scaling, completion
    log_samples: int = (
        0  # K training samples per step to <run_dir>/samples.jsonl (+ a W&B table, TensorBoard text)
    )
    # failed episodes, tools, rewards (relax.core.failures): the first N of each kind per step logged with their
    # reason; every one in <run_dir>/failures.jsonl; the run stops when more than this fraction of its samples
    # failed over failure_window_steps steps (or over the whole run, at its end); 1.0 never stops it
    failure_warnings: int = 3
    fail_if_failure_rate_above: float = 0.5
    failure_window_steps: int = 3


@dataclass(frozen=True)
class EvalSetConfig:
    """One held-out set (``eval.sets.<name>``, docs/evaluation.md); null fields take the run's own."""

    path: str | None = None  # .jsonl/.parquet like data.path; null = the quick-start task's held-out split
    prompt_key: str | None = None  # null: data.prompt_key (and so on for the label)
    label_key: str | None = None
    source_key: str | None = "data_source"  # a row column naming its source: metrics per source too
    reward: RewardConfig | None = None  # null: the run's reward section
    environment: EnvironmentConfig | None = None  # null: the run's environment (agentic sets)
    n_samples: int = 1  # responses per prompt (the k of pass@k, mean@k, maj@k)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int | None = None  # null: rollout.max_new_tokens
    max_prompts: int | None = None  # the first N usable rows only (a cheap subset)


@dataclass(frozen=True)
class EvalConfig:
    sets: dict[str, EvalSetConfig] = field(default_factory=dict)
    every_n_steps: int = 0  # 0: only before_train / at_end
    before_train: bool = True  # step 0: the starting model's score
    at_end: bool = True  # after the last step (once, also when every_n_steps divides it)


@dataclass(frozen=True)
class RayConfig:
    address: str | None = None  # None = start an embedded local instance
    num_cpus: int | None = None
    # the interface this machine's Ray binds and advertises: null = 127.0.0.1 for an embedded Ray
    # (nothing listens beyond loopback), Ray's choice when joining a cluster
    node_ip_address: str | None = None
    # role -> the ``relax-node`` label of the nodes it must run on (``ray start --labels relax-node=train``);
    # roles: trainer, rollout, reward, reference, teacher; unset: any node (see docs/cluster.md)
    nodes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RelaxConfig:
    name: str = "quickstart"
    run_dir: str = "runs/quickstart"
    seed: int = 0
    total_steps: int = 100
    mode: Literal["colocate", "async", "hybrid"] = "colocate"
    max_staleness: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    inputs: InputsConfig = field(default_factory=InputsConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)  # held-out evaluation (relax.core.evaluation)
    ray: RayConfig = field(default_factory=RayConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # the GPUs it is sized for (memory plan)
    control: ControlConfig = field(default_factory=ControlConfig)  # REST control plane (relax.core.control)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for display and experiment trackers: secrets (``control.token``) are redacted."""
        out = dataclasses.asdict(self)
        if out["control"].get("token"):
            out["control"]["token"] = "<redacted>"
        return out


# --------------------------------------------------------------------------- loading


def config_from_dict(
    data: dict[str, Any], check_plugins: bool = True, check_paths: bool = False, build_inputs: bool = True
) -> RelaxConfig:
    """``check_paths``: also check that data, model and run_dir are usable (the CLI does); with
    ``inputs.name`` set, its plugin first builds the inputs the config leaves null (``relax.core.inputs``),
    unless ``build_inputs`` is False (``relax validate``: validation builds no model)."""
    from relax.core.checks import launch_errors

    errors: list[str] = []
    cfg = build_dataclass(RelaxConfig, data, "", errors)
    if cfg is not None:
        errors.extend(_semantic_errors(cfg))
        if check_plugins:
            errors.extend(plugin_errors(cfg))
            from relax.core.plugins import get_plugin_manager

            errors.extend(eval_plugin_errors(cfg, get_plugin_manager(), build_section))
            if not errors:
                cfg = typed_plugin_sections(cfg, errors)
                cfg = derived_reward_timeout(cfg, data)
                errors.extend(plugin_run_errors(cfg))
        if check_paths and check_plugins and build_inputs and not errors:
            from relax.core.inputs import fill_inputs

            filled = fill_inputs(cfg, data)
            if filled is not None:
                return config_from_dict(filled, check_plugins, check_paths)
        errors.extend(launch_errors(cfg, check_paths=check_paths, known=errors))
    if errors:
        raise config_error(errors)
    return cfg


def with_inputs(cfg: RelaxConfig) -> RelaxConfig:
    """``cfg`` with its generated inputs filled in (``run(cfg)``; the CLI's loader fills them itself)."""
    from relax.core.inputs import fill_inputs

    filled = fill_inputs(cfg, dataclasses.asdict(cfg))
    return cfg if filled is None else config_from_dict(filled)


def config_error(errors: list[str]) -> ConfigError:
    return ConfigError("invalid config:\n  " + "\n  ".join(errors))


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    check_plugins: bool = True,
    check_paths: bool = False,
    build_inputs: bool = True,
) -> RelaxConfig:
    """Load YAML (or the bundled quick-start when ``path`` is None), apply overrides, validate
    (``build_inputs``: see :func:`config_from_dict`)."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML ({exc})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping, got {type(loaded).__name__}")
        data = loaded
    else:
        data = quickstart_dict()
    data = merge_trees(data, parse_overrides(overrides or []))
    try:
        return config_from_dict(
            data, check_plugins=check_plugins, check_paths=check_paths, build_inputs=build_inputs
        )
    except ConfigError as exc:
        if path is None:
            raise
        from relax.core.config_paths import with_path_hints  # relative paths: the cwd rule, and a hint

        raise with_path_hints(exc, data, Path(path)) from None


def quickstart_dict() -> dict[str, Any]:
    """The bundled quick-start (same content as examples/quickstart.yaml)."""
    from importlib import resources

    text = resources.files("relax.core").joinpath("quickstart.yaml").read_text()
    return yaml.safe_load(text)


# --------------------------------------------------------------------------- validation


def _positive(errors: list[str], path: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        errors.append(f"{path}: must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def _semantic_errors(cfg: RelaxConfig) -> list[str]:
    errors: list[str] = []
    for path, value, zero_ok in [
        ("total_steps", cfg.total_steps, False),
        ("max_staleness", cfg.max_staleness, True),
        ("rollout.num_engines", cfg.rollout.num_engines, False),
        ("rollout.prompts_per_step", cfg.rollout.prompts_per_step, False),
        ("rollout.n_samples_per_prompt", cfg.rollout.n_samples_per_prompt, False),
        ("rollout.max_new_tokens", cfg.rollout.max_new_tokens, False),
        ("rollout.temperature", cfg.rollout.temperature, False),
        ("rollout.top_k", cfg.rollout.top_k, True),
        ("trainer.lr", cfg.trainer.lr, False),
        ("trainer.micro_batch_size", cfg.trainer.micro_batch_size, False),
        ("trainer.num_minibatches", cfg.trainer.num_minibatches, False),
        ("trainer.max_tokens_per_micro_batch", cfg.trainer.max_tokens_per_micro_batch, True),
        ("trainer.logits_chunk_tokens", cfg.trainer.logits_chunk_tokens, True),
        ("trainer.warmup_steps", cfg.trainer.warmup_steps, True),
        ("trainer.grad_clip", cfg.trainer.grad_clip, True),
        ("reward.timeout_s", cfg.reward.timeout_s, False),
        ("weight_sync.timeout_s", cfg.weight_sync.timeout_s, False),
        ("weight_sync.every_n_steps", cfg.weight_sync.every_n_steps, False),
        ("queue.timeout_s", cfg.queue.timeout_s, False),
        ("rollout.timeout_s", cfg.rollout.timeout_s, False),
        ("rollout.control_timeout_s", cfg.rollout.control_timeout_s, False),
        ("rollout.max_restarts", cfg.rollout.max_restarts, True),
        ("rollout.restart_backoff_s", cfg.rollout.restart_backoff_s, True),
        ("trainer.timeout_s", cfg.trainer.timeout_s, False),
        ("trainer.max_restarts", cfg.trainer.max_restarts, True),
        ("checkpoint.save_every", cfg.checkpoint.save_every, True),
        ("checkpoint.keep_last", cfg.checkpoint.keep_last, False),
        ("logging.log_samples", cfg.logging.log_samples, True),
        ("logging.failure_warnings", cfg.logging.failure_warnings, True),
        ("logging.failure_window_steps", cfg.logging.failure_window_steps, False),
        ("data.max_prompt_length", cfg.data.max_prompt_length, False),
        ("algorithm.kl.coef", cfg.algorithm.kl.coef, True),
        ("environment.max_turns", cfg.environment.max_turns, False),
        ("environment.max_total_tokens", cfg.environment.max_total_tokens, False),
        ("environment.max_observation_tokens", cfg.environment.max_observation_tokens, False),
        ("environment.turn_timeout_s", cfg.environment.turn_timeout_s, False),
    ]:
        _positive(errors, path, value, zero_ok)
    if not 0 <= cfg.logging.fail_if_failure_rate_above <= 1:
        errors.append(
            f"logging.fail_if_failure_rate_above: must be in [0, 1], got {cfg.logging.fail_if_failure_rate_above!r}"
        )
    if not 0 < cfg.rollout.top_p <= 1:
        errors.append(f"rollout.top_p: must be in (0, 1], got {cfg.rollout.top_p!r}")
    if len(cfg.trainer.betas) != 2:
        errors.append(f"trainer.betas: expected 2 values, got {cfg.trainer.betas!r}")
    if not 0 <= cfg.trainer.min_lr_ratio <= 1:
        errors.append(f"trainer.min_lr_ratio: must be in [0, 1], got {cfg.trainer.min_lr_ratio!r}")
    if cfg.algorithm.clip_ratio_low < 0 or cfg.algorithm.clip_ratio_high < 0:
        errors.append("algorithm.clip_ratio_low/high: must be >= 0")
    batch = cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt
    if batch % cfg.trainer.num_minibatches:
        errors.append(
            f"trainer.num_minibatches: {cfg.trainer.num_minibatches} does not divide the step batch "
            f"(rollout.prompts_per_step * rollout.n_samples_per_prompt = {batch})"
        )
    errors.extend(algorithm_config_errors(cfg))
    errors.extend(control_errors(cfg))
    errors.extend(lora_errors(cfg))
    errors.extend(cluster_errors(cfg))
    errors.extend(offload_errors(cfg))
    errors.extend(length_errors(cfg))
    errors.extend(eval_errors(cfg))
    if cfg.mode == "colocate" and cfg.max_staleness != 0:
        errors.append(
            f"max_staleness: mode 'colocate' is strictly on-policy and needs 0, got {cfg.max_staleness}"
        )
    if cfg.mode == "colocate" and cfg.weight_sync.every_n_steps != 1:
        errors.append(
            f"weight_sync.every_n_steps: mode 'colocate' is strictly on-policy and syncs every step, got {cfg.weight_sync.every_n_steps}"
        )
    if cfg.mode != "colocate":
        for path, on in [
            ("algorithm.dynamic_sampling.enable", cfg.algorithm.dynamic_sampling.enable),
            ("algorithm.greedy_baseline", cfg.algorithm.greedy_baseline),
            ("rollout.release_memory", cfg.rollout.release_memory),
        ]:
            if on:
                errors.append(
                    f"{path}: supported in mode 'colocate' only (rollout and training take turns), got mode {cfg.mode!r}"
                )
    if cfg.mode != "colocate" and cfg.weight_sync.every_n_steps > cfg.max_staleness + 1:
        errors.append(
            f"weight_sync.every_n_steps: {cfg.weight_sync.every_n_steps} would make rollout wait forever with "
            f"max_staleness={cfg.max_staleness}; needs <= max_staleness + 1"
        )
    if cfg.checkpoint.resume not in ("auto", "never") and not Path(cfg.checkpoint.resume).exists():
        errors.append(
            f"checkpoint.resume: {cfg.checkpoint.resume!r} is neither 'auto', 'never' nor an existing directory"
        )
    if (
        cfg.data.path is not None
        and Path(cfg.data.path).suffix not in (".jsonl", ".json", ".parquet")
        and not Path(cfg.data.path).is_dir()
    ):
        errors.append(
            f"data.path: {cfg.data.path!r} must be a .jsonl, .json or .parquet file or a dataset directory"
        )
    return errors
